"""GPU check of micro-batching (issue 4): cuDNN execution plans vs ``cudnn.benchmark=True``.

On a CUDA machine with ``nvidia-cudnn-frontend`` (``pip install -c constraints.txt '.[cuda]'``):
for AlexNet and ResNet-18 (batch 64, 224x224, float32) it measures every cuDNN execution plan of
every convolution layer-pass at each powerOfTwo micro-batch size (workspace = the plan's stated
workspace), plans each layer-pass with the WR dynamic programme under each budget, then runs the
chosen division for real (checking values against PyTorch) and times it against PyTorch's own
call with ``torch.backends.cudnn.benchmark = True``. Per-layer and total times, CUDA events,
medians. Stops measuring new layers after ``--time-limit-s`` so the whole script stays under 5 min.

Without a GPU (or without the package) it prints why and exits 0: nothing to check.

    python benchmarks/gpu_microbatch.py [--budgets 8MiB,64MiB,512MiB] [--out results/gpu_microbatch.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from batchcraft import models
from batchcraft.measure import format_table, machine_info
from batchcraft.microbatching.budget import parse_budget
from batchcraft.microbatching.cuda import available, measure_configs
from batchcraft.microbatching.optimize_wr import candidate_sizes, optimize_wr
from batchcraft.microbatching.probe import find_convolutions


def _time_cuda(fn, repeats=10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _pytorch_pass(geom, p, x, w, dy):
    """PyTorch's own call for one pass (cudnn.benchmark picks the algorithm)."""
    args = (list(geom.stride), list(geom.padding), list(geom.dilation), False, [0, 0], geom.groups)
    if p == "forward":
        return lambda: F.conv2d(x, w, None, geom.stride, geom.padding, geom.dilation, geom.groups)
    mask = [True, False, False] if p == "backward_data" else [False, True, False]
    return lambda: torch.ops.aten.convolution_backward(dy, x, w, None, *args, mask)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="alexnet,resnet18")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--budgets", default="8MiB,64MiB,512MiB")
    ap.add_argument("--time-limit-s", type=float, default=240.0)
    ap.add_argument("--out", default="results/gpu_microbatch.json")
    args = ap.parse_args(argv)
    ok, why = available()
    if not ok:
        print(json.dumps({"skipped": why}))
        print(f"gpu_microbatch: skipped: {why}", file=sys.stderr)
        return 0
    torch.backends.cudnn.benchmark = True
    t0 = time.perf_counter()
    budgets = [(b, parse_budget(b)) for b in args.budgets.split(",")]
    dev = torch.device("cuda")
    results, measured = [], {}
    for name in args.models.split(","):
        model = models.get(name).to(dev)
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=dev)
        convs, _ = find_convolutions(model, x)
        sizes = candidate_sizes(args.batch_size, "powerOfTwo")
        for call in convs:
            lname, geom = call.name, call.geometry
            for p in ("forward", "backward_data", "backward_filter"):
                try:
                    row = _layer_pass(name, lname, geom, p, args, sizes, budgets, measured, t0, dev)
                except Exception as exc:  # report the layer-pass, go on with the next
                    row = {"model": name, "layer": lname, "pass": p, "error": f"{type(exc).__name__}: {exc}"}
                    print(f"{name} {lname} {p}: {row['error']}", file=sys.stderr)
                if row is not None:
                    results.append(row)
    return _report(args, results, budgets, t0)


