"""``batchcraft tune``: measured search for instances, threads, batch size and knobs."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

NAME = "tune"
HELP = "find the fastest instances / threads / batch size / backends for a model or a program"
DESCRIPTION = (
    "Measure a model (a registry name, or package.module:factory in any importable file) or a whole "
    "program (after --) under the PyTorch default, Intel-recommended, TensorFlow-recommended and "
    "width-guideline (Wang et al. 2019) configurations and search the rest within a hard time budget "
    "(start-up included): successive halving over instances x inter-op x intra-op threads x backends, "
    "a final round measuring the best candidates and every baseline side by side, then a knob race "
    "(allocator, OpenMP wait policy, backends) on the choice. Prints every configuration tried and the "
    "ratios with their intervals; saves the chosen configuration for `batchcraft launch --config` and "
    "the full result apart. A program reports its work with batchcraft.parallel.report(items), or is "
    "timed as a whole. Examples: batchcraft tune --model resnet18; batchcraft tune --model "
    "mypkg.models:build --input-shape 3,224,224; batchcraft tune -- python serve.py --port 0")


def _seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 120s or 2m, got {text!r}")
    return float(m.group(1)) * (60 if m.group(2) in ("m", "min") else 1)


def _ints(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sizes


def _knobs(text: str) -> list[str]:
    from batchcraft.parallel.knobs import KNOB_NAMES

    names = [k.strip() for k in text.split(",") if k.strip()] if text.strip() not in ("", "none") else []
    bad = [k for k in names if k not in KNOB_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown knobs {bad}; known: {', '.join(KNOB_NAMES)} (or 'none')")
    return names


def _kwargs(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="registry model name (batchcraft.models.names()) or package.module:factory; the "
                        "factory returns a model or (model, example_input)")
    p.add_argument("--input-shape", type=_ints, default=None, metavar="D1,D2,...",
                   help="per-item input shape without the batch dimension (random float32 input), for a "
                        "factory that returns only a model")
    p.add_argument("--model-kwargs", type=_kwargs, default=None, metavar="JSON",
                   help="keyword arguments for the model factory, e.g. '{\"hidden\": 256}'")
    p.add_argument("--batch-sizes", type=_ints, default=None, metavar="B1,B2,...",
                   help="batch sizes to consider (default: 1,8,64 for a model; for a program the one it "
                        "chooses, else BATCHCRAFT_BATCH_SIZE tells it each)")
    p.add_argument("--objective", choices=["throughput", "latency"], default="throughput",
                   help="throughput: items/s; latency: lowest median per-call latency, or with "
                   "--latency-limit-ms the highest throughput whose p90 latency meets the limit")
    p.add_argument("--latency-limit-ms", type=float, default=None, help="p90 latency limit (objective latency)")
    p.add_argument("--budget", type=_seconds, default=120.0, metavar="DURATION",
                   help="hard wall-clock budget, start-up included, e.g. 120s or 2m (default: 120s; "
                   "a small search space ends earlier)")
    p.add_argument("--knobs", type=_knobs, default=None, metavar="K1,K2,...",
                   help="knobs beyond threads: matmul, conv, allocator, omp_wait_policy, compile "
                        "(default: all but compile; 'none' for threads only)")
    p.add_argument("--output", default="best.json", metavar="FILE",
                   help="where to save the chosen configuration (for `batchcraft launch --config`)")
    p.add_argument("--result", default=None, metavar="FILE",
                   help="where to save the full result: every trial and round (default: OUTPUT with "
                        ".result.json)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart of tuned vs baselines")
    p.add_argument("--image-size", type=int, default=None, help="input size for image models without example_input")
    p.add_argument("--repeats", type=int, default=3, help="interleaved passes per search round (default: 3)")
    p.add_argument("--final-repeats", type=int, default=5,
                   help="passes of final rounds, playoffs and the knob race (default: 5, 94%% intervals)")
    p.add_argument("--max-trial-s", type=float, default=None,
                   help="longest final-round trial in seconds (default: 0.5 for a model, 2 for a program); "
                        "when every trial can be this long, tuning ends before the budget")
    p.add_argument("--json", action="store_true", help="print one JSON object (the full result) on stdout")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]: tune a whole program")


def _result_path(output: str, result: str | None) -> str:
    if result:
        return result
    p = Path(output)
    return str(p.with_name(p.stem + ".result.json"))


def run(args) -> int:
    from batchcraft.errors import ConfigurationError
    from batchcraft.measure import machine_info
    from batchcraft.parallel import tune, tune_program
    from batchcraft.parallel.knobs import DEFAULT_KNOBS
    from batchcraft.parallel.tables import comparison_table, knob_table, plot, tie_table, tried_table, variant_table

    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if bool(argv) == bool(args.model):
        raise ConfigurationError("tune: give either --model NAME or -- COMMAND (a program), not both or neither",
                                 hint="batchcraft tune --model resnet18, or batchcraft tune -- python serve.py")
    knobs = DEFAULT_KNOBS if args.knobs is None else tuple(args.knobs)
    progress = not args.json and sys.stderr.isatty()
    common = dict(objective=args.objective, budget_s=args.budget, latency_limit_ms=args.latency_limit_ms,
                  repeats=args.repeats, final_repeats=args.final_repeats, knobs=knobs, progress=progress)
    if args.max_trial_s is not None:
        common["max_trial_s"] = args.max_trial_s
    if argv:
        result = tune_program(argv, batch_sizes=args.batch_sizes or [1], **common)
    else:
        result = tune(args.model, batch_sizes=args.batch_sizes or [1, 8, 64], input_shape=args.input_shape,
                      model_kwargs=args.model_kwargs, image_size=args.image_size, **common)
    out = result.to_dict()
    out["machine"] = machine_info()
    result_file = _result_path(args.output, args.result)
    out["output"], out["result_file"] = args.output, result_file
    with open(result_file, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    b = result.best
    saved = {"parallel_config": b.to_dict(),
             "tuned": {"model": result.model, "objective": result.objective, "round": result.best_round,
                       "throughput_items_per_s": result.best_result.throughput_items_per_s,
                       "latency_p50_ms": result.best_result.latency_p50_ms, "result_file": result_file}}
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=2)
        f.write("\n")
    if args.plot:
        plot(out, args.plot)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'program' if argv else 'model'} {result.model}: {len(result.trials)} measurements in "
          f"{result.elapsed_s:.1f} s (budget {args.budget:.0f} s), objective {args.objective}")
    if result.analysis:
        a = result.analysis
        print(f"graph: {a['heavy_ops']} heavy ops, depth {a['depth']}, average width {a['average_width']:.2f}, "
              f"max width {a['max_width']}")
    print("\ntried configurations (each row: the median of one round kind's passes; rounds differ in "
          "trial length and time, so one configuration's rows differ):")
    print(tried_table(out))
    print("\ntuned vs baselines (same final round; ratio interval from its paired passes, within one set "
          "of processes):")
    print(comparison_table(out))
    vt = variant_table(out)
    if vt:
        print("\nbackends (each process configuration's instances run the variants in turns of 10 ms; ratio "
              "to PyTorch's default):")
        print(vt)
    tt = tie_table(out)
    if tt:
        print("\nnear-tied backends, decided across fresh sets of processes (the two in turns inside each set; "
              "the other over the chosen per set, the search's own set first):")
        print(tt)
    kt = knob_table(out)
    if kt:
        print("\nknob race (each batch size's choice with one knob changed, side by side in one set of rounds; "
              "ratio to that batch size's choice):")
        print(kt)
    where = {"final": "its final round", "knobs": "the knob race",
             "tie-break": "its fresh-process tie-break"}[result.best_round]
    print(f"\nbest: {b.short()} [{b.label}] {result.best_result.throughput_items_per_s:.1f} items/s, "
          f"p50 {result.best_result.latency_p50_ms:.2f} ms (median of {where}); saved to {args.output}, "
          f"full result in {result_file}")
    for note in result.notes:
        print(f"note: {note}")
    return 0
