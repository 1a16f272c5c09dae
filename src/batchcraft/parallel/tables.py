"""Tables and a plot of a :class:`~batchcraft.parallel.search.TuneResult` for people."""

from __future__ import annotations

from batchcraft.measure import format_table
from batchcraft.parallel.baselines import BASELINES

__all__ = ["tried_table", "comparison_table", "plot"]


def _cfg_cells(c: dict) -> list:
    intra = "default" if c["intra_op_threads"] is None else c["intra_op_threads"]
    return [c.get("label") or "grid", c["instances"], c["inter_op_threads"], intra]


def tried_table(result: dict, *, markdown: bool = False) -> str:
    """Every configuration tried, at its last round (median of that round's repeats)."""
    last: dict[tuple, dict] = {}
    for t in result["rounds"]:
        c = t["config"]
        key = (t["batch_size"], c["label"], c["instances"], c["inter_op_threads"], c["intra_op_threads"])
        if key not in last or t["round"] >= last[key]["round"]:
            last[key] = t
    rows = [[t["batch_size"], *_cfg_cells(t["config"]), t["round"], t["duration_s"] * t["repeats"],
             t["throughput_items_per_s"], t["latency_p50_ms"], t["latency_p90_ms"]]
            for t in sorted(last.values(), key=lambda t: (t["batch_size"], -t["round"], -t["throughput_items_per_s"]))]
    return format_table(["batch", "config", "instances", "inter-op", "intra-op", "round", "round_s",
                         "items/s", "p50_ms", "p90_ms"], rows, markdown=markdown)


def comparison_table(result: dict, *, markdown: bool = False) -> str:
    """Per batch size: the tuned choice against each baseline, measured in the same final round.

    Items/s are final-round medians; a ratio marked "(playoff)" comes from the playoff's longer
    trials (its two rows follow), which decided between the choice and that baseline.
    """
    rows = []
    for pb in result["per_batch"]:
        best = pb["best"]
        rows.append([pb["batch_size"], "tuned", *_cfg_cells(best["config"])[1:], best["throughput_items_per_s"],
                     best["latency_p50_ms"], 1.0])
        decided = pb.get("decided_by", {})
        for label in [lbl for lbl in BASELINES if lbl in pb["baselines"]]:
            r = pb["baselines"][label]
            ratio = pb["ratios"][label]
            rows.append([pb["batch_size"], label, *_cfg_cells(r["config"])[1:], r["throughput_items_per_s"],
                         r["latency_p50_ms"], f"{ratio:.3g} (playoff)" if decided.get(label) == "playoff" else ratio])
        for p in pb.get("playoff", []):  # the longer trials that decided a close final round
            rows.append([pb["batch_size"], f"playoff ({pb['playoff_trial_s']:.2g}-s trials): {p['config']['label']}",
                         *_cfg_cells(p["config"])[1:], p["throughput_items_per_s"], p["latency_p50_ms"], "-"])
    ratio = "tuned/baseline" if result["objective"] == "throughput" else "baseline/tuned p50"
    return format_table(["batch", "config", "instances", "inter-op", "intra-op", "items/s", "p50_ms", ratio],
                        rows, markdown=markdown)


def plot(result: dict, path) -> None:
    """Bar chart of items/s, tuned vs baselines, one panel per batch size (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        from batchcraft.errors import ConfigurationError

        raise ConfigurationError("plot: matplotlib is not installed",
                                 hint="pip install 'batchcraft[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = result["per_batch"]
    fig, axes = plt.subplots(1, len(per), figsize=(4.5 * len(per), 3.8), squeeze=False)
    for ax, pb in zip(axes[0], per):
        present = [k for k in BASELINES if k in pb["baselines"]]
        labels = ["tuned", *present]
        values = [pb["best"]["throughput_items_per_s"]] + [pb["baselines"][k]["throughput_items_per_s"] for k in present]
        ax.bar(range(len(labels)), values, color=["tab:green"] + ["tab:gray"] * len(present))
        ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30, ha="right")
        ax.set_title(f"{result['model']}, batch {pb['batch_size']}")
        ax.set_ylabel("items/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
