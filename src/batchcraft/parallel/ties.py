"""Near-tied backends decided across fresh processes: :func:`near_tie` and :func:`break_ties`.

The backend race of :func:`~batchcraft.parallel.knobs.pick_variants` runs inside one set of
processes, and resolves a few percent there. But which of two backends is faster can depend on
the process: at batch 1 a large linear layer is a matrix-vector product streaming its packed
weight once per call, and how fast oneDNN's and MKL's packed layouts stream differs between
processes (their memory placement) by as much as the two backends differ. Measured here on
mlp_fc4096 at batch 1 (stop 25, ``docs/benchmarks.md``): one race chose MKL-packed 1.10x over
the default beside oneDNN 1.00x, a repeat chose oneDNN 1.11x beside MKL-packed 1.05x, and
fresh processes side by side then found MKL-packed 1.11x faster than the repeat's choice.

So a backend chosen over the default and the next best backend count as a *near tie* when their
estimates lie within :data:`NEAR_TIE` of each other, whatever their intervals (the repeat above:
MKL-packed 1.05 [1.00, 1.12] beside oneDNN 1.11 [1.07, 1.13]). It is decided at the end, in time
held back from the knob race: each round starts a fresh set of processes of the same
configuration, races the two inside them, and stops them; every set of processes (the search's
own included) is one unit, the per-process median ratio. The choice is the backend whose median
over processes is higher, i.e. the one faster in a typical process.
"""

from __future__ import annotations

import statistics

from batchcraft.errors import BatchcraftError
from batchcraft.measure.race import RatioInterval, median_interval
from batchcraft.parallel.config import ParallelConfig

__all__ = ["NEAR_TIE", "FRESH_RACE_S", "FRESH_MIN_ROUNDS", "FRESH_MAX_ROUNDS", "near_tie", "break_ties",
           "time_needed"]

NEAR_TIE = 1.12  # chosen backend and runner-up, estimates within this factor (process-to-process swings
# of the two backends' ratio on mlp_fc4096 batch 1 here: 0.90-1.06)
FRESH_RACE_S = 0.5  # per fresh set of processes: the two backends in turns (as the search's race)
FRESH_MIN_ROUNDS = 3  # fresh sets of processes, at least (with the search's: 4 units), or no tie-break
FRESH_MAX_ROUNDS = 6
FRESH_START_MIN_S = 3.0  # a fresh set's start-up is assumed to take at least this (a 2-process set of
# mlp_fc4096 here: 3-5 s a round with both warm-ups; a share of the first start-up predicted 1.8 s,
# and only 2 of 3 rounds fitted)
CONFIDENCE = 0.9


def process_unit(race, i: int, j: int) -> float | None:
    """Median in-process ratio of variant i over variant j in one race (None: no round had both)."""
    pairs = [r for _, r in race.paired(i, j)]
    return statistics.median(pairs) if pairs else None


def near_tie(rows: list[dict], chosen: int, race) -> dict | None:
    """The runner-up of a backend race when it is a near tie with the chosen variant, else None.

    Args:
        rows: per variant (default first) its ``matmul``, ``conv`` and ``ratio_to_default``
            (interval dict, None for the default), as :func:`pick_variants` records them.
        chosen: index of the chosen variant.
        race: the race (variants in ``rows`` order).
    Returns:
        ``{"matmul", "conv", "index", "unit"}`` of the runner-up (``unit``: its median ratio over
        the chosen variant in this race), when a backend was chosen over the default and the
        next best backend's estimate lies within NEAR_TIE of the chosen one's. The default is
        never a runner-up: it gives way only to a backend decided faster (pick_variants' rule).
    """
    if chosen == 0:
        return None
    others = sorted((j for j, r in enumerate(rows) if j and j != chosen and r["ratio_to_default"]),
                    key=lambda j: -rows[j]["ratio_to_default"]["estimate"])
    if not others or not rows[chosen]["ratio_to_default"]:
        return None
    j = others[0]
    if rows[chosen]["ratio_to_default"]["estimate"] >= NEAR_TIE * rows[j]["ratio_to_default"]["estimate"]:
        return None
    return {"matmul": rows[j]["matmul"], "conv": rows[j]["conv"], "index": j, "unit": process_unit(race, j, chosen)}


def round_cost(engine, cfg: ParallelConfig, start_s: float) -> float:
    """Predicted seconds of one fresh round: start-up (at least FRESH_START_MIN_S), both
    warm-ups, the race, overhead."""
    return max(FRESH_START_MIN_S, start_s) + 2 * max(engine.cost.warmup_s, engine.cost.call_time(cfg)) + FRESH_RACE_S + engine.cost.overhead_s


