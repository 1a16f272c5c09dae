"""Micro-batching benchmark (issue 16): the DeepBench-style single-layer table of μ-cuDNN on this machine.

For each single convolution layer of :mod:`batchcraft.models.deepbench` (3x3, 1x1 and 5x5
geometries, each at its DeepBench mini-batch unless ``--batch-size``), each workspace budget
(8, 64 and 512 MiB, largest first so smaller budgets reuse the measurements) and each pass
(forward, backward-data, backward-filter), it plans the layer with the WR policy and powerOfTwo
candidates, as ``microbatch`` does (the DP's choice confirmed per layer-pass against the
undivided best and the default in interleaved rounds; no end-to-end verification: the model is
one layer), and then times these divisions of the whole mini-batch **side by side** (interleaved
rounds on the same inputs, minimum per division, :meth:`~batchcraft.microbatching.measure.Measurer.race`):

* ``plan``: the division ``microbatch`` runs under the budget;
* ``optimiser``: the DP's own division before the confirmation race, when it differs;
* ``undivided``: the fastest algorithm that fits the same budget without division (μ-cuDNN's
  baseline "undivided", i.e. what a workspace-limited framework can do); none may fit;
* ``default``: PyTorch's own call (no budget).

Speed-ups are the ratios of those side-by-side times (the planner's predicted ratios, from its
per-configuration measurements, are reported beside them). μ-cuDNN reports up to 2.31x (3x3) and
3.85x (5x5) over undivided cuDNN on a P100 (arXiv 1804.04806, DeepBench, 128-512 MiB limits).

One intra-op thread by default (``--threads``): on a 2-core machine that others share, two OpenMP
threads wait on each other at every barrier whenever the other core is busy, which costs a
micro-batch of one sample tens of ms (a 16-step division suffered 16 times) and made the numbers
a measure of the load, not of the algorithms.

    flock /tmp/batchcraft-cpu.lock .venv/bin/python benchmarks/microbatch_deepbench.py   # ~4 min
    .venv/bin/python benchmarks/microbatch_deepbench.py --render results/microbatch_deepbench.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from batchcraft import models
from batchcraft.errors import WorkspaceError
from batchcraft.measure import format_table, machine_info
from batchcraft.microbatching import MeasurementCache, format_bytes, parse_budget, plan_model
from batchcraft.microbatching.measure import Measurer
from batchcraft.models.deepbench import GEOMETRIES

PAPER = {"3x3": 2.31, "5x5": 3.85}  # μ-cuDNN, P100, DeepBench layers, best speed-up over undivided
DEFAULT_LAYERS = ",".join(GEOMETRIES)


def _kernel(name: str) -> str:
    return name.split("_")[1]


def run_layer(name: str, batch: int, budgets: list[str], cache: MeasurementCache, repeats: int, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    model = models.get(name)
    c, h, w = model.input_size
    x = torch.randn(batch, c, h, w, generator=torch.Generator().manual_seed(0))
    rows = []
    for budget in budgets:
        try:
            raw, _ = plan_model(model, x, workspace_limit=budget, cache=cache, repeats=repeats, progress=False,
                                confirm=False)
            plan, _ = plan_model(model, x, workspace_limit=budget, cache=cache, repeats=repeats, progress=False)
        except WorkspaceError as exc:
            rows.append({"layer": name, "budget": budget, "infeasible": exc.message})
            continue
        layer, raw_layer = plan.layers[0], raw.layers[0]
        measurer = Measurer(cache, repeats=repeats)
        for p, pp in layer.passes.items():
            divisions = {"plan": pp.steps(), "optimiser": raw_layer.passes[p].steps(), "default": [("default", batch)]}
            if pp.undivided_choice is not None:
                divisions["undivided"] = pp.undivided_choice.step_list()
            distinct = list({tuple(v): None for v in divisions.values()})  # the same division is raced once
            raced = measurer.race(layer.geometry, p, batch, [list(d) for d in distinct], rounds=rounds)
            t = {k: raced[distinct.index(tuple(v))] for k, v in divisions.items()}
            rows.append({
                "layer": name, "kernel": _kernel(name), "budget": budget, "batch": batch, "pass": p,
                "division": pp.describe(), "workspace_bytes": pp.workspace_bytes,
                "optimiser_division": raw_layer.passes[p].describe(),
                "undivided_division": None if pp.undivided_choice is None else pp.undivided_choice.describe(),
                "default_workspace_bytes": pp.default_workspace_bytes,
                "raced_ms": t, "predicted_ms": {"plan": pp.time_ms, "undivided": pp.undivided_ms, "default": pp.default_ms},
                "speedup_vs_undivided": t["undivided"] / t["plan"] if "undivided" in t else None,
                "speedup_vs_default": t["default"] / t["plan"],
                "predicted_vs_undivided": None if pp.undivided_ms is None else pp.undivided_ms / pp.time_ms,
                "predicted_vs_default": pp.default_ms / pp.time_ms,
            })
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default=DEFAULT_LAYERS, help=f"comma-separated; known: {', '.join(GEOMETRIES)}")
    p.add_argument("--batch-size", type=int, default=None, help="mini-batch (default: each layer's DeepBench batch)")
    p.add_argument("--budgets", default="512MiB,64MiB,8MiB")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per configuration while planning")
    p.add_argument("--rounds", type=int, default=11, help="interleaved rounds of the side-by-side race")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default: 1, see the docstring)")
    p.add_argument("--cache", default="results/microbatch_deepbench_cache.sqlite")
    p.add_argument("--out", default="results/microbatch_deepbench.json")
    p.add_argument("--render", metavar="JSON", help="only render an earlier run")
    args = p.parse_args(argv)
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            print(render(json.load(f)))
        return 0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    torch.set_num_threads(args.threads)
    info, load_before, t0 = machine_info(), os.getloadavg(), time.perf_counter()
    budgets = sorted(args.budgets.split(","), key=parse_budget, reverse=True)
    cache = MeasurementCache(args.cache)
    rows = []
    for name in args.layers.split(","):
        batch = args.batch_size or GEOMETRIES[name][-1]
        print(f"[{time.perf_counter() - t0:5.0f} s] {name} batch {batch}", file=sys.stderr)
        rows += run_layer(name, batch, budgets, cache, args.repeats, args.rounds)
    out = {"machine": info, "load_before": load_before, "load_after": os.getloadavg(),
           "elapsed_s": time.perf_counter() - t0, "args": vars(args), "rows": rows}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(render(out))
    return 0


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def render(out: dict) -> str:
    m = out["machine"]
    lines = [f"Machine: {m['cpu']}, {m['usable_cpus']} usable CPUs, torch {m['torch']}, {m['torch_threads']} intra-op "
             f"threads. Load average before/after {out['load_before'][0]:.2f} / {out['load_after'][0]:.2f}; "
             f"{out['elapsed_s'] / 60:.1f} min.", ""]
    table = []
    for r in out["rows"]:
        if "infeasible" in r:
            table.append([r["layer"], r["budget"], "-", "-", "-", "-", "-", "-", "-", "-", f"no plan fits: {r['infeasible']}"])
            continue
        t = r["raced_ms"]
        opt = "same" if r["optimiser_division"] == r["division"] else f"{r['optimiser_division']}: {t['optimiser']:.2f}"
        table.append([r["layer"].replace("deepbench_", ""), r["budget"], r["pass"], r["division"],
                      t["plan"], opt, "none fits" if "undivided" not in t else f"{t['undivided']:.2f} ({r['undivided_division']})",
                      f"{t['default']:.2f} ({format_bytes(r['default_workspace_bytes'])}"
                      + ("" if r["default_workspace_bytes"] <= parse_budget(r["budget"]) else ", over budget") + ")",
                      _x(r["speedup_vs_undivided"]), _x(r["speedup_vs_default"]),
                      f"{_x(r['predicted_vs_undivided'])} / {_x(r['predicted_vs_default'])}",
                      f"{PAPER.get(r['kernel'], float('nan')):.2f}x" if r["kernel"] in PAPER else "-"])
    lines.append(format_table(["layer", "budget", "pass", "plan (as microbatch runs it)", "plan_ms",
                               "optimiser's own division: ms", "undivided_ms (its algorithm)",
                               "default_ms (its workspace)", "vs undivided", "vs default", "predicted (vs undivided / vs default)",
                               "μ-cuDNN P100 (best, vs undivided)"], table, markdown=True))
    ok = [r for r in out["rows"] if "infeasible" not in r]
    for k in ("3x3", "1x1", "5x5"):
        sel = [r for r in ok if r["kernel"] == k]
        vu = [r["speedup_vs_undivided"] for r in sel if r["speedup_vs_undivided"] is not None]
        vd = [r["speedup_vs_default"] for r in sel]
        if sel:
            lines.append("")
            lines.append(f"{k}: best vs undivided {max(vu):.2f}x" if vu else f"{k}: no undivided algorithm fits any budget")
            lines[-1] += (f", best vs default {max(vd):.2f}x, layer-passes where no undivided algorithm fits: "
                          f"{sum(r['speedup_vs_undivided'] is None for r in sel)} of {len(sel)}"
                          + (f"; μ-cuDNN (P100): {PAPER[k]:.2f}x" if k in PAPER else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
