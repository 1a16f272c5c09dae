"""The knobs beyond threads: which to try, and the knob race that measures them on the choice.

Model-level knobs (``matmul`` and ``conv`` backends) switch inside running instances at no
start-up cost, so each process configuration of the grid races its backend variants *inside* its
instances before the search (:func:`pick_variants`: the variants take turns in 10-ms blocks for
a second, so other processes' load and drift hit them alike and a few percent are resolved);
the grid keeps, per process configuration, the fastest variant when its whole interval
against PyTorch's default lies above 1, else the default. Process-level knobs (``allocator``, ``omp_wait_policy``)
and ``compile`` need new processes or a long first call, so they are measured once, on the
choice, in a **knob race** (:func:`knob_race`): the choice, the best baseline of its batch size and
the choice with one knob changed at a time, side by side in interleaved rounds
(:class:`batchcraft.measure.race.Race`). A change is adopted when it is faster with its whole
interval above 1 (every round agreeing, with 5 rounds); at most one change (the fastest such):
the knobs' effects are not assumed to add up. Every alternative's ratio to the choice, with its
interval, goes into the report whether adopted or not; that the choice without a backend knob is
slower (e.g. oneDNN's gain) is measured in the same race.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from batchcraft.errors import BatchcraftError
from batchcraft.measure.race import Race
from batchcraft.parallel.backends import convert, relevant_knobs
from batchcraft.parallel.config import ParallelConfig
from batchcraft.parallel.env_knobs import WAIT_POLICIES, available_allocators
from batchcraft.parallel.ties import near_tie
from batchcraft.parallel.workload import invoke

__all__ = ["KNOB_NAMES", "DEFAULT_KNOBS", "model_variants", "pick_variants", "alternatives", "knob_race",
           "KnobRaceResult", "KnobEntry", "fit_entries"]

KNOB_NAMES = ("matmul", "conv", "allocator", "omp_wait_policy", "compile")
DEFAULT_KNOBS = ("matmul", "conv", "allocator", "omp_wait_policy")  # compile: opt-in (see tune())
KNOB_SHARE = 0.3  # of the budget, set aside for the knob race when the budget allows one...
KNOB_MAX_S = 15.0  # ...but no more, per batch size raced: 5 rounds of a handful of contenders (large
# budgets go to the search)
KNOB_FIT = 0.7  # of the knob race's time, at most, for the shortest rounds of the batch sizes raced
KNOB_MIN_TRIAL_S = 0.1
KNOB_MIN_CALLS = 3
KNOB_ROUNDS = 5
KNOB_EXTRA_ROUNDS = 6  # more rounds, at most, for alternatives still undecided after KNOB_ROUNDS: the
# race goes on with those and their choices only, and stops once none is (Inception batch 8 here:
# tcmalloc 0.93 [0.765, 1.2] after 5 rounds, 1.25x in the sweep's fresh processes)
KNOB_EXTRA_PLANNED = 0.5  # of the extra rounds, what the trial length is fitted for
ADOPT_CONFIDENCE = 0.9  # the tuner's intervals, and a change is adopted only on one this sure (5+ rounds)
COMPILE_WARMUP_S = 30.0  # what a torch.compile variant's first call is assumed to take (5-20 s measured here)
VARIANT_RACE_S = 1.0  # per process configuration and batch size (at least VARIANT_MIN_ROUNDS rounds):
# 0.3 s (9 rounds) left a 25% gain of mkl-packed at MLP batch 8 unresolved (interval 0.87-1.45) on
# a busy machine
VARIANT_BLOCK_S = 0.01
VARIANT_MIN_ROUNDS = 9
VARIANT_SHARE = 0.35  # of a batch size's time, at most, for its variant races


def model_variants(work, analysis, knobs=DEFAULT_KNOBS, *, min_fraction: float | None = None
                   ) -> tuple[list[tuple[str, str]], list[str]]:
    """((matmul, conv) pairs to search, default first; notes) for a workload.

    A backend is kept only if this torch build has it, the model has enough of the layer kind
    (:func:`relevant_knobs`) and the converted model's output on a batch of 2 equals the
    default's to float32 rounding (checked here, in the tuning process).
    """
    from batchcraft.parallel._worker import check_close

    if not work.traceable or analysis is None:
        return [("default", "default")], []
    rel = relevant_knobs(analysis) if min_fraction is None else relevant_knobs(analysis, min_fraction=min_fraction)
    matmuls = rel["matmul"] if "matmul" in knobs else ("default",)
    convs = rel["conv"] if "conv" in knobs else ("default",)
    pairs, notes = [], []
    x = work.make_batch(2)
    with torch.inference_mode():
        ref = work.call(x)
        for m in matmuls:
            for c in convs:
                if (m, c) == ("default", "default"):
                    pairs.insert(0, (m, c))
                    continue
                try:
                    check_close(invoke(convert(work.model, matmul=m, conv=c), x), ref, f"matmul {m}, conv {c}")
                except (AssertionError, RuntimeError) as exc:
                    notes.append(f"backend variant matmul {m} / conv {c} left out: {str(exc).splitlines()[0]}")
                    continue
                pairs.append((m, c))
    return pairs, notes


def pick_variants(groups, engine, search: list[ParallelConfig], variants, end: float, rnd: int = 0
                  ) -> tuple[list[ParallelConfig], list[dict], list[str]]:
    """Per process configuration of ``search``, race its backend variants inside its instances.

    Args:
        search: grid candidates in every variant (most promising first).
        variants: the (matmul, conv) pairs searched, default first.
        end: clock time by which the races must be done; one that would pass it is not run
            (its process configuration keeps every variant for the search).
    Returns:
        (search with one variant per raced process configuration, order kept; records for the
        report: per process configuration every variant's items/s and its ratio to the default
        with the interval, and the chosen one; notes).
    """
    if len(variants) <= 1:
        return list(search), [], []
    procs: dict[tuple, list[ParallelConfig]] = {}
    for c in search:
        procs.setdefault(c.key(), []).append(c)
    keep: dict[tuple, ParallelConfig] = {}
    records, notes = [], []
    for key, cfgs in procs.items():
        base = cfgs[0].replace(matmul="default", conv="default", compile=False)
        racers = [base] + [c for c in cfgs if c.variant() != base.variant()]
        if len(racers) < 2:
            continue
        cost = sum(engine.cost.warmup(c) for c in racers) + VARIANT_RACE_S + VARIANT_MIN_ROUNDS * sum(
            max(VARIANT_BLOCK_S, engine.cost.call_time(c)) for c in racers) + engine.cost.overhead_s
        if engine.clock() + cost > end:
            notes.append(f"no time to race the backends of {base.short()}: all kept for the search")
            continue
        try:
            results, race = groups.race_variants(racers, VARIANT_RACE_S, engine.cost.warmup_s, VARIANT_BLOCK_S)
        except BatchcraftError as exc:
            notes.append(f"backend race of {base.short()} failed, default kept: {str(exc).splitlines()[0]}")
            keep[key] = base
            continue
        rows, chosen, best_est = [], 0, 1.0
        for j, (c, res) in enumerate(zip(racers, results)):
            engine.cost.learn(c, 0.0, 0.0, res)
            engine.trials.append({"round": rnd, "role": "variants", "repeat": 0, "duration_s": VARIANT_RACE_S,
                                  **res.to_dict()})
            iv = race.ratio(j, 0, confidence=ADOPT_CONFIDENCE) if j else None
            rows.append({"matmul": c.matmul, "conv": c.conv, "throughput_items_per_s": res.throughput_items_per_s,
                         "latency_p50_ms": res.latency_p50_ms, "ratio_to_default": None if iv is None else iv.to_dict()})
            if iv is not None and iv.confidence >= ADOPT_CONFIDENCE and iv.low > 1.0 and iv.estimate > best_est:
                chosen, best_est = j, iv.estimate
        engine.on_trial()
        keep[key] = racers[chosen]
        records.append({"batch_size": base.batch_size, "process": base.short(), "key": repr(key),
                        "label": cfgs[0].label, "rounds": race.rounds, "variants": rows,
                        "chosen": {"matmul": racers[chosen].matmul, "conv": racers[chosen].conv},
                        "near_tie": near_tie(rows, chosen, race)})
    out, placed = [], set()
    for c in search:
        k = c.key()
        if k not in keep:
            out.append(c)  # not raced: every variant stays for the search
            continue
        if k in placed:
            continue
        placed.add(k)
        # the chosen variant takes the place of its process configuration's first candidate; a
        # chosen default that is no candidate (it equals a baseline) is measured as that baseline
        if any(o.variant() == keep[k].variant() for o in procs[k]):
            out.append(keep[k].replace(label=c.label))
    return out, records, notes


def alternatives(cfg: ParallelConfig, knobs=DEFAULT_KNOBS, *, traceable: bool = True,
                 variants=(("default", "default"),)) -> list[ParallelConfig]:
    """The choice with one knob changed at a time (labels name the change).

    Backends: every other searched variant of ``cfg``'s process (its gain or loss against the
    choice, measured side by side); allocators installed here; the two other wait policies where
    a pool has an OpenMP team (more than one intra-op thread: a single thread never waits for a
    team); ``torch.compile`` when asked for, the model is traceable and runs in one pool.
    """
    out = []

    def add(label, **change):
        alt = cfg.replace(label=label, **change)
        if alt.trial_key() != cfg.trial_key() and all(alt.trial_key() != o.trial_key() for o in out):
            out.append(alt)

    for m, c in variants:
        if (m, c) != (cfg.matmul, cfg.conv):
            add(f"matmul {m}, conv {c}", matmul=m, conv=c, compile=False)
    if "allocator" in knobs:
        for a in available_allocators():
            add(f"allocator {a}", allocator=a)
    if "omp_wait_policy" in knobs and team_threads(cfg) > 1:  # one thread per pool: no team waits
        for w in WAIT_POLICIES:
            add(f"omp_wait_policy {w}", omp_wait_policy=w)
    if "compile" in knobs and traceable and cfg.inter_op_threads == 1:
        add("compile", compile=not cfg.compile, matmul="default", conv="default")
    return out


def team_threads(cfg: ParallelConfig) -> int:
    """OpenMP threads in one pool's team (PyTorch's default: every usable core)."""
    if cfg.intra_op_threads is not None:
        return cfg.intra_op_threads
    import os

    return len(os.sched_getaffinity(0))


@dataclass
class KnobRaceResult:
    """What the knob race measured.

    Attributes:
        choice (ParallelConfig): the lead batch size's configuration after the race (an adopted
            change included).
        adopted (str | None): label of the change adopted at the lead batch size, or None.
        by_batch (dict): batch size -> {"adopted": label or None, "choice": config dict after the
            race, "result": its median (the adopted contender's, else the choice's) or None,
            "ratio": the adopted change over the choice (interval dict) or None}; one entry per
            batch size raced.
        rows (list[dict]): per contender: label, config, median result, ratio to its batch size's
            choice before the race (``ratio``: estimate, low, high, confidence, units), role.
        notes (list[str]): contenders and batch sizes left out, rounds cut short.
        rounds (int), trial_s (float): rounds run, trial length.
    """

    choice: ParallelConfig
    adopted: str | None = None
    by_batch: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    rounds: int = 0
    trial_s: float = 0.0

    def to_dict(self) -> dict:
        return {"choice": self.choice.to_dict(), "adopted": self.adopted,
                "by_batch": {str(b): v for b, v in self.by_batch.items()}, "rows": self.rows,
                "notes": self.notes, "rounds": self.rounds, "trial_s": self.trial_s}


@dataclass
class KnobEntry:
    """One batch size's contenders in the knob race: its choice, its best baseline (or None) and
    the choice with one knob changed at a time (:func:`alternatives`)."""

    choice: ParallelConfig
    baseline: ParallelConfig | None
    alts: list

    def contenders(self) -> list[ParallelConfig]:
        base = [] if self.baseline is None or self.baseline.trial_key() == self.choice.trial_key() else [self.baseline]
        return [self.choice, *base, *self.alts]


def fit_entries(entries: list[KnobEntry], engine, time_s: float, rounds: int = KNOB_ROUNDS
                ) -> tuple[list[KnobEntry], list[str]]:
    """The entries whose shortest rounds fit in ``time_s``: the first (the lead batch size) always,
    then the others, cheapest first, while ``rounds`` rounds of shortest trials (KNOB_MIN_CALLS
    calls, KNOB_MIN_TRIAL_S) of everything kept take at most KNOB_FIT of ``time_s`` (the rest
    is for start-ups and longer trials); an alternative not measured yet is costed as its
    choice. Order kept; a note per batch size left out."""
    def cost(e):
        # an alternative not measured yet runs about as fast as its choice (one process-level knob
        # changed): the cost model's fallback, the slowest configuration at that size, would be
        # far too dear
        like = [c if engine.cost.measured(c) else e.choice for c in e.contenders()]
        return rounds * sum(engine.cost.wall(c, engine.cost.floor(c, KNOB_MIN_CALLS, KNOB_MIN_TRIAL_S),
                                             with_warmup=False) for c in like)

    if not entries:
        return [], []
    costs = [cost(e) for e in entries]
    keep, notes, used = {0}, [], costs[0]
    for i in sorted(range(1, len(entries)), key=costs.__getitem__):
        c = costs[i]
        if used + c <= KNOB_FIT * time_s:
            keep.add(i)
            used += c
        else:
            notes.append(f"batch {entries[i].choice.batch_size} left out of the knob race: {rounds} rounds of its "
                         f"{len(entries[i].contenders())} contenders need about {c:.1f} s, "
                         f"{max(0.0, KNOB_FIT * time_s - used):.1f} s were left")
    return [e for i, e in enumerate(entries) if i in keep], notes


def knob_race(groups, engine, budget, objective, entries: list[KnobEntry], *, rounds: int = KNOB_ROUNDS,
              rnd: int = 0, max_trial_s: float = 1.0, extra_rounds: int = KNOB_EXTRA_ROUNDS) -> KnobRaceResult:
    """Race every entry's contenders side by side, in one set of rounds, until the budget's hard end.

    The first entry is the lead (the overall choice's batch size). Processes do not depend on the
    batch size, so a process-level alternative's instances serve every batch size raced: started
    once, at the start. Contenders whose processes are already running start racing at once; the
    others join when ready (until half of the time is gone; later ones are left out with a note),
    so start-ups do not idle the cores. ``rounds`` rounds are run after the last one joined, as
    time allows. A contender whose instances fail or whose values differ is dropped with a note.
    The trial length is fitted so that ``rounds`` rounds of every contender fit in what is left
    (at least KNOB_MIN_TRIAL_S and KNOB_MIN_CALLS calls, at most ``max_trial_s``); trials that
    would pass the hard end are skipped. Each contender's ratio is taken to its own batch size's
    choice, and a change is adopted per batch size.

    Two looks: after ``rounds`` rounds with every contender, the alternatives then undecided
    (interval reaching above 1 without lying wholly above or below it) and their choices race
    ``extra_rounds`` more rounds, as time allows (trial lengths are fitted for
    KNOB_EXTRA_PLANNED of them), and are judged once more on all their rounds. More rounds, not
    longer trials, narrow an interval here: the spread is between rounds (the same contender's
    trials differ by ±20% on a shared VM). Simulated (fake clock, 10% noise): a 1.1x gain is
    adopted in 34 of 40 races instead of 24, a change that does not matter in 8 of 100 instead
    of 2 (adopting it costs nothing); a clearly slower one gets no extra round.
    """
    out = KnobRaceResult(entries[0].choice)
    contenders, owner = [], []
    for e, entry in enumerate(entries):
        for c in entry.contenders():
            contenders.append(c)
            owner.append(e)
    heads = [owner.index(e) for e in range(len(entries))]  # each entry's choice
    groups.spawn_all(contenders)
    start_end = budget.clock() + 0.5 * budget.left(budget.hard_end)
    state = {"length": KNOB_MIN_TRIAL_S}

    def fit_length(racing: list[int], rounds_left: int) -> float:
        """Longest trial length (KNOB_MIN_TRIAL_S..max_trial_s) with which ``rounds_left`` rounds
        of ``racing`` fit in 80% of what is left; a contender's trial is never below its floor."""
        target = 0.8 * budget.left(budget.hard_end) / max(1, rounds_left)
        floors = [engine.cost.floor(contenders[i], KNOB_MIN_CALLS, KNOB_MIN_TRIAL_S) for i in racing]

        def per_round(length):
            return sum(engine.cost.wall(contenders[i], max(length, f), with_warmup=False)
                       for i, f in zip(racing, floors))

        lo, hi = KNOB_MIN_TRIAL_S, max(KNOB_MIN_TRIAL_S, max_trial_s)
        if per_round(hi) <= target:
            return hi
        for _ in range(40):  # per_round grows with the length: bisect
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if per_round(mid) <= target else (lo, mid)
        return lo

    def variant(c):
        def trial():
            n = max(state["length"], engine.cost.floor(c, KNOB_MIN_CALLS, KNOB_MIN_TRIAL_S))
            t0 = budget.clock()
            if t0 + engine.cost.wall(c, n) > budget.hard_end:
                return None
            res = engine.measure(c, n, engine.cost.warmup_s)
            engine.cost.learn(c, n, budget.clock() - t0, res)
            res.config["label"] = c.label
            engine.trials.append({"round": rnd, "role": "knobs", "repeat": race.rounds, "duration_s": n,
                                  **res.to_dict()})
            engine.on_trial()
            return res
        return trial

    race = Race([variant(c) for c in contenders], labels=[c.label for c in contenders], value=objective.value)
    pending, joined, dropped = list(range(len(contenders))), [], set()

    def still_needed(c, i):
        return any(o.key() == c.key() for j, o in enumerate(contenders) if j != i and j not in dropped)

    def join_ready():
        for i in list(pending):
            c = contenders[i]
            try:
                if not groups.is_ready(c):
                    continue
                t0 = budget.clock()
                compiling = c.compile and engine.cost.warmup(c) > 0  # not warm yet: its first call compiles
                if t0 + engine.cost.wall(c, 0.0) + (COMPILE_WARMUP_S if compiling else 0.0) > budget.hard_end:
                    if compiling:
                        pending.remove(i)
                        dropped.add(i)
                        out.notes.append(f"{c.label}: no time left to compile (about {COMPILE_WARMUP_S:.0f} s)")
                    continue
                res = engine.measure(c, 1e-3, engine.cost.warmup_s)  # warm up: packs weights, compiles
                engine.cost.learn(c, 1e-3, budget.clock() - t0, res)
            except BatchcraftError as exc:
                if i == 0:
                    raise
                pending.remove(i)
                dropped.add(i)
                out.notes.append(f"{c.label} (batch {c.batch_size}) left out: {str(exc).splitlines()[0]}")
                if not still_needed(c, i):
                    groups.drop(c)  # its own processes (a process-level knob): not needed any more
                continue
            pending.remove(i)
            joined.append(i)
        return bool(joined)

    def undecided() -> list[int]:
        """Alternatives (and their choices) whose interval reaches above 1 without lying wholly
        above it, over the rounds with every contender."""
        snap = Race.from_samples([col[full_from:] for col in race.samples], value=race.value)
        keep: set = set()
        for e, entry in enumerate(entries):
            head = heads[e]
            if head not in joined or head in dropped:
                continue
            for i in joined:
                if owner[i] != e or i == head or i in dropped or contenders[i] is entry.baseline:
                    continue
                iv = snap.ratio(i, head, pair=objective.ratio, confidence=ADOPT_CONFIDENCE)
                decided = iv.confidence >= ADOPT_CONFIDENCE and (iv.low > 1.0 or iv.high < 1.0)
                if not math.isnan(iv.estimate) and not decided and iv.high > 1.0:
                    keep.update((i, head))
        return sorted(keep)

    since_all, full_from, extended = 0, 0, None  # extended: the undecided, once the first rounds are done
    planned_extra = int(round(KNOB_EXTRA_PLANNED * extra_rounds))
    while since_all < rounds + extra_rounds and budget.left(budget.hard_end) > 0:
        join_ready()
        if pending and budget.clock() > start_end:
            for i in pending:
                out.notes.append(f"not started in time, left out: {contenders[i].label} (batch {contenders[i].batch_size})")
                dropped.add(i)
            for i in pending:
                if not still_needed(contenders[i], i):
                    groups.drop(contenders[i])
            pending.clear()
        if 0 not in joined:
            if not pending:
                break
            time.sleep(0.05)
            continue
        if len(joined) < 2 and pending:
            time.sleep(0.05)  # nothing to compare with yet
            continue
        if not pending and since_all == 0:
            full_from = race.rounds  # from this round on, every contender is in
        active = sorted(joined)
        if since_all >= rounds:  # extra rounds: only what was undecided after the first ones
            if extended is None:
                extended = undecided()
            if not extended:
                break
            active = extended
            state["length"] = fit_length(active, rounds + extra_rounds - since_all)
        else:
            state["length"] = fit_length(sorted(joined) if not pending else list(range(len(contenders))),
                                         rounds - since_all + planned_extra)
        if not race.run_round(active):
            break
        since_all = 0 if pending else since_all + 1
    if since_all:  # summaries from the rounds in which every contender ran: earlier ones overlap start-ups
        race = Race.from_samples([col[full_from:] for col in race.samples], labels=race.labels, value=race.value)
    out.rounds, out.trial_s = race.rounds, state["length"]
    if not race.raw(0) or len(joined) < 2:
        out.notes.append("knob race: nothing was compared with the choice")
        return out
    if since_all < rounds:
        out.notes.append(f"knob race: {since_all} of {rounds} rounds with every contender fitted the budget")
    elif extended:
        out.notes.append(f"knob race: {rounds} rounds with every contender, then {since_all - rounds} more of "
                         f"the alternatives still undecided")
    live = sorted(joined)
    for i in live:
        c, head = contenders[i], heads[owner[i]]
        if not race.raw(i) or not race.raw(head):
            continue
        baseline = entries[owner[i]].baseline
        iv = race.ratio(i, head, pair=objective.ratio, confidence=ADOPT_CONFIDENCE) if i != head else None
        med = objective.median(race.raw(i))
        engine.rounds.append({"round": rnd, "role": "knobs", "repeats": len(race.raw(i)), **med.to_dict()})
        out.rows.append({"label": c.label if i != head else "choice", "config": c.to_dict(), "result": med.to_dict(),
                         "ratio": None if iv is None else iv.to_dict(),
                         "role": "choice" if i == head else ("baseline" if c is baseline else "alternative")})
    best_conf = 0.0
    for e, entry in enumerate(entries):
        head = heads[e]
        if head not in live or not race.raw(head):
            continue
        best_alt, best_est, best_iv = None, 1.0, None
        for i in live:
            c = contenders[i]
            if owner[i] != e or i == head or c is entry.baseline or not race.raw(i):
                continue
            iv = race.ratio(i, head, pair=objective.ratio, confidence=ADOPT_CONFIDENCE)
            best_conf = max(best_conf, iv.confidence)
            if iv.confidence >= ADOPT_CONFIDENCE and iv.low > 1.0 and iv.estimate > best_est and not math.isnan(iv.estimate):
                best_alt, best_est, best_iv = i, iv.estimate, iv
        won = head if best_alt is None else best_alt
        chosen = entry.choice if best_alt is None else contenders[best_alt].replace(label=entry.choice.label)
        out.by_batch[entry.choice.batch_size] = {
            "adopted": None if best_alt is None else contenders[best_alt].label, "choice": chosen.to_dict(),
            "result": objective.median(race.raw(won)).to_dict(), "ratio": None if best_iv is None else best_iv.to_dict()}
        if e == 0 and best_alt is not None:
            out.adopted, out.choice = contenders[best_alt].label, chosen
    if best_conf < ADOPT_CONFIDENCE:
        out.notes.append(f"knob race: its intervals reach {best_conf:.0%}, below the {ADOPT_CONFIDENCE:.0%} "
                         f"needed to adopt a change; nothing adopted")
    return out
