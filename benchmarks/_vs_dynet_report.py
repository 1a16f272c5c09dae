"""Tables, plot and docs text for benchmarks/vs_dynet.py (issue 7).

Everything here only renders the payload that vs_dynet.py measured: rows per
(model, mode, hidden, batch size) with each system's median ms per batch, the best
DyNet auto-batching mode and the best batchcraft scheduler, ratios, the FLOP-bound
time and the fraction of it each system reaches; peak memory per system.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from batchcraft.measure import format_table

MIB = 2 ** 20
DYNET_NAMES = {"dynet-0": "off", "dynet-1": "agenda", "dynet-2": "depth", "dynet-3": "agenda-depthcount"}
NODEDUP = "batchcraft-depth-nodedup"  # the ablation system (vs_dynet.py --systems ...,nodedup)


def _best(by_sys: dict, prefix: str, mode: str, exclude=()) -> tuple[float | None, str | None]:
    cands = {s: r[f"{mode}_ms"] for s, r in by_sys.items()
             if s.startswith(prefix) and s not in exclude and f"{mode}_ms" in r}
    if not cands:
        return None, None
    s = min(cands, key=cands.get)
    return cands[s], s


def _ratio(a, b):
    return a / b if a is not None and b else None


def rows(payload: dict) -> list[dict]:
    """One dict per (model, mode, hidden, batch size): times (``*_ms``), ratios and fractions."""
    rate = payload["gemm"]["rate_flop_per_s"]
    flops = {(f["model"], f["hidden"], f["batch_size"]): f for f in payload["flops"]}
    groups = defaultdict(dict)
    for r in payload["results"]:
        if "error" not in r:
            groups[(r["model"], r["hidden"], r["batch_size"])][r["system"]] = r
    out = []
    for mode in payload["args"]["modes"].split(","):
        for key in sorted(groups):
            by = groups[key]
            model, hidden, bs = key
            f = flops[key]
            flop_ms = (f["forward_flops"] if mode == "inference" else f["train_flops"]) / rate * 1e3
            dy_best, dy_sys = _best(by, "dynet-", mode, exclude=("dynet-0",))
            bc, bc_sys = _best(by, "batchcraft-", mode, exclude=(NODEDUP,))
            row = {"model": model, "mode": mode, "hidden": hidden, "batch_size": bs,
                   "dynet_off_ms": by.get("dynet-0", {}).get(f"{mode}_ms"),
                   "dynet_best_ms": dy_best, "dynet_best_mode": DYNET_NAMES.get(dy_sys),
                   "eager_ms": by.get("eager", {}).get(f"{mode}_ms"),
                   "handbatched_ms": by.get("handbatched", {}).get(f"{mode}_ms"),
                   "batchcraft_ms": bc, "batchcraft_scheduler": bc_sys and bc_sys.split("-", 1)[1],
                   "flop_bound_ms": flop_ms,
                   "batchcraft_nodedup_ms": by.get(NODEDUP, {}).get(f"{mode}_ms")}
            row["batchcraft_vs_dynet_best"] = _ratio(dy_best, bc)  # > 1: batchcraft faster
            row["batchcraft_vs_handbatched"] = _ratio(bc, row["handbatched_ms"])  # time ratio, goal <= 1.15
            row["batchcraft_vs_eager"] = _ratio(row["eager_ms"], bc)
            row["dynet_autobatch_gain"] = _ratio(row["dynet_off_ms"], dy_best)
            for name in ("batchcraft", "dynet_best", "handbatched"):
                row[f"{name}_flop_fraction"] = _ratio(flop_ms, row[f"{name}_ms"])
            out.append(row)
    return out


def geomean(xs) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def main_table(rs: list[dict], markdown: bool) -> str:
    ablation = any(r.get("batchcraft_nodedup_ms") is not None for r in rs)
    headers = ["model", "mode", "hidden", "batch", "DyNet off", "DyNet best (mode)", "eager", "hand-batched",
               "batchcraft (sched)", "FLOP bound", "bc vs DyNet best", "bc / hand", "bc vs eager",
               "% FLOP bound bc", "% FLOP bound DyNet"] + (["bc without dedup", "its vs DyNet best"]
                                                          if ablation else [])
    body = [[r["model"], r["mode"], r["hidden"], r["batch_size"], _f(r["dynet_off_ms"]),
             f"{_f(r['dynet_best_ms'])} ({r['dynet_best_mode'] or '-'})", _f(r["eager_ms"]),
             _f(r["handbatched_ms"]), f"{_f(r['batchcraft_ms'])} ({r['batchcraft_scheduler'] or '-'})",
             _f(r["flop_bound_ms"], "{:.2f}"), _f(r["batchcraft_vs_dynet_best"], "{:.2f}x"),
             _f(r["batchcraft_vs_handbatched"], "{:.2f}"), _f(r["batchcraft_vs_eager"], "{:.1f}x"),
             _f(r["batchcraft_flop_fraction"] and 100 * r["batchcraft_flop_fraction"], "{:.1f}%"),
             _f(r["dynet_best_flop_fraction"] and 100 * r["dynet_best_flop_fraction"], "{:.1f}%")]
            + ([_f(r.get("batchcraft_nodedup_ms")), _f(_ratio(r["dynet_best_ms"], r.get("batchcraft_nodedup_ms")),
                                                       "{:.2f}x")] if ablation else [])
            for r in rs]
    return format_table(headers, body, markdown=markdown)


def memory_table(payload: dict, markdown: bool) -> str:
    bmax = max(int(b) for b in payload["args"]["batch_sizes"].split(","))
    body = []
    for r in payload["results"]:
        if "error" in r or r["batch_size"] != bmax:
            continue
        body.append([r["model"], r["hidden"], r["system"], _f(r["rss_setup_bytes"] / MIB, "{:.0f}"),
                     _f(r.get("rss_peak_inference_bytes", 0) / MIB, "{:.0f}"),
                     _f(r.get("rss_peak_train_bytes", 0) / MIB, "{:.0f}")])
    headers = ["model", "hidden", "system", "after set-up MiB", "peak after inference MiB",
               "peak after training MiB"]
    return f"batch {bmax}:\n\n" + format_table(headers, body, markdown=markdown)


def check_table(payload: dict, markdown: bool) -> str:
    worst = defaultdict(lambda: [None, None])
    for r in payload["results"]:
        for i, k in enumerate(("out_max_abs_diff", "grad_max_abs_diff")):
            if k in r:
                w = worst[(r["model"], r["system"])]
                w[i] = max(w[i] or 0.0, r[k])
    body = [[m, s, _f(a, "{:.1e}"), _f(b, "{:.1e}")] for (m, s), (a, b) in sorted(worst.items())]
    errors = [f"{r['model']} h{r['hidden']} b{r['batch_size']} {r['system']}: {r['error']}"
              for r in payload["results"] if "error" in r]
    t = format_table(["model", "system", "max |out - eager|", "max |grad - eager|"], body, markdown=markdown)
    return t + ("\n\nFailed runs:\n" + "\n".join(f"- {e}" for e in errors) if errors else "")


def headline(rs: list[dict]) -> str:
    bmax = max(r["batch_size"] for r in rs)
    inf = [r for r in rs if r["mode"] == "inference" and r["batch_size"] == bmax]
    with_dynet = [r for r in inf if r.get("batchcraft_vs_dynet_best")]
    if not with_dynet:  # DyNet not installed or not run (benchmarks/setup_dynet.sh)
        return f"Inference at batch {bmax}: no DyNet figures in this run (DyNet not run or not installed)."
    g = geomean(r["batchcraft_vs_dynet_best"] for r in with_dynet)
    wins = sum(1 for r in with_dynet if r["batchcraft_vs_dynet_best"] > 1)
    return (f"Inference at batch {bmax}: batchcraft vs. DyNet best auto-batching, geometric mean "
            f"{_f(g, '{:.2f}x')} over {len(with_dynet)} rows ({wins} faster than DyNet).")


def text_tables(payload: dict) -> str:
    rs = payload["rows"]
    parts = [main_table(rs, False), memory_table(payload, False), check_table(payload, False)]
    if rs:
        parts.append(headline(rs))
    parts += payload["notes"]
    return "\n\n".join(parts)


def plot(payload: dict, path: str) -> None:
    """Bar chart of speed relative to DyNet's best auto-batching mode (or eager), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = payload["rows"]
    modes = [m for m in ("inference", "train") if any(r["mode"] == m for r in rs)]
    base = "dynet_best_ms" if any(r["dynet_best_ms"] for r in rs) else "eager_ms"
    series = [("DyNet off", "dynet_off_ms"), ("DyNet best", "dynet_best_ms"), ("eager", "eager_ms"),
              ("hand-batched", "handbatched_ms"), ("batchcraft", "batchcraft_ms"),
              ("FLOP bound", "flop_bound_ms")]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        mr = [r for r in rs if r["mode"] == mode]
        w = 0.8 / len(series)
        for j, (label, key) in enumerate(series):
            ys = [(r[base] / r[key]) if r[key] and r[base] else 0 for r in mr]
            ax.bar([i + j * w for i in range(len(mr))], ys, w, label=label)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(mr))])
        ax.set_xticklabels([f"{r['model']} h{r['hidden']} b{r['batch_size']}" for r in mr], fontsize=7,
                           rotation=45, ha="right")
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(f"{mode}: speed relative to {'DyNet best auto-batching' if base == 'dynet_best_ms' else 'eager'}")
        ax.set_ylabel("x (higher is faster)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(payload: dict, plot_path: Path) -> str:
    m, g, a = payload["machine"], payload["gemm"], payload["args"]
    rs = payload["rows"]
    rates = ", ".join(f"{k}: {v / 1e9:.0f}" for k, v in g["rates_flop_per_s"].items())
    lines = [
        "## Auto-batching side by side: DyNet, eager, hand-batched, batchcraft (issue 7)",
        "",
        f"Command: `{payload['command']}` (or `batchcraft bench` with the same options), "
        f"{payload['wall_s'] / 60:.1f} min.",
        "",
        f"Machine: {m['cpu']}, {m['usable_cpus']} usable CPUs, torch {m['torch']} with {a['threads']} "
        "intra-op thread(s) for every timed PyTorch system, DyNet 2.1.2 (CPU backend, Eigen, one thread): "
        "the same thread count on both sides. (On this shared 2-core machine, 2 torch threads under load "
        "made eager per-instance TreeLSTM 20-35x slower than 1 thread: every small op's parallel region "
        "waits for a descheduled thread.) Load average (1/5/15 min) "
        f"{payload['load_avg_before']} before, {payload['load_avg_after']} after"
        + (" (the CPU was shared with other runs)." if payload['load_avg_before'][0] > 1.5 else " (nothing else ran)."),
        "",
        f"Inputs: the first {a['sentences']} UD English EWT dev sentences, in file order, cut into batches; "
        f"ms per batch = median of {a['repeats']} timed passes over all batches after {a['warmup']} warm-up "
        "pass(es); every system in a fresh process, same parameters (copied from the torch model). "
        "Inference = forward of all outputs (torch under `no_grad`); training step = forward, loss = sum "
        "of all outputs, backward (gradients only, no optimizer). DyNet best = fastest of its auto-batching "
        "strategies 1 agenda / 2 depth / 3 agenda with per-depth counts; batchcraft = "
        "`batchcraft.autobatch(model, scheduler=...)`, fastest of depth/agenda. Hand-batched = "
        "`batchcraft.models.handbatched` (TreeLSTM level by level).",
        "",
        f"FLOP bound = FLOPs per batch (counted per node, benchmarks/_flops.py, checked against "
        f"`torch.utils.flop_counter`; training = 3x forward) / {g['rate_flop_per_s'] / 1e9:.0f} GFLOP/s, "
        f"the best fp32 `torch.mm` rate with {g['threads']} threads (all usable CPUs: the machine's "
        f"limit) measured at the start and the end of the run ({g['best_shape']}; all shapes, GFLOP/s: "
        f"{rates}). '% FLOP bound' = bound / time.",
        "",
        main_table(rs, True),
        "",
        headline(rs) if rs else "",
        "",
        "Peak resident memory (`VmHWM`, the peak RSS of each system's own fresh process; DyNet's process "
        f"imports numpy and DyNet only; without auto-batching it starts with {a.get('dynet_mem')} MB pools "
        "grown on demand, with auto-batching DyNet cannot grow them, so they are allocated up front "
        f"({a.get('dynet_autobatch_mem')} MB, doubled while a run fails for memory; the `dynet_mem_mb` "
        "of each run is in the JSON) and its peak is mostly that allocation. The others import torch and "
        "batchcraft. Inference runs before training, so the training peak includes it):",
        "",
        memory_table(payload, True),
        "",
        "Cross-check against eager PyTorch (first batch: outputs; gradient of one weight after one step):",
        "",
        check_table(payload, True),
        "",
        f"![speed relative to DyNet]({Path(plot_path).name})",
    ]
    if payload["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in payload["notes"]]
    return "\n".join(lines)
