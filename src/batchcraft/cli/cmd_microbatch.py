"""``batchcraft microbatch``: plan a model's convolutions under a workspace budget and time it."""

from __future__ import annotations

import json
import os
import sys

NAME = "microbatch"
HELP = "micro-batch a model's convolutions under a workspace budget (μ-cuDNN) and time it"
DESCRIPTION = (
    "Measure every convolution algorithm at every candidate micro-batch size (cached in SQLite), "
    "choose per layer the fastest division that fits the workspace budget (policy wr: dynamic "
    "programming per layer; wd: integer programming over the network), verify it end to end (the whole "
    "model with the plan, the best undivided plan and, if it fits the budget, PyTorch's default; the "
    "fastest is kept), then time the result again against PyTorch's default and the best undivided "
    "plan under the same budget, and report the measured peak workspace. --save-plan writes the plan "
    "as JSON; --load-plan re-applies one without measuring (refused if made on another device, torch "
    "version or thread count, unless --remeasure).")


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="registry model name, e.g. resnet18, alexnet, deepbench_3x3_54x54x64")
    p.add_argument("--batch-size", type=int, default=64, help="mini-batch to divide (default: 64)")
    p.add_argument("--workspace", default="64MiB", help="workspace budget: bytes or 8MiB, 1.5GiB, ... (default: 64MiB)")
    p.add_argument("--policy", choices=["wr", "wd"], default="wr",
                   help="wr: limit per layer-pass (DP); wd: one network budget (ILP) (default: wr)")
    p.add_argument("--batch-sizes", choices=["undivided", "powerOfTwo", "all"], default="powerOfTwo",
                   help="micro-batch candidates (default: powerOfTwo)")
    p.add_argument("--image-size", type=int, default=None,
                   help="input height = width for image models (default: 224; DeepBench layers use their own)")
    p.add_argument("--inference", action="store_true", help="plan and time the forward pass only (eval mode)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds (default: 5)")
    p.add_argument("--no-verify", action="store_true",
                   help="keep the optimiser's plan without the end-to-end race against the undivided plan and the default")
    p.add_argument("--cache", default=None, metavar="FILE",
                   help="measurement cache file (default: the user's cache directory; $BATCHCRAFT_CACHE_DIR)")
    p.add_argument("--remeasure", action="store_true",
                   help="measure every configuration again (ignore the cache and a loaded plan's choices)")
    p.add_argument("--save-plan", default=None, metavar="FILE", help="write the plan (JSON) to FILE")
    p.add_argument("--load-plan", default=None, metavar="FILE",
                   help="re-apply a plan written by --save-plan (its budget, policy and passes replace the options)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default="float32",
                   help="element type of the model and input (default: float32)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart of per-layer time: default, undivided, plan")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # optional extra
        from batchcraft.errors import ConfigurationError

        raise ConfigurationError("--plot needs matplotlib", hint="pip install 'batchcraft[plot]'") from exc
    rows = [(f"{layer['name']}:{p[:10]}", pp) for layer in result["plan"]["layers"] for p, pp in layer["passes"].items()]
    kept = result.get("kept") or "planned"
    series = [("default_ms", "PyTorch default"), ("undivided_ms", "best undivided")]
    if kept == "planned":
        series.append(("time_ms", "micro-batched plan (kept)"))
    else:  # the rows run the kept variant; the optimiser's plan is shown beside it, marked as not used
        series.append(("optimizer_ms", "optimiser's plan (not kept)"))
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(rows)), 4))
    xs = range(len(rows))
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        values = [(pp.get(key) if pp.get(key) is not None else pp["time_ms"]) if key == "optimizer_ms" else (pp[key] or 0)
                  for _, pp in rows]
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in xs], values, width=width, label=label)
    ax.set_xticks(list(xs), [r[0] for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("measured time per layer-pass (ms)")
    title = f"{result['model']} batch {result['batch_size']}, workspace {result['workspace']}, {result['policy']}"
    if kept != "planned":
        title += f"\nverification kept {'PyTorch default' if kept == 'default' else 'the undivided plan'}"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _conv_models() -> list[str]:
    """Registry models that contain a Conv2d (what this command can plan)."""
    import torch

    from batchcraft import models

    out = []
    for name in models.names():
        try:
            m = models.get(name)
        except Exception:  # needs arguments: not a convolutional reference network
            continue
        if any(isinstance(x, torch.nn.Conv2d) for x in m.modules()):
            out.append(name)
    return out


def run(args) -> int:
    import torch

    from batchcraft import models
    from batchcraft.errors import ConfigurationError
    from batchcraft.measure import format_table, machine_info
    from batchcraft.microbatching.budget import format_bytes
    from batchcraft.microbatching.compare import compare, example_input_for

    if args.batch_size < 1:
        raise ConfigurationError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads is not None and args.threads < 1:
        raise ConfigurationError(f"--threads must be >= 1, got {args.threads}")
    if args.load_plan and not os.path.isfile(args.load_plan):
        from batchcraft.errors import DataFormatError

        raise DataFormatError(args.load_plan, None, "cannot read file: no such file",
                              hint="give a plan written by --save-plan (or model.plan.save(path))")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = models.get(args.model)
    except KeyError as exc:
        raise ConfigurationError(str(exc.args[0]), hint=f"models with convolutions: {', '.join(_conv_models())}") from None
    except TypeError as exc:  # a registry model that needs arguments (e.g. a vocabulary size)
        raise ConfigurationError(f"model {args.model!r} cannot be built without arguments ({exc})",
                                 hint=f"models with convolutions: {', '.join(_conv_models())}") from None
    if not any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
        raise ConfigurationError(f"model {args.model!r} has no Conv2d layer: nothing to micro-batch",
                                 hint=f"models with convolutions: {', '.join(_conv_models())}")
    dtype = getattr(torch, args.dtype)
    model = model.to(dtype)
    x = example_input_for(model, args.batch_size, args.image_size).to(dtype)
    result = compare(model, x, args.workspace, policy=args.policy, batch_sizes=args.batch_sizes,
                     training=not args.inference, repeats=args.repeats, cache=args.cache,
                     progress=not args.json, verify=not args.no_verify, plan=args.load_plan,
                     on_mismatch="remeasure" if args.remeasure else "refuse", remeasure=args.remeasure)
    plan = result.pop("plan_obj")
    if args.save_plan:
        plan.save(args.save_plan)
    result.update(model=args.model, workspace=args.workspace if not args.load_plan else plan.workspace_limit_bytes,
                  input_shape=list(x.shape), dtype=args.dtype, machine=machine_info(),
                  saved_plan=args.save_plan, loaded_plan=args.load_plan)
    if args.plot:
        _plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
        return 0
    mode = "training (forward + backward)" if result["training"] else "inference (forward)"
    print(f"{args.model}, batch {args.batch_size}, input {tuple(x.shape[1:])} {args.dtype}, {mode}, workspace "
          f"{result['workspace']} ({result['workspace_limit_bytes']} bytes), policy {plan.policy}, "
          f"candidates {plan.batch_sizes}")
    if args.load_plan:
        print(f"plan re-applied from {args.load_plan} ({plan.measured} configurations measured for it when it was made)")
    else:
        print(f"planning: {plan.planning_s:.1f} s, {plan.measured} configurations measured (rest from the cache)")
    statement = plan.primary.kept_statement()
    if statement:
        print("\n" + statement.split(". The rows")[0] + ".")
    print()
    print(plan.table())
    if plan.skipped:
        print("\nnot planned: " + "; ".join(f"{k}: {v}" for k, v in plan.skipped.items()))
    if plan.primary.unsupported:
        print("\nskipped for this dtype/device: " + "; ".join(plan.primary.unsupported.values()))
    if plan.verification is not None:
        v = plan.verification
        print(f"\nend-to-end verification while planning ({v.mode}, median of {v.repeats} interleaved rounds): "
              f"kept '{v.kept}'" + (" (the table shows what runs and, in the optimiser columns, the optimiser's plan)"
                                    if v.kept != "planned" else ""))
        print(plan.verification_table())
    if args.save_plan:
        print(f"\nplan written to {args.save_plan} (re-apply: --load-plan {args.save_plan})")
    t, iqr = result["times_ms"], result["iqr_ms"]
    kept = result["kept"]
    label = {"planned": "planned" if kept in (None, "planned") else f"planned (runs {kept}: kept by verification)"}
    rows = [[label.get(k, k), t[k], iqr[k], t[k] / t["planned"], format_bytes(result["peak_workspace_bytes"][k])
             if k in result["peak_workspace_bytes"] else "unbounded (PyTorch)"] for k in t]
    print(f"\nwhole model, median of {result['repeats']} interleaved rounds "
          f"({torch.get_num_threads()} intra-op threads):")
    print(format_table(["variant", "median_ms", "iqr_ms", "time / planned", "peak workspace (measured)"], rows))
    if result["undivided_error"]:
        print(f"no undivided plan fits: {result['undivided_error']}")
    print(f"planned vs default: max |diff| of eval outputs {result['max_abs_diff']['planned']:.2e} "
          f"(output scale {result['output_scale']:.2e})")
    sys.stdout.flush()
    return 0
