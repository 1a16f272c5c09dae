"""Which runtime optimisations pay? TreeLSTM over UD trees with each one switched off (issue 7).

Usage:
    python benchmarks/autobatch_ablation.py [--sentences 256] [--batch-size 64] [--hidden 256]
                                            [--threads 2] [--compile] [--write-docs]

Variants, all on the same batches in one process, median ms per batch after warm-up:
  eager                one instance at a time (the reference);
  batchcraft           defaults (depth scheduler, direct calls of transparent static blocks);
  no direct blocks     every static block replayed op by op through the batching rules;
  agenda               DyNet's agenda scheduler instead of depth;
  no output arenas     each group's outputs stay separate tensors (a child list from several
                       groups is gathered per source, then reordered);
  compiled blocks      (--compile) static blocks through torch.compile(dynamic=True);
plus host microseconds per recorded operation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _report import save_json, write_section  # noqa: E402
from batchcraft import autobatch  # noqa: E402
from batchcraft.autobatching.execute import Executor  # noqa: E402
from batchcraft.data import load_sentences  # noqa: E402
from batchcraft.measure import format_table, machine_info  # noqa: E402
from batchcraft.measure.compare import batches  # noqa: E402
from batchcraft.models import suite  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = suite.build("treelstm", load_sentences(limit=args.sentences), hidden=args.hidden)
    bs = batches(task.instances, args.batch_size)
    variants = {
        "eager": None,
        "batchcraft (defaults)": dict(),
        "no direct blocks (replay)": dict(direct_blocks=False),
        "agenda scheduler": dict(scheduler="agenda"),
        "no output arenas": dict(_executor=dict(use_arenas=False)),
    }
    if args.compile:
        variants["compiled blocks"] = dict(compile_blocks=True)
    times = {k: [] for k in variants}
    per_op_us = {}
    with torch.no_grad():
        fns = {k: (autobatch(task.fn, **{o: x for o, x in v.items() if o != "_executor"})
                   if v is not None else None) for k, v in variants.items()}
        switches = {k: (v or {}).get("_executor", {}) for k, v in variants.items()}

        def call(k, f, b):
            for name, val in switches[k].items():
                setattr(Executor, name, val)
            try:
                return f(b)
            finally:
                for name in switches[k]:
                    setattr(Executor, name, True)
        ref = [[task.fn(x) for x in b] for b in bs]
        for k, f in fns.items():  # warm-up: inference of signatures, traces, compilation
            if f is not None:
                out = call(k, f, bs[0])
                diff = max((o - r).abs().max().item() for o, r in zip(out, ref[0]))
                assert diff <= 1e-4, (k, diff)
        for _ in range(args.repeats):
            for b in bs:
                for k, f in fns.items():
                    t0 = time.perf_counter()
                    if f is None:
                        [task.fn(x) for x in b]
                    else:
                        call(k, f, b)
                    times[k].append(time.perf_counter() - t0)
                    if f is not None:
                        st = f.stats
                        per_op_us.setdefault(k, []).append(st.record_s / max(st.ops_recorded, 1) * 1e6)
    e = statistics.median(times["eager"]) * 1e3
    rows = []
    for k in variants:
        ms = statistics.median(times[k]) * 1e3
        us = statistics.median(per_op_us[k]) if k in per_op_us else float("nan")
        rows.append([k, ms, e / ms, us])
    headers = ["variant", "ms/batch", "speed-up vs eager", "host µs per recorded op"]
    print(format_table(headers, rows))
    m = machine_info()
    save_json("autobatch_ablation", {"machine": m, "args": vars(args), "rows": rows})
    if args.write_docs:
        cmd = " ".join(["python benchmarks/autobatch_ablation.py"] + (argv or sys.argv[1:]))
        write_section("ablation", f"Command: `{cmd}`\n\nMachine: {m['cpu']}, torch {m['torch']}, "
                      f"{args.threads} threads; TreeLSTM hidden {args.hidden}, batch {args.batch_size}, "
                      f"{args.sentences} UD sentences, {args.repeats} passes, median.\n\n"
                      + format_table(headers, rows, markdown=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
