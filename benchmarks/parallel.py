"""Parallelism tuner vs an exhaustive sweep and the recommended baselines (issues 5 and 17).

For every model and batch size: the tuner (``batchcraft.parallel.tune`` with a hard time budget,
backends, allocator and OpenMP wait policy among its knobs) picks a configuration; an exhaustive
sweep measures every configuration (the unpruned grid in every backend variant, the four
baselines, and the sweep's best with each allocator / wait policy); then the **verdict** comes
from a side-by-side race in *fresh processes every round* (``head_to_head(starts=R, rounds=1)``):
the tuner's choice, the sweep's best, the best baseline, ``pytorch-default`` and the choice's
process with its other backend (the one the sweep found fastest there), so that each round is
one independent observation of the paired ratios, process-to-process noise included. Ratios
come with their order-statistics interval (``batchcraft.measure.race``):

* within 5% of the sweep's best: the interval of tuned / sweep best lies at or above 0.95
  ("ok"), wholly below it ("MISS"), or straddles it ("undecided": this machine's noise does not
  resolve it at this number of rounds, reported as such);
* never below the best baseline: "ok" when the interval of tuned / best baseline lies at or above
  0.95 and is not wholly below 1, "below" when it is wholly below 1, else "undecided";
* the backend: "faster backend" when the choice's backend is not slower than its other backend
  (interval of choice / other not wholly below 1).

Writes JSON to results/ and prints markdown for docs/benchmarks.md. Run each model on its own
under the CPU lock (a few minutes each):

    flock /tmp/batchcraft-cpu.lock .venv/bin/python benchmarks/parallel.py --models mlp_fc512
    flock /tmp/batchcraft-cpu.lock .venv/bin/python benchmarks/parallel.py --models resnet18 --budget-s 60
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from batchcraft import models
from batchcraft.measure import format_table, machine_info, measure
from batchcraft.measure.race import Race
from batchcraft.parallel import BASELINES, InterOpExecutor, ParallelConfig, head_to_head, sweep, tune
from batchcraft.parallel.compare import Comparison
from batchcraft.parallel.workload import build_model, make_input

DEFAULT_MODELS = ["mlp_fc512", "mlp_fc4096", "inception_wide", "recommender", "resnet18", "treelstm"]
TOLERANCE = 0.05


def _key(cfg: dict) -> tuple:
    return (cfg["instances"], cfg["inter_op_threads"], cfg["intra_op_threads"], cfg["pin"],
            tuple(sorted(cfg.get("env", {}).items())), cfg.get("allocator", "default"),
            cfg.get("omp_wait_policy", "default"), cfg.get("matmul", "default"), cfg.get("conv", "default"),
            bool(cfg.get("compile", False)))


def _process_key(cfg: dict) -> tuple:
    return _key(cfg)[:7]


def _short(cfg: dict) -> str:
    intra = "def" if cfg["intra_op_threads"] is None else cfg["intra_op_threads"]
    knobs = [cfg[k] for k in ("matmul", "conv") if cfg.get(k, "default") != "default"]
    knobs += [cfg[k] for k in ("allocator",) if cfg.get(k, "default") != "default"]
    if cfg.get("omp_wait_policy", "default") != "default":
        knobs.append(f"wait {cfg['omp_wait_policy']}")
    return f"{cfg['instances']}x{cfg['inter_op_threads']}x{intra}" + (f" {'/'.join(knobs)}" if knobs else "")


def _cfg(d: dict, b: int, label: str | None = None) -> ParallelConfig:
    fields = {k: v for k, v in d.items() if k in ParallelConfig.__dataclass_fields__}
    return ParallelConfig.from_dict({**fields, "batch_size": b, **({"label": label} if label else {})})


CONFIDENCE = 0.9  # of the verdict's intervals: with 8 rounds the 2nd and 7th order statistics (93.0%)


def _iv(comp, i: int, j: int) -> dict:
    return comp.ratio(i, j, confidence=CONFIDENCE).to_dict()


def _verdicts(row: dict) -> None:
    s, base = row["vs_sweep_best"], row["vs_best_baseline"]

    def at_least(iv, bound):
        if iv.get("same"):
            return "yes"
        if not iv["units"]:
            return "undecided"
        return "yes" if iv["low"] >= bound else ("no" if iv["high"] < bound else "undecided")

    row["verdict_sweep"] = {"yes": "ok", "no": "MISS", "undecided": "undecided"}[at_least(s, 1 - TOLERANCE)]
    if s.get("same"):
        row["verdict_sweep"] = "ok (same config)"
    if base.get("same"):
        row["verdict_baseline"] = "ok (is the best baseline)"
    elif base["units"] and base["high"] < 1.0:
        row["verdict_baseline"] = "below"
    else:
        row["verdict_baseline"] = "ok" if at_least(base, 1 - TOLERANCE) == "yes" else "undecided"
    other = row.get("vs_other_backend")
    row["verdict_backend"] = "-" if other is None else (
        "slower backend" if other["units"] and other["high"] < 1.0 else "faster backend")


def _merged(a: Comparison, b: Comparison) -> Comparison:
    """Two head-to-head races of the same configurations as one (b's process starts as new clusters)."""
    ra, rb = a.race, b.race
    offset = 1 + max((c for c in ra.clusters if isinstance(c, int)), default=-1)
    race = Race.from_samples([x + y for x, y in zip(ra.samples, rb.samples)], labels=ra.labels, value=ra.value,
                             clusters=[*ra.clusters, *(c + offset if isinstance(c, int) else c for c in rb.clusters)])
    return Comparison(a.configs, race)


def bench_model(name: str, batch_sizes: list[int], budget_s: float, sweep_s: float, image_size: int,
                confirm_rounds: int = 8, confirm_trial_s: float = 0.5, max_confirm_rounds: int = 24) -> dict:
    t0 = time.monotonic()
    tuned = tune(name, batch_sizes=batch_sizes, budget_s=budget_s, image_size=image_size)
    tune_s = time.monotonic() - t0
    t0 = time.monotonic()
    swept = sweep(name, batch_sizes=batch_sizes, duration_s=sweep_s, image_size=image_size)
    sweep_s_used = time.monotonic() - t0
    confirm_s = 0.0
    rows = []
    for pb in tuned.per_batch:
        b = pb["batch_size"]
        at_b = [r for r in swept if r.batch_size == b]
        choice_cfg = dict(pb.get("choice") or pb["best"]["config"])  # after the knob race and tie-break
        best = max(at_b, key=lambda r: r.throughput_items_per_s)
        bases = [r for r in at_b if r.config["label"] in BASELINES]
        best_base = max(bases, key=lambda r: r.throughput_items_per_s)
        default = next(r for r in bases if r.config["label"] == "pytorch-default")
        # the choice's process with another backend: the fastest such variant the sweep measured
        same_proc = [r for r in at_b if _process_key(r.config) == _process_key(choice_cfg)
                     and _key(r.config) != _key(choice_cfg)
                     and (r.config.get("matmul"), r.config.get("conv")) != (choice_cfg.get("matmul"), choice_cfg.get("conv"))]
        other = max(same_proc, key=lambda r: r.throughput_items_per_s) if same_proc else None
        contenders = [("tuned", choice_cfg), ("sweep best", best.config), ("best baseline", best_base.config),
                      ("pytorch-default", default.config)]
        if other is not None:
            contenders.append(("other backend", other.config))
        distinct, index = [], {}
        for role, c in contenders:
            k = _key(c)
            if k not in index:
                index[k] = len(distinct)
                distinct.append(_cfg(c, b, role))  # labels name the role (one config can have several)
            index[role] = index[k]
        t1 = time.monotonic()
        comp = head_to_head(name, distinct, rounds=1, starts=confirm_rounds, duration_s=confirm_trial_s,
                            image_size=image_size) if len(distinct) > 1 else None
        empty = {"estimate": 1.0, "low": 1.0, "high": 1.0, "confidence": 1.0, "units": 0, "same": True}

        def ratio(role):
            if role not in index:
                return None
            if index[role] == index["tuned"]:
                return dict(empty)
            return _iv(comp, index["tuned"], index[role])

        # sequential: a verdict the rounds so far leave undecided gets confirm_rounds more fresh-process
        # rounds, up to max_confirm_rounds (each look's interval at CONFIDENCE; looking more than once
        # lowers the coverage of the last look somewhat, so the row says how many rounds it took)
        while comp is not None and comp.race.rounds + confirm_rounds <= max_confirm_rounds:
            probe = {"vs_sweep_best": ratio("sweep best"), "vs_best_baseline": ratio("best baseline")}
            _verdicts(probe)
            if "undecided" not in (probe["verdict_sweep"], probe["verdict_baseline"]):
                break
            more = head_to_head(name, distinct, rounds=1, starts=confirm_rounds, duration_s=confirm_trial_s,
                                image_size=image_size)
            comp = _merged(comp, more)
        confirm_s += time.monotonic() - t1

        row = {
            "model": name, "batch_size": b,
            "tuned": _short(choice_cfg), "tuned_label": choice_cfg.get("label", "grid"),
            "sweep_best": _short(best.config), "sweep_best_label": best.config["label"],
            "best_baseline": best_base.config["label"],
            "other_backend": None if other is None else _short(other.config),
            "sweep_tuned_vs_sweep_best": next((r.throughput_items_per_s for r in at_b
                                               if _key(r.config) == _key(choice_cfg)), float("nan"))
            / best.throughput_items_per_s,
            "own_final_intervals": pb.get("intervals", {}),
            "vs_sweep_best": ratio("sweep best"), "vs_best_baseline": ratio("best baseline"),
            "vs_pytorch_default": ratio("pytorch-default"), "vs_other_backend": ratio("other backend"),
            "confirm": None if comp is None else comp.to_dict(),
            "confirm_rounds": 0 if comp is None else comp.race.rounds,
        }
        _verdicts(row)
        rows.append(row)
    return {"model": name, "budget_s": budget_s, "tune_s": tune_s, "tune_start_s": tuned.start_s,
            "tune_trials": len(tuned.trials), "sweep_s": sweep_s_used, "confirm_s": confirm_s, "rows": rows,
            "analysis": tuned.analysis, "tune_notes": tuned.notes, "knobs": tuned.knobs,
            "tune_result": tuned.to_dict(), "sweep": [r.to_dict() for r in swept]}


def bench_executor(name: str, batch_sizes: list[int], image_size: int, repeats: int = 15) -> list[dict]:
    """In-process: eager with all cores vs the inter-op executor (cores split over pools)."""
    cores = len(os.sched_getaffinity(0))
    model = build_model(name)
    out = []
    saved = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for b in batch_sizes:
                x = make_input(model, b, image_size=image_size)
                torch.set_num_threads(cores)
                eager = measure(lambda: model(x), repeats=repeats, warmup=2)
                pools = min(cores, 2) if cores >= 2 else 1
                with InterOpExecutor(model, inter_op_threads=pools, intra_op_threads=max(1, cores // pools)) as run:
                    diff = (run(x) - model(x)).abs().max().item()
                    ex = measure(lambda: run(x), repeats=repeats, warmup=2)
                out.append({"model": name, "batch_size": b, "eager_ms": eager.median_ms,
                            "eager_iqr_ms": eager.iqr_ms, "executor_ms": ex.median_ms, "executor_iqr_ms": ex.iqr_ms,
                            "pools": pools, "intra_op_threads": max(1, cores // pools),
                            "speedup": eager.median_ms / ex.median_ms, "max_abs_diff": diff})
    finally:
        torch.set_num_threads(saved)
    return out


def _ivtext(iv) -> str:
    if iv is None:
        return "-"
    if iv.get("same"):
        return "same config"
    if not iv["units"]:
        return "-"
    return f"{iv['estimate']:.3g} [{iv['low']:.3g}, {iv['high']:.3g}]"


def render(report: dict) -> str:
    lines = []
    m = report["machine"]
    cov = report["models"][0]["rows"][0]["vs_best_baseline"]["confidence"] if report["models"] else 0
    lines.append(f"Machine: {m['cpu']}, {m['usable_cpus']} usable cores, torch {m['torch']}, "
                 f"Python {m['python']}; load average before/after: {report['load_before']} / {report['load_after']}.")
    seq = report.get("max_confirm_rounds")
    lines.append(f"Side by side: {report['confirm_rounds']} rounds, each in fresh worker processes (one unit of "
                 f"the interval), rotating order, {report['confirm_trial_s']:g}-s trials; intervals "
                 f"[low, high] are the order-statistics intervals of the median paired ratio "
                 f"({cov:.1%} coverage at {report['confirm_rounds']} rounds)"
                 + (f"; a row left undecided got {report['confirm_rounds']} more rounds at a time, up to {seq} "
                    f"(column \"rounds\")." if seq else "."))
    lines.append("")
    headers = ["model", "batch", "tuned", "sweep best", "tuned/sweep best", "tuned/best baseline",
               "tuned/pytorch-default", "tuned/other backend", "within 5% of sweep", "vs best baseline",
               "backend"] + (["rounds"] if seq else [])
    rows = []
    for mres in report["models"]:
        for r in mres["rows"]:
            rows.append([r["model"], r["batch_size"], f"{r['tuned']} ({r['tuned_label']})",
                         f"{r['sweep_best']} ({r['sweep_best_label']})", _ivtext(r["vs_sweep_best"]),
                         f"{_ivtext(r['vs_best_baseline'])} ({r['best_baseline']})", _ivtext(r["vs_pytorch_default"]),
                         f"{_ivtext(r['vs_other_backend'])} ({r['other_backend']})" if r["other_backend"] else "-",
                         r["verdict_sweep"], r["verdict_baseline"], r["verdict_backend"]]
                        + ([r.get("confirm_rounds", report["confirm_rounds"])] if seq else []))
    lines.append(format_table(headers, rows, markdown=True))
    lines.append("")
    lines.append(format_table(["model", "budget (s)", "tuner time (s)", "of which start-up (s)", "tuner trials",
                               "sweep time (s)", "tuner/sweep", "side-by-side time (s)"],
                              [[m["model"], m["budget_s"], m["tune_s"], m["tune_start_s"], m["tune_trials"],
                                m["sweep_s"], m["tune_s"] / m["sweep_s"], m["confirm_s"]] for m in report["models"]],
                              markdown=True))
    for mres in report["models"]:
        kr = mres.get("knobs")
        if kr and kr.get("rows"):
            lines.append("")
            by = kr.get("by_batch") or {str(kr["choice"]["batch_size"]): {"adopted": kr["adopted"]}}
            adopted = ", ".join(f"batch {b}: {v['adopted'] or 'none'}" for b, v in by.items())
            lines.append(f"Knob race of the tuner for {mres['model']} ({kr['rounds']} rounds of "
                         f"{kr['trial_s']:.2g}-s trials in one set of processes; ratio to the choice of the same "
                         f"batch size; adopted: {adopted}):")
            lines.append("")
            lines.append(format_table(["batch", "contender", "config", "items/s", "vs choice"],
                                      [[r["config"]["batch_size"], r["label"], _short(r["config"]),
                                        r["result"]["throughput_items_per_s"],
                                        _ivtext(r["ratio"]) if r["ratio"] else "1"] for r in kr["rows"]],
                                      markdown=True))
    backend_rows = []
    for mres in report["models"]:
        for v in mres["tune_result"].get("variants", []):
            for r in v["variants"]:
                if r["ratio_to_default"] is None:
                    continue
                chosen = (r["matmul"], r["conv"]) == (v["chosen"]["matmul"], v["chosen"]["conv"])
                backend_rows.append([mres["model"], v["batch_size"], v["process"].split(" b=")[0], r["matmul"],
                                     r["conv"], _ivtext(r["ratio_to_default"]), v["rounds"], "chosen" if chosen else ""])
    if backend_rows:
        lines.append("")
        lines.append("Backend races of the tuner (per process configuration, its instances running the variants "
                     "in turns of 10 ms; ratio to PyTorch's default kernels, interval over the rounds):")
        lines.append("")
        lines.append(format_table(["model", "batch", "process", "matmul", "conv", "vs default", "rounds", ""],
                                  backend_rows, markdown=True))
    tie_rows = [[mres["model"], t["batch_size"], t["process"].split(" b=")[0],
                 f"{t['chosen']['matmul']}/{t['chosen']['conv']}", f"{t['other']['matmul']}/{t['other']['conv']}",
                 t["fresh_rounds"], " ".join(f"{u:.3g}" for u in t["units"]), _ivtext(t["ratio"]),
                 "other" if t["adopted"] else "chosen"]
                for mres in report["models"] for t in mres["tune_result"].get("ties", [])]
    if tie_rows:
        lines.append("")
        lines.append("Near-tied backends decided across fresh sets of processes (per set, the two in turns of "
                     "10 ms; units: the other over the chosen per set, the search's own first):")
        lines.append("")
        lines.append(format_table(["model", "batch", "process", "chosen", "other", "fresh sets", "units",
                                   "other/chosen", "kept"], tie_rows, markdown=True))
    notes = [f"{m['model']}: {n}" for m in report["models"] for n in m["tune_notes"]]
    if notes:
        lines.append("")
        lines.append("Tuner notes: " + "; ".join(notes))
    if report["executor"]:
        lines.append("")
        lines.append(format_table(
            ["model", "batch", "eager ms (all cores)", "executor ms (pools x intra)", "speedup", "max_abs_diff"],
            [[e["model"], e["batch_size"], e["eager_ms"], f"{e['executor_ms']:.2f} ({e['pools']}x{e['intra_op_threads']})",
              e["speedup"], e["max_abs_diff"]] for e in report["executor"]], markdown=True))
    return "\n".join(lines)


def _per_model(text: str, cast) -> dict:
    out = {}
    for item in text.split(";"):
        if item.strip():
            name, value = item.split("=")
            out[name.strip()] = cast(value)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--budget-s", type=float, default=40.0, help="tuner budget per model (all batch sizes)")
    p.add_argument("--model-budgets", default="", metavar="NAME=S;...",
                   help="tuner budgets for particular models, e.g. 'inception_wide=60'")
    p.add_argument("--sweep-s", type=float, default=2.0,
                   help="sweep time per configuration and batch size (3 repeats, each >= 5 calls)")
    p.add_argument("--image-size", type=int, default=64, help="ResNet-18 input size (no example_input)")
    p.add_argument("--model-batch-sizes", default="", metavar="NAME=B1,B2;...",
                   help="batch sizes for particular models, e.g. 'treelstm=1,8'")
    p.add_argument("--confirm-rounds", type=int, default=8,
                   help="side-by-side rounds, each in fresh processes (8: 93%% intervals, one outlying round "
                        "on either side left out)")
    p.add_argument("--max-confirm-rounds", type=int, default=24,
                   help="a verdict still undecided gets --confirm-rounds more rounds, up to this many")
    p.add_argument("--confirm-trial-s", type=float, default=0.5)
    p.add_argument("--executor-models", default="inception_wide,recommender")
    p.add_argument("--executor-repeats", type=int, default=15)
    p.add_argument("--out", default=None, help="JSON path (default results/parallel-<time>.json)")
    p.add_argument("--render", nargs="+", default=None, metavar="JSON",
                   help="only print the markdown of earlier runs' JSON files, as one report")
    args = p.parse_args(argv)
    if args.render:
        parts = [json.loads(Path(f).read_text()) for f in args.render]
        merged = {**parts[0], "models": [m for r in parts for m in r["models"]],
                  "executor": [e for r in parts for e in r["executor"]],
                  "load_before": [r["load_before"][0] for r in parts], "load_after": [r["load_after"][0] for r in parts]}
        print(render(merged))
        return 0
    names = [n for n in args.models.split(",") if n]
    missing = [n for n in names if n not in models.names()]
    if missing:
        print(f"skipping models not in the registry: {missing}", file=sys.stderr)
        names = [n for n in names if n in models.names()]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    per_model_batches = _per_model(args.model_batch_sizes, lambda v: [int(b) for b in v.split(",")])
    budgets = _per_model(args.model_budgets, float)
    report = {"machine": machine_info(), "load_before": os.getloadavg(), "budget_s": args.budget_s,
              "sweep_s": args.sweep_s, "confirm_rounds": args.confirm_rounds, "confirm_trial_s": args.confirm_trial_s,
              "max_confirm_rounds": args.max_confirm_rounds,
              "batch_sizes": batch_sizes, "image_size": args.image_size,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "models": [], "executor": []}
    out = Path(args.out or f"results/parallel-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for n in args.executor_models.split(","):
        if n in names:
            report["executor"] += bench_executor(n, batch_sizes, args.image_size, args.executor_repeats)
    for n in names:
        print(f"[{time.monotonic() - t0:6.0f} s] {n}", file=sys.stderr)
        report["models"].append(bench_model(n, per_model_batches.get(n, batch_sizes), budgets.get(n, args.budget_s),
                                            args.sweep_s, args.image_size, args.confirm_rounds, args.confirm_trial_s,
                                            args.max_confirm_rounds))
        report["load_after"] = os.getloadavg()
        report["total_s"] = time.monotonic() - t0
        out.write_text(json.dumps(report, indent=1))  # after every model: a cut-short run keeps its results
    print(render(report))
    print(f"\n(total {report['total_s']:.0f} s; raw results in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