def _layer_pass(name, lname, geom, p, args, sizes, budgets, measured, t0, dev):
    """One row: PyTorch's time for (layer, pass) and the planned division's under each budget."""
    key = (geom, p)
    if key not in measured:
        if time.perf_counter() - t0 > args.time_limit_s:
            print(f"time limit: {name} {lname} {p} not measured", file=sys.stderr)
            return None
        table, graphs = {}, {}
        for n in sizes:
            table[n], graphs[n] = measure_configs(geom, p, n, limit_bytes=budgets[-1][1])
        measured[key] = (table, graphs)
    table, graphs = measured[key]
    X = torch.randn(geom.input_shape(args.batch_size), device=dev)
    W = torch.randn(geom.weight_shape(), device=dev)
    DY = torch.randn(geom.output_shape(args.batch_size), device=dev)
    ref_fn = _pytorch_pass(geom, p, X, W, DY)
    ref = ref_fn()
    ref = ref[0] if p == "backward_data" else ref[1] if p == "backward_filter" else ref
    scale = float(ref.abs().max())
    row = {"model": name, "layer": lname, "pass": p, "pytorch_benchmark_ms": _time_cuda(ref_fn), "ref_scale": scale}
    for label, limit in budgets:
        choice = optimize_wr(table, args.batch_size, limit)
        undiv = optimize_wr({args.batch_size: table.get(args.batch_size, [])}, args.batch_size, limit)
        row[f"{label}_undivided_predicted_ms"] = None if undiv is None else undiv.time_ms
        row[f"{label}_predicted_ms"] = None if choice is None else choice.time_ms
        # both run the same way (workspace allocated per step, as a planned layer does), so
        # planned vs undivided compares divisions, not the timing harness
        for kind, c in (("undivided", undiv), ("planned", choice)):
            if c is None:
                row[f"{label}_{kind}_ms"] = None
                continue
            got = _run_division(c, p, ref, X, W, DY, graphs, dev)
            row[f"{label}_{kind}_rel_diff"] = float((got - ref).abs().max()) / max(scale, 1e-30)
            row[f"{label}_{kind}_ms"] = _time_cuda(lambda c=c: _run_division(c, p, ref, X, W, DY, graphs, dev))
            row[f"{label}_{kind}_division"] = " + ".join(f"{s.algorithm}x{s.micro_batch}" for s in c.steps)
    return row


def _run_division(choice, p, ref, X, W, DY, graphs, dev):
    """Run ``choice`` (micro-batches x cuDNN plans) for pass ``p``; the full batch's result."""
    out = torch.zeros_like(ref) if p == "backward_filter" else torch.empty_like(ref)
    start = 0
    for c in choice.steps:
        idx, n = int(c.algorithm.split(":")[1]), c.micro_batch
        sl = slice(start, start + n)
        buf = {"x": X[sl], "w": W, "y": DY[sl]}
        if p == "forward":
            buf["y"] = out[sl]
        elif p == "backward_data":
            buf["x"] = out[sl]
        else:
            buf["w"] = torch.empty_like(W)
        ws = torch.empty(max(c.workspace_bytes, 1), device=dev, dtype=torch.uint8)
        r = graphs[n].run(idx, buf, ws)
        if p == "backward_filter":
            out += r
        start += n
    return out


def _report(args, results, budgets, t0) -> int:
    out = {"machine": machine_info(), "elapsed_s": time.perf_counter() - t0, "args": vars(args), "rows": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    summary = []
    for name in args.models.split(","):
        rows = [r for r in results if r["model"] == name and "error" not in r]
        for label, _ in budgets:
            both = [r for r in rows if r.get(f"{label}_planned_ms") and r.get(f"{label}_undivided_ms")]
            planned = sum(r[f"{label}_planned_ms"] for r in both)
            undiv = sum(r[f"{label}_undivided_ms"] for r in both)
            ref = sum(r["pytorch_benchmark_ms"] for r in both)
            rel = max((r.get(f"{label}_planned_rel_diff", 0.0) for r in both), default=float("nan"))
            summary.append([name, label, f"{len(both)}/{len(rows)}", ref, undiv, planned,
                            f"{undiv / planned:.2f}x" if planned else "n/a", f"{ref / planned:.2f}x" if planned else "n/a",
                            f"{rel:.1e}"])
    print(format_table(["model", "budget", "layer-passes", "PyTorch cudnn.benchmark ms (no limit)",
                        "undivided ms (within budget)", "planned ms", "planned vs undivided",
                        "planned vs PyTorch", "max rel diff"], summary, markdown=True))
    print(f"\n{out['machine'].get('gpu')}, {out['elapsed_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
