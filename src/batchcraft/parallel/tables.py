"""Tables and a plot of a :class:`~batchcraft.parallel.search.TuneResult` for people.

Every number says which round it comes from: the "tried" table has one row per configuration and
round kind it was measured in (search round n, final, playoff, knobs), and the comparison table's
items/s are the final round's medians (the playoff's or the knob race's rows follow where those
decided). Ratios come with their interval: ``1.23 [1.10, 1.31] 94%`` is the median paired ratio
of the deciding round's passes and the order-statistics interval with its coverage.
"""

from __future__ import annotations

from batchcraft.measure import format_table
from batchcraft.parallel.baselines import BASELINES

__all__ = ["tried_table", "comparison_table", "variant_table", "knob_table", "tie_table", "plot", "interval_text"]

_ROLE_ORDER = {"knobs": 0, "playoff": 1, "final": 2, "search": 3}


def interval_text(iv: dict | None) -> str:
    """``"1.23 [1.10, 1.31] 94%"``, or "-" without an interval."""
    if not iv or not iv.get("units"):
        return "-"
    return f"{iv['estimate']:.3g} [{iv['low']:.3g}, {iv['high']:.3g}] {iv['confidence']:.0%}"


def _knob_text(c: dict) -> str:
    parts = []
    if c.get("matmul", "default") != "default":
        parts.append(f"matmul {c['matmul']}")
    if c.get("conv", "default") != "default":
        parts.append(f"conv {c['conv']}")
    if c.get("compile"):
        parts.append("compile")
    if c.get("allocator", "default") != "default":
        parts.append(c["allocator"])
    if c.get("omp_wait_policy", "default") != "default":
        parts.append(f"wait {c['omp_wait_policy']}")
    return ", ".join(parts) or "-"


def _cfg_cells(c: dict) -> list:
    intra = "default" if c["intra_op_threads"] is None else c["intra_op_threads"]
    return [c.get("label") or "grid", c["instances"], c["inter_op_threads"], intra, _knob_text(c)]


def _round_name(t: dict) -> str:
    return f"search {t['round']}" if t["role"] == "search" else t["role"]


def tried_table(result: dict, *, markdown: bool = False) -> str:
    """Every configuration tried, once per kind of round (its last search round, the final round,
    the playoff, the knob race), with that round's median: rows of one configuration from
    different rounds differ because the rounds' trials differ in length and time."""
    last: dict[tuple, dict] = {}
    for t in result["rounds"]:
        c = t["config"]
        kind = "search" if t["role"] == "search" else t["role"]
        key = (t["batch_size"], kind, c.get("label"), c["instances"], c["inter_op_threads"], c["intra_op_threads"],
               _knob_text(c))
        if key not in last or t["round"] >= last[key]["round"]:
            last[key] = t
    rows = [[t["batch_size"], *_cfg_cells(t["config"]), _round_name(t), t["duration_s"], t["repeats"],
             t["throughput_items_per_s"], t["latency_p50_ms"], t["latency_p90_ms"]]
            for t in sorted(last.values(), key=lambda t: (t["batch_size"], _ROLE_ORDER.get(t["role"], 9),
                                                          -t["throughput_items_per_s"]))]
    return format_table(["batch", "config", "instances", "inter-op", "intra-op", "knobs", "round", "trial_s",
                         "passes", "items/s", "p50_ms", "p90_ms"], rows, markdown=markdown)