def tied(cfg: ParallelConfig, b: int, variant_records: list) -> dict | None:
    """The backend race record of ``cfg`` at batch size ``b`` if it holds a near tie of ``cfg``'s backend."""
    return next((v for v in variant_records if v.get("near_tie") and v["batch_size"] == b
                 and v["key"] == repr(cfg.key()) and not cfg.compile
                 and (cfg.matmul, cfg.conv) == (v["chosen"]["matmul"], v["chosen"]["conv"])), None)


def time_needed(finals: list, variant_records: list, engine, start_s: float) -> float:
    """Seconds for FRESH_MIN_ROUNDS fresh rounds of every final choice with a near tie."""
    return sum(FRESH_MIN_ROUNDS * round_cost(engine, cfg, start_s)
               for cfg, _, b in finals if tied(cfg, b, variant_records))


def break_ties(groups, engine, budget, finals: list, variant_records: list, *, start_s: float, rnd: int
               ) -> tuple[list, list[dict], list[str]]:
    """Decide each final choice's near-tied backend (:func:`near_tie`) across fresh processes.

    Args:
        groups: the tuner's groups; ``groups.race_variants(cfgs, duration_s, warmup_s, block_s,
            fresh=True)`` races in a new set of processes and stops them.
        engine: the search engine (its cost model and trial log).
        budget: the run's :class:`~batchcraft.parallel.budget.Budget`; no fresh round starts that
            would end after its hard end, and none at all unless FRESH_MIN_ROUNDS fit.
        finals: (config, result, batch size) per batch size, the overall choice first.
        variant_records: the backend races' records (a near tie has ``near_tie``).
        start_s: predicted seconds to start one fresh set of processes (then measured).
        rnd: the round number for the trial log.
    Returns:
        (finals with each decided tie's choice, records for the report, notes).
    """
    from batchcraft.parallel.knobs import VARIANT_BLOCK_S

    out, records, notes = list(finals), [], []
    for n, (cfg, _, b) in enumerate(finals):
        rec = tied(cfg, b, variant_records)
        if rec is None:
            continue
        tie = rec["near_tie"]
        other = cfg.replace(matmul=tie["matmul"], conv=tie["conv"], compile=False)
        pair = [cfg, other]
        units = [] if tie["unit"] is None else [tie["unit"]]
        round_s = round_cost(engine, cfg, start_s)
        if budget.clock() + FRESH_MIN_ROUNDS * round_s > budget.hard_end:
            notes.append(f"batch {b}: no time to decide the near tie of {cfg.matmul}/{cfg.conv} and "
                         f"{other.matmul}/{other.conv} ({cfg.short()}) in fresh processes "
                         f"({FRESH_MIN_ROUNDS} x {round_s:.1f} s); the search's race stands")
            continue
        got = []  # per fresh round: (chosen's result, other's result)
        while len(got) < FRESH_MAX_ROUNDS and budget.clock() + round_s <= budget.hard_end:
            if len(got) >= FRESH_MIN_ROUNDS and (all(u > 1 for u in units) or all(u < 1 for u in units)):
                break  # every process agrees
            t0 = budget.clock()
            try:
                results, race = groups.race_variants(pair, FRESH_RACE_S, engine.cost.warmup_s, VARIANT_BLOCK_S,
                                                     fresh=True)
            except BatchcraftError as exc:
                notes.append(f"batch {b}: fresh-process race of {cfg.short()} failed: {str(exc).splitlines()[0]}")
                break
            took = budget.clock() - t0
            round_s = max(round_s, took) if not got else 0.5 * (round_s + took)
            got.append(tuple(results))
            for r in results:
                engine.trials.append({"round": rnd, "role": "tie-break", "repeat": len(got),
                                      "duration_s": FRESH_RACE_S, **r.to_dict()})
            u = process_unit(race, 1, 0)
            if u is not None:
                units.append(u)
            engine.on_trial()
        if len(got) < FRESH_MIN_ROUNDS or len(units) < 2:
            notes.append(f"batch {b}: the near tie of {cfg.short()} got {len(got)} fresh sets of processes; "
                         "the search's race stands")
            continue
        est = statistics.median(units)
        low, high, cov = median_interval(units, CONFIDENCE)
        iv = RatioInterval(est, low, high, cov, len(units))
        adopted = est > 1.0
        if adopted:  # the other's result from its median fresh round
            ranked = sorted(got, key=lambda rr: rr[1].throughput_items_per_s)
            out[n] = (other.replace(label=cfg.label), ranked[len(ranked) // 2][1], b)
        records.append({"batch_size": b, "process": rec["process"], "chosen": {"matmul": cfg.matmul, "conv": cfg.conv},
                        "other": {"matmul": other.matmul, "conv": other.conv}, "fresh_rounds": len(got),
                        "units": units, "ratio": iv.to_dict(), "adopted": adopted,
                        "items_per_s": {"chosen": [g[0].throughput_items_per_s for g in got],
                                        "other": [g[1].throughput_items_per_s for g in got]}})
    return out, records, notes
