"""``batchcraft tune``: measured search for instances, inter-op / intra-op threads and batch size."""

from __future__ import annotations

import argparse
import json
import re
import sys

NAME = "tune"
HELP = "find the fastest instances / inter-op / intra-op threads / batch size for a model"
DESCRIPTION = (
    "Measure a registry model under the PyTorch default, Intel-recommended, TensorFlow-recommended "
    "and width-guideline (Wang et al. 2019) configurations and search the rest within a hard time "
    "budget (start-up included): successive halving over the grid the graph analysis leaves, then a "
    "final round measuring the best candidates and every baseline side by side. Prints tried and "
    "baseline configurations with throughput, latency and ratios; saves the best as JSON for "
    "`batchcraft launch --config`.")


def _seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 120s or 2m, got {text!r}")
    return float(m.group(1)) * (60 if m.group(2) in ("m", "min") else 1)


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="registry model name (see batchcraft.models.names())")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8, 64], metavar="B1,B2,...",
                   help="batch sizes to consider (default: 1,8,64)")
    p.add_argument("--objective", choices=["throughput", "latency"], default="throughput",
                   help="throughput: items/s; latency: lowest median per-call latency, or with "
                   "--latency-limit-ms the highest throughput whose p90 latency meets the limit")
    p.add_argument("--latency-limit-ms", type=float, default=None, help="p90 latency limit (objective latency)")
    p.add_argument("--budget", type=_seconds, default=120.0, metavar="DURATION",
                   help="hard wall-clock budget, start-up included, e.g. 120s or 2m (default: 120s; "
                   "a small search space ends earlier)")
    p.add_argument("--output", default="best.json", metavar="FILE", help="where to save the best configuration")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart of tuned vs baselines")
    p.add_argument("--image-size", type=int, default=None, help="input size for image models without example_input")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per round (default: 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the full result) on stdout")


def run(args) -> int:
    from batchcraft.measure import machine_info
    from batchcraft.parallel import tune
    from batchcraft.parallel.report import comparison_table, plot, tried_table

    result = tune(args.model, batch_sizes=args.batch_sizes, objective=args.objective, budget_s=args.budget,
                  latency_limit_ms=args.latency_limit_ms, image_size=args.image_size, repeats=args.repeats,
                  progress=not args.json and sys.stderr.isatty())
    out = result.to_dict()
    out["machine"] = machine_info()
    out["output"] = args.output
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    if args.plot:
        plot(out, args.plot)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"model {args.model}: {len(result.trials)} measurements in {result.elapsed_s:.1f} s "
          f"(budget {args.budget:.0f} s), objective {args.objective}")
    if result.analysis:
        a = result.analysis
        print(f"graph: {a['heavy_ops']} heavy ops, depth {a['depth']}, average width {a['average_width']:.2f}, "
              f"max width {a['max_width']}")
    print("\ntried configurations (longest measurement of each):")
    print(tried_table(out))
    print("\ntuned vs baselines (same final round):")
    print(comparison_table(out))
    b = result.best
    print(f"\nbest: {b.short()} [{b.label}] {result.best_result.throughput_items_per_s:.1f} items/s, "
          f"p50 {result.best_result.latency_p50_ms:.2f} ms; saved to {args.output}")
    for note in result.notes:
        print(f"note: {note}")
    return 0
