"""Which runtime optimisations pay? TreeLSTM over UD trees with each one switched off (issue 7).

Usage:
    python benchmarks/autobatch_ablation.py [--sentences 256] [--batch-size 64] [--hidden 256]
                                            [--threads 2] [--compile] [--write-docs]

Variants, all on the same batches in one process, median ms per batch after warm-up:
  eager                one instance at a time (the reference);
  batchcraft           defaults (C recording core, depth scheduler, ragged blocks, hoisting,
                       measured kernel choice, output arenas);
  python core          the pure-Python recording core (the reference the C core is fuzzed against);
  no ragged blocks     a static block's child lists keyed by their length (one group per arity);
  no hoisting          input projections of recurrent cells computed per depth;
  default kernels      PyTorch's default matrix multiply everywhere (no oneDNN selection);
  no output arenas     each group's outputs stay separate tensors;
  agenda               DyNet's agenda scheduler instead of depth;
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
from batchcraft.data import load_sentences  # noqa: E402
from batchcraft.measure import format_table, machine_info  # noqa: E402
from batchcraft.measure.compare import batches  # noqa: E402
from batchcraft.measure.race import race  # noqa: E402
from batchcraft.models import suite  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7, help="race rounds (each: one pass over the batches per variant)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = suite.build("treelstm", load_sentences(limit=args.sentences), hidden=args.hidden)
    bs = batches(task.instances, args.batch_size)
    variants = {
        "eager": None,
        "batchcraft (defaults)": dict(),
        "python core": dict(core="python"),
        "no ragged blocks": dict(ragged=False),
        "no hoisting": dict(hoist=False),
        "default kernels": dict(kernels="default"),
        "no output arenas": dict(arenas=False),
        "agenda scheduler": dict(scheduler="agenda"),
    }
    if args.compile:
        variants["compiled blocks"] = dict(compile_blocks=True)
    per_op_us = {}
    with torch.no_grad():
        fns = {k: (autobatch(task.fn, **v) if v is not None else None) for k, v in variants.items()}
        ref = [[task.fn(x) for x in b] for b in bs]
        for k, f in fns.items():  # warm-up on every batch: signatures, traces, kernel choices
            if f is not None:
                for b, r in zip(bs, ref):
                    out = f(b)
                    diff = max((o - y).abs().max().item() for o, y in zip(out, r))
                    assert diff <= 1e-4, (k, diff)

        def one_pass(k, f):
            def run():
                t0 = time.perf_counter()
                us = []
                for b in bs:
                    if f is None:
                        [task.fn(x) for x in b]
                    else:
                        f(b)
                        st = f.stats
                        us.append(st.record_s / max(st.ops_recorded, 1) * 1e6)
                if us:
                    per_op_us.setdefault(k, []).append(statistics.median(us))
                return (time.perf_counter() - t0) / len(bs)
            return run

        names = list(variants)
        r = race([one_pass(k, fns[k]) for k in names], rounds=args.repeats, labels=names,
                 higher_is_better=False)
    base = names.index("batchcraft (defaults)")
    rows = []
    for i, k in enumerate(names):
        ms = r.summary(i).median * 1e3
        us = statistics.median(per_op_us[k]) if k in per_op_us else float("nan")
        rows.append([k, ms, r.ratio(i, 0).estimate, r.ratio(i, base).text(), us])
    headers = ["variant", "ms/batch", "speed-up vs eager", "speed vs defaults [interval]",
               "host µs per recorded op"]
    print(format_table(headers, rows))
    m = machine_info()
    save_json("autobatch_ablation", {"machine": m, "args": vars(args), "rows": rows})
    if args.write_docs:
        cmd = " ".join(["python benchmarks/autobatch_ablation.py"] + (argv or sys.argv[1:]))
        write_section("ablation", f"Command: `{cmd}`\n\nMachine: {m['cpu']}, torch {m['torch']}, "
                      f"{args.threads} threads; TreeLSTM hidden {args.hidden}, batch {args.batch_size}, "
                      f"{args.sentences} UD sentences, {args.repeats} interleaved rounds (rotating start), medians; "
                      f"speed vs defaults: median paired ratio [order-statistics interval] coverage.\n\n"
                      + format_table(headers, rows, markdown=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
