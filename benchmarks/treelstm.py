"""TreeLSTM over real UD trees: eager per instance vs. batchcraft.autobatch (issue 2).

Usage:
    python benchmarks/treelstm.py [--sentences 512] [--batch-sizes 8,64] [--hidden 256,512]
                                  [--threads 2] [--write-docs]

Same process, same per-instance model code, same batches: for each batch the
eager loop and the auto-batched call run back to back; the table reports the
median ms per batch over all batches (after one warm-up batch), the ratio, and
the largest absolute difference between the two results.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _handbatched  # noqa: E402
from _report import save_json, write_section  # noqa: E402
from batchcraft.data import load_sentences  # noqa: E402
from batchcraft.measure import format_table, machine_info  # noqa: E402
from batchcraft.measure.compare import compare_eager  # noqa: E402
from batchcraft.models import suite  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=512)
    ap.add_argument("--batch-sizes", default="8,64")
    ap.add_argument("--hidden", default="256,512")
    ap.add_argument("--schedulers", default="depth,agenda")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sents = load_sentences(limit=args.sentences)
    rows, raw = [], []
    for hidden in [int(h) for h in args.hidden.split(",")]:
        task = suite.build("treelstm", sents, hidden=hidden)
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            for sched in args.schedulers.split(","):
                hand = _handbatched.batched_fn(task) if _handbatched.available("treelstm") else None
                r = compare_eager(task.fn, task.instances, batch_size=bs, scheduler=sched, reference=hand)
                r.update(hidden=hidden)
                raw.append(r)
                hand_ms = r.get("reference_ms")
                if r.get("reference_max_abs_diff", 0.0) > 1e-4:
                    print(f"warning: hand-batched result differs from eager by {r['reference_max_abs_diff']:.1e}",
                          file=sys.stderr)
                rows.append([hidden, bs, sched, r["eager_ms"], r["batchcraft_ms"], r["speedup"],
                             hand_ms if hand_ms else "-", r["eager_ms"] / hand_ms if hand_ms else "-",
                             f"{r['batched_calls']:.0f} / {r['ops_recorded']:.0f}",
                             r["record_ms"], r["gather_ms"], r["kernel_ms"], f"{r['max_abs_diff']:.1e}"])
                print(f"hidden {hidden} batch {bs} {sched}: {r['speedup']:.2f}x", file=sys.stderr)
    headers = ["hidden", "batch", "scheduler", "eager ms/batch", "batchcraft ms/batch", "speed-up",
               "hand-batched ms/batch", "hand-batched speed-up",
               "batched calls / ops", "record ms", "gather ms", "batched-call ms", "max |diff|"]
    m = machine_info()
    table = format_table(headers, rows, markdown=True)
    print(format_table(headers, rows))
    save_json("treelstm", {"machine": m, "results": raw})
    if args.write_docs:
        text = (f"Command: `python benchmarks/treelstm.py --sentences {args.sentences} --batch-sizes "
                f"{args.batch_sizes} --hidden {args.hidden} --threads {args.threads} --write-docs`\n\n"
                f"Machine: {m['cpu']}, {m['usable_cpus']} usable CPUs, torch {m['torch']}, "
                f"{args.threads} intra-op threads. Inference (no autograd), UD EWT dev, first "
                f"{args.sentences} sentences; median ms per batch over all batches after one warm-up "
                f"batch; eager = the same per-instance model called one sentence at a time; hand-batched = "
                f"`batchcraft.models.handbatched.treelstm_levels` (all input projections at once, then "
                f"one step per tree height, children summed with `index_add`), timed on the same "
                f"batches: what PyTorch's kernels allow without any recording.\n\n{table}\n")
        write_section("treelstm", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
