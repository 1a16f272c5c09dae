"""How repeatable is one configuration's throughput across fresh worker processes? (issue 5)

Usage:
    python benchmarks/parallel_repeatability.py [--model inception_wide] [--batch-size 8]
                                                [--starts 4] [--rounds 5] [--trial-s 0.64]
                                                [--warmups 0.05,0.3]

Each start is one ``batchcraft.parallel.head_to_head`` call: fresh processes for
``pytorch-default`` (one unpinned process, torch's default threads) and ``2 x 1 x 1`` (two
pinned single-thread instances), ``--rounds`` interleaved trials each, median. Warm-up per trial
alternates over ``--warmups``. If one configuration's medians differ between starts by more than
the tuner's 5% criterion, no tuner can be checked against a sweep to 5% for that configuration:
the sweep and the tuner run different process instances.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from batchcraft.measure import format_table, machine_info
from batchcraft.parallel import ParallelConfig, baseline_configs, head_to_head
from batchcraft.parallel.analysis import analyze
from batchcraft.parallel.config import usable_cpus
from batchcraft.parallel.workload import build_workload


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="inception_wide")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--starts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trial-s", type=float, default=0.64)
    ap.add_argument("--warmups", default="0.05,0.3")
    args = ap.parse_args(argv)
    work = build_workload(args.model)
    analysis = analyze(work.model, work.make_batch(1)) if work.traceable else None
    base = {c.label: c for c in baseline_configs(analysis, args.batch_size, usable_cpus())}
    two = ParallelConfig(instances=2, inter_op_threads=1, intra_op_threads=1, batch_size=args.batch_size,
                         label="2x1x1")
    cfgs = [base["pytorch-default"], two]
    warmups = [float(w) for w in args.warmups.split(",")]
    rows, per_cfg = [], {c.label: [] for c in cfgs}
    for i in range(args.starts):
        warm = warmups[i % len(warmups)]
        res = head_to_head(args.model, cfgs, rounds=args.rounds, duration_s=args.trial_s, warmup_s=warm)
        for c, r in zip(cfgs, res):
            per_cfg[c.label].append(r.throughput_items_per_s)
        rows.append([i + 1, warm, *[r.throughput_items_per_s for r in res]])
        print(f"start {i + 1}: " + ", ".join(f"{c.label} {r.throughput_items_per_s:.0f}/s" for c, r in zip(cfgs, res)),
              file=sys.stderr)
    rows.append(["max/min", "", *[max(v) / min(v) for v in per_cfg.values()]])
    rows.append(["median", "", *[statistics.median(v) for v in per_cfg.values()]])
    m = machine_info()
    print(f"{args.model} batch {args.batch_size}, {args.rounds} interleaved {args.trial_s}-s trials per start; "
          f"{m['cpu']}, {m['usable_cpus']} usable CPUs, torch {m['torch']}")
    print(format_table(["start", "warm-up s", *[f"{c.label} items/s" for c in cfgs]], rows, markdown=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