def comparison_table(result: dict, *, markdown: bool = False) -> str:
    """Per batch size: the tuned choice against each baseline, measured in the same final round.

    Items/s are final-round medians (a "tuned + knob" row: the knob race's median of the change
    adopted at that batch size, with its interval against the tuned row); a ratio marked
    "(playoff)" comes from the playoff's longer trials (its two rows follow), which decided
    between the choice and that baseline. The ratio column divides the two rows' median items/s;
    the last column gives the deciding round's paired ratios (each pass of the choice over the
    same pass of the baseline, within one set of worker processes): their median, the interval
    around it and that interval's confidence, which is lower where the budget allowed few passes.
    The two can differ (a median of ratios is not a ratio of medians).
    """
    rows = []
    for pb in result["per_batch"]:
        best = pb["best"]
        rows.append([pb["batch_size"], "tuned", *_cfg_cells(best["config"])[1:], "final",
                     best["throughput_items_per_s"], best["latency_p50_ms"], 1.0, "-"])
        kb = pb.get("knobs")
        if kb and kb.get("adopted"):  # a knob change adopted after the final round
            rows.append([pb["batch_size"], f"tuned + {kb['adopted']}", *_cfg_cells(kb["choice"])[1:], "knobs",
                         kb["result"]["throughput_items_per_s"], kb["result"]["latency_p50_ms"], "-",
                         f"{interval_text(kb['ratio'])} (vs tuned)" if kb.get("ratio") else "-"])
        decided = pb.get("decided_by", {})
        intervals = pb.get("intervals", {})
        for label in [lbl for lbl in BASELINES if lbl in pb["baselines"]]:
            r = pb["baselines"][label]
            ratio = pb["ratios"][label]
            by = decided.get(label, "final")
            rows.append([pb["batch_size"], label, *_cfg_cells(r["config"])[1:], "final",
                         r["throughput_items_per_s"], r["latency_p50_ms"],
                         f"{ratio:.3g} ({by})" if by == "playoff" else ratio, interval_text(intervals.get(label))])
        for p in pb.get("playoff", []):  # the longer trials that decided a close final round
            rows.append([pb["batch_size"], p["config"]["label"], *_cfg_cells(p["config"])[1:],
                         f"playoff ({pb['playoff_trial_s']:.2g}-s trials)", p["throughput_items_per_s"],
                         p["latency_p50_ms"], "-", "-"])
    ratio = "tuned/baseline" if result["objective"] == "throughput" else "tuned vs baseline"
    return format_table(["batch", "config", "instances", "inter-op", "intra-op", "knobs", "round", "items/s",
                         "p50_ms", ratio, "paired ratio [interval] confidence"], rows, markdown=markdown)


def variant_table(result: dict, *, markdown: bool = False) -> str | None:
    """The backend races: per batch size and process configuration, each matmul / conv variant's
    items/s (its instances taking turns in short blocks) and its ratio to PyTorch's default with
    the interval; "chosen" marks what the search went on with. None if no race ran."""
    races = result.get("variants") or []
    if not races:
        return None
    rows = []
    for v in races:
        for r in v["variants"]:
            chosen = (r["matmul"], r["conv"]) == (v["chosen"]["matmul"], v["chosen"]["conv"])
            rows.append([v["batch_size"], v["process"].split(" b=")[0], r["matmul"], r["conv"],
                         r["throughput_items_per_s"], r["latency_p50_ms"],
                         interval_text(r["ratio_to_default"]) if r["ratio_to_default"] else "1 (reference)",
                         "chosen" if chosen else ""])
    return format_table(["batch", "process", "matmul", "conv", "items/s", "p50_ms", "vs default", "chosen"], rows,
                        markdown=markdown)


def tie_table(result: dict, *, markdown: bool = False) -> str | None:
    """Near-tied backends decided across fresh sets of processes: per batch size the two
    backends, each set's ratio of the other over the chosen (the search's own set first), the
    median with its interval, and which was kept. None if no tie-break ran."""
    ties = result.get("ties") or []
    if not ties:
        return None
    rows = [[t["batch_size"], t["process"].split(" b=")[0], f"{t['chosen']['matmul']}/{t['chosen']['conv']}",
             f"{t['other']['matmul']}/{t['other']['conv']}", t["fresh_rounds"],
             " ".join(f"{u:.3g}" for u in t["units"]), interval_text(t["ratio"]),
             "other" if t["adopted"] else "chosen"] for t in ties]
    return format_table(["batch", "process", "chosen", "other", "fresh sets", "per set", "other/chosen", "kept"],
                        rows, markdown=markdown)


def knob_table(result: dict, *, markdown: bool = False) -> str | None:
    """The knob race: the choice, the best baseline and each one-knob change, side by side.

    The ratio is the contender over the choice (> 1: faster than the choice); "adopted" marks the
    change the tuner kept. None if no knob race ran.
    """
    kr = result.get("knobs")
    if not kr or not kr.get("rows"):
        return None
    rows = []
    for r in kr["rows"]:
        c, res = r["config"], r["result"]
        mark = " (adopted)" if r["label"] == kr.get("adopted") else ""
        rows.append([c["batch_size"], r["label"] + mark, *_cfg_cells(c)[1:], res["throughput_items_per_s"],
                     res["latency_p50_ms"], interval_text(r.get("ratio")) if r.get("ratio") else "1 (reference)"])
    return format_table(["batch", "contender", "instances", "inter-op", "intra-op", "knobs", "items/s", "p50_ms",
                         "vs choice"], rows, markdown=markdown)


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
        ax.set_title(f"{result['model'][:40]}, batch {pb['batch_size']}")
        ax.set_ylabel("items/s (final round)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
