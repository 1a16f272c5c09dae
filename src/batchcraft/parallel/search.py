"""Time-budgeted measured search: :func:`tune`.

:func:`tune` keeps a hard wall-clock budget (:class:`~batchcraft.parallel.budget.Budget`),
start-up included. The graph analysis prunes and orders the candidates (inter-op pools only where
a real share of the FLOPs can overlap; backends only for layer kinds with a real share of the
FLOPs; most promising first), every process-level configuration is started once, at the same
time, and each batch size gets an equal share of what is left, searched by
:class:`~batchcraft.parallel.halving.HalvingSearch`: successive halving over the grid with trials
sized from each configuration's measured per-call time, then a final round where the best few and
**every baseline** are measured side by side (a measurement race: interleaved passes, rotating
start, median; paired ratios give the report's intervals). Where a final round's best two are
within 15%, a *playoff* measures them again with longer trials, and its winner is the choice.
With time set aside, a **knob race** (:mod:`batchcraft.parallel.knobs`) then measures each
batch size's choice with one knob changed at a time (allocator, OpenMP wait policy, optionally
``torch.compile``; at the overall choice's batch size also the other backends, beside the best
baseline), all in one set of interleaved rounds, and adopts per batch size a change whose whole
interval is faster. Two backends near-tied in their race inside one set of processes are then
decided, with the time left, across fresh sets of processes (:mod:`batchcraft.parallel.ties`).
All trials run in worker processes, so the tuning process never changes its own thread settings
(inter-op threads can be set once per process).

What "better" means is one :class:`~batchcraft.parallel.objective.Objective`; the model can be a
registry name, a ``"module:factory"`` path or an object (:mod:`batchcraft.parallel.workload`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field

from batchcraft.errors import ConfigurationError
from batchcraft.parallel.analysis import analyze
from batchcraft.parallel.budget import Budget
from batchcraft.parallel.config import ParallelConfig, usable_cpus
from batchcraft.parallel.grid import candidates
from batchcraft.parallel.groups import Groups
from batchcraft.parallel.halving import PLAYOFF_MARGIN, HalvingSearch
from batchcraft.parallel.knobs import (ADOPT_CONFIDENCE, DEFAULT_KNOBS, KNOB_MAX_S, KNOB_NAMES, KNOB_SHARE,
                                      VARIANT_SHARE, KnobEntry, alternatives, fit_entries, knob_race, model_variants,
                                      pick_variants)
from batchcraft.parallel.objective import Objective
from batchcraft.parallel.threads import preserved_thread_state
from batchcraft.parallel.ties import break_ties, time_needed
from batchcraft.parallel.trial import TrialResult
from batchcraft.parallel.workload import build_workload, model_spec

__all__ = ["TuneResult", "tune", "prepare_model", "check_arguments", "run_search"]

KNOB_MIN_BUDGET_S = 30.0  # below this budget no time is set aside for the knob race
TIE_HOLD_SHARE = 0.5  # of the time left after the search, at most, held back from the knob race for ties


@dataclass
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        best (ParallelConfig): the chosen configuration (over all batch sizes, knobs included).
        best_result (TrialResult): its median in its batch size's final round, in the knob race
            for a knob change adopted there, or in the fresh-process tie-break for a backend
            adopted there; ``best_round`` says which.
        per_batch (list[dict]): per batch size: ``best`` (config + final-round median),
            ``baselines`` (label -> final-round median), ``ratios`` (label -> choice / baseline
            by the objective), ``intervals`` (label -> the ratio's interval from the deciding
            round's paired passes), ``decided_by`` (label -> "final" or "playoff"), ``final``
            (every final-round median, best first), ``final_trial_s``, ``playoff``,
            ``skipped_trials``, ``knobs`` (the knob race at this batch size: ``adopted``,
            ``choice`` (config after it), ``result``, ``ratio``; None if it was not raced),
            ``tie_break`` (the fresh-process tie-break at this batch size, if one ran) and
            ``choice`` (the configuration chosen at this batch size after all of them).
        knobs (dict | None): the knob race (:class:`~batchcraft.parallel.knobs.KnobRaceResult`
            as a dict), None if it did not run.
        variants (list[dict]): the backend races, per batch size and process configuration
            (:func:`~batchcraft.parallel.knobs.pick_variants`); a near tie has ``near_tie``.
        ties (list[dict]): near-tied backends decided across fresh processes
            (:func:`~batchcraft.parallel.ties.break_ties`): per batch size the two backends, the
            per-process ratios (``units``: the other over the chosen), their ``ratio`` interval
            and whether the other was ``adopted`` (then ``best_round`` is "tie-break" there).
        trials (list[dict]): every measurement, in order, with ``round``, ``role`` and ``repeat``.
        rounds (list[dict]): per round and configuration, the median of its repeats.
        start_s (float): seconds until the instances were ready (analysis included).
    """

    model: str
    objective: str
    latency_limit_ms: float | None
    budget_s: float
    elapsed_s: float
    analysis: dict | None
    best: ParallelConfig
    best_result: TrialResult
    per_batch: list[dict] = field(default_factory=list)
    trials: list[dict] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    start_s: float = 0.0
    knobs: dict | None = None
    best_round: str = "final"
    variants: list[dict] = field(default_factory=list)
    ties: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "objective": self.objective,
            "latency_limit_ms": self.latency_limit_ms,
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s,
            "start_s": self.start_s,
            "analysis": self.analysis,
            "best": {**self.best.to_dict(), **{k: v for k, v in self.best_result.to_dict().items()
                                              if k not in ("config", "batch_size")}},
            "best_round": self.best_round,
            "per_batch": self.per_batch,
            "knobs": self.knobs,
            "variants": self.variants,
            "ties": self.ties,
            "trials": self.trials,
            "rounds": self.rounds,
            "notes": self.notes,
        }


def prepare_model(spec, batch_sizes, objective: Objective, cpus, knobs, *, min_fraction: float | None = None):
    """Build the workload here (analysis, backend variants); check the arguments.

    ``min_fraction``: least share of the heavy FLOPs a layer kind needs for its backend knob
    (default: :data:`batchcraft.parallel.backends.KNOB_FLOPS_FRACTION`; 0: any layer of the kind).

    Returns:
        (cpus, analysis, traceable, variants, notes)
    """
    cpus = check_arguments(batch_sizes, knobs, cpus)
    work = build_workload(spec)
    analysis, traceable = None, False
    if work.traceable:
        try:
            x = work.make_batch(1)
            analysis, traceable = analyze(work.model, tuple(x) if isinstance(x, list) else x), True
        except ConfigurationError:
            pass
    variants, notes = model_variants(work, analysis if traceable else None, knobs, min_fraction=min_fraction)
    return cpus, analysis, traceable, variants, notes


def _check_int(name, v, least):
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise ConfigurationError(f"tune: {name} must be an int >= {least}, got {v!r}")


def check_arguments(batch_sizes, knobs, cpus, *, eta: int = 3, repeats: int = 3, final_repeats: int = 5,
                    max_trial_s: float = 0.5) -> list[int]:
    """Check the search's arguments (shared by :func:`tune` and ``tune_program``); return the CPUs.

    Raises:
        ConfigurationError: bad batch sizes, unknown knobs, eta < 2, repeats < 1, max_trial_s <= 0.
    """
    if not batch_sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batch_sizes):
        raise ConfigurationError(f"tune: batch sizes must be ints >= 1, got {batch_sizes!r}")
    unknown = set(knobs) - set(KNOB_NAMES)
    if unknown:
        raise ConfigurationError(f"tune: unknown knobs {sorted(unknown)}; known: {', '.join(KNOB_NAMES)}")
    _check_int("eta", eta, 2)
    _check_int("repeats", repeats, 1)
    _check_int("final_repeats", final_repeats, 1)
    if isinstance(max_trial_s, bool) or not isinstance(max_trial_s, (int, float)) or not max_trial_s > 0:
        raise ConfigurationError(f"tune: max_trial_s must be > 0, got {max_trial_s!r}")
    return usable_cpus() if cpus is None else list(cpus)


def tune(model, *, example_input=None, input_shape=None, batch_sizes=(1, 8, 64), objective: str = "throughput",
         budget_s: float = 120.0, latency_limit_ms: float | None = None, model_kwargs: dict | None = None,
         image_size: int | None = None, cpus: list[int] | None = None, eta: int = 3, repeats: int = 3,
         final_repeats: int = 5, k_final: int = 2, knobs=DEFAULT_KNOBS, max_trial_s: float = 0.5,
         progress: bool = False) -> TuneResult:
    """Find the best parallel configuration for a model within ``budget_s``.

    Args:
        model: a registry name (:func:`batchcraft.models.names`), ``"package.module:factory"``
            (any importable file; the factory returns a model or ``(model, example_input)``), an
            ``nn.Module``, or a factory callable (see :mod:`batchcraft.parallel.workload`).
        example_input (Tensor | tuple | dict, optional): one batch; its first dimension is the
            batch dimension (other batch sizes repeat its rows).
        input_shape (sequence of int, optional): per-item input shape (random float32 inputs).
        batch_sizes (sequence of int): batch sizes to consider. Default: (1, 8, 64).
        objective (str): "throughput" (items/s) or "latency" (see :class:`Objective`).
        budget_s (float): hard wall-clock budget in seconds, from the call to the return: model
            analysis, instance start-up, every trial and shutdown. It can be passed by at most
            about one model call plus the shutdown of the instances. Default: 120.
        latency_limit_ms (float, optional): p90 latency limit for objective "latency".
        model_kwargs (dict, optional), image_size (int, optional): for the model factory / inputs.
        cpus (list[int], optional): CPUs to use. Default: the usable CPUs (affinity mask).
        eta (int): successive-halving factor (>= 2). Default: 3.
        repeats (int): interleaved passes per search round (>= 1). Default: 3.
        final_repeats (int): passes of the final rounds, playoffs and knob race (>= 1); 5 passes
            give ratio intervals of 94%. Default: 5.
        k_final (int): grid candidates that reach the final round beside the baselines. Default: 2.
        knobs (sequence of str): knobs beyond threads to try, of "matmul", "conv", "allocator",
            "omp_wait_policy", "compile". Default: all but "compile" (compiling takes 5-20 s per
            process and batch size here; add it with a budget to match).
        max_trial_s (float): longest trial of a final round (a longer one only for its calls);
            when every trial can be this long, the search ends before the budget. Default: 0.5.
        progress (bool): show a progress bar on stderr. Default: False.
    Returns:
        TuneResult: the choice, per batch size the final round (choice and every baseline measured
        side by side) with ratio intervals, the playoff if there was one, the knob race, every trial.
    Raises:
        ConfigurationError: unknown model or objective, bad batch sizes, budget <= 0, a model that
            cannot be imported or pickled, or a budget too short for any instance to start.
        WorkerError: an instance died.
    Source:
        Search space, width analysis and baselines: Wang et al., arXiv 1908.04705. Successive
        halving: Jamieson & Talwalkar, "Non-stochastic Best Arm Identification and
        Hyperparameter Optimization", AISTATS 2016.
    """
    budget = Budget(budget_s)
    goal = Objective(objective, latency_limit_ms)
    check_arguments(list(batch_sizes), knobs, cpus, eta=eta, repeats=repeats, final_repeats=final_repeats,
                    max_trial_s=max_trial_s)
    tmpdir = tempfile.mkdtemp(prefix="batchcraft-tune-")
    try:
        with preserved_thread_state():
            spec = model_spec(model, example_input=example_input, input_shape=input_shape,
                              model_kwargs=model_kwargs, image_size=image_size, tmpdir=tmpdir)
            cpus, analysis, traceable, variants, notes = prepare_model(spec, list(batch_sizes), goal, cpus, knobs)
            groups = Groups(spec, cpus)
            try:
                result = run_search(groups, budget, spec.name, list(batch_sizes), goal, analysis, traceable, cpus,
                                    eta=eta, repeats=repeats, final_repeats=final_repeats, k_final=k_final,
                                    variants=variants, knobs=tuple(knobs), progress=progress,
                                    engine_options={"max_trial_s": float(max_trial_s)})
            finally:
                groups.close()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    result.notes[:0] = notes
    result.elapsed_s = budget.elapsed()  # the instances' shutdown included
    return result


def run_search(groups, budget: Budget, model: str, batch_sizes: list[int], objective: Objective, analysis,
               traceable: bool, cpus: list[int], *, eta: int = 3, repeats: int = 3, final_repeats: int | None = None,
               k_final: int = 2, variants=(("default", "default"),), knobs=DEFAULT_KNOBS,
               progress: bool = False, engine_options: dict | None = None, alt_variants=None) -> TuneResult:
    """The budgeted part of :func:`tune` on any ``groups`` and clock (tests use fake ones).

    ``engine_options`` go to :class:`HalvingSearch` (trial lengths); ``alt_variants`` are the
    backend variants the knob race tries on the choice (default: the searched ``variants`` for a
    grid choice, none for a baseline).
    """
    from batchcraft.measure.progress import progress_bar

    order = sorted(batch_sizes)  # small first: per-call times at larger sizes are extrapolated
    plans = {b: candidates(analysis, traceable, b, cpus, objective, variants=variants) for b in order}
    first = plans[order[0]]
    late = groups.start_all([*first[1], *first[0]], budget.start_timeout())
    notes = []
    if late:
        if {c.key() for c in late} == {c.key() for c in [*first[0], *first[1]]}:
            raise ConfigurationError(
                f"tune: no instance of {model!r} was ready within {budget.start_limit_s():.1f} s "
                f"({budget.start_limit_s() / budget.budget_s:.0%} of the {budget.budget_s:g} s budget); "
                f"gave up after {budget.elapsed():.1f} s",
                hint="give a larger --budget (starting the instances alone takes a few seconds, more on a busy machine)")
        notes.append("not ready within the start-up share of the budget, left out: "
                     + ", ".join(f"{c.short()} [{c.label}]" for c in late))
    late_keys = {c.key() for c in late}
    start_s = budget.elapsed()
    trials, rounds, per_batch, finals, outcomes, ties = [], [], [], [], {}, []
    bar = progress_bar(desc=f"tune {model}", unit="trial", enabled=progress)
    engine = HalvingSearch(groups.measure, budget.clock, objective, eta=eta, repeats=repeats,
                           final_repeats=final_repeats, k_final=k_final, trials=trials, rounds=rounds,
                           on_trial=lambda: bar.update(1), **(engine_options or {}))
    live = {b: tuple([c for c in cs if c.key() not in late_keys] for cs in plans[b]) for b in order}
    knob_result, variant_records = None, []
    try:
        # One call of one configuration at every batch size: per-call times to share the budget.
        probe = next(iter(live[order[0]][1] or live[order[0]][0]))
        for b in order:
            engine.probe(next(c for c in [*live[b][1], *live[b][0]] if c.key() == probe.key()), budget.hard_end)
        if budget.budget_s >= KNOB_MIN_BUDGET_S and any(k in knobs for k in ("allocator", "omp_wait_policy", "compile",
                                                                             "matmul", "conv")):
            budget.set_aside(min(KNOB_MAX_S * len(order), KNOB_SHARE * budget.budget_s))
        for i, b in enumerate(order):
            search, baselines = live[b]
            floors = [engine.floor_cost(*live[b2]) for b2 in order[i:]]
            window = budget.batch_window(floors, lambda share: engine.playoff_reserve([*search, *baselines], share))
            # backends first: each process configuration races its variants inside its instances
            share = window.deadline - budget.clock()
            search, vrecords, vnotes = pick_variants(groups, engine, search, variants,
                                                     budget.clock() + VARIANT_SHARE * max(0.0, share), _next_round(rounds))
            variant_records += vrecords
            notes += [f"batch {b}: {n}" for n in vnotes]
            out = engine.run(search, baselines, window.deadline - window.reserve, window.slack - window.reserve)
            if out.best is not None and window.reserve and out.gap(objective) < PLAYOFF_MARGIN:
                engine.playoff(out, window.deadline, rnd=_next_round(rounds))
            notes += [f"batch {b}: {n}" for n in out.notes]
            out.notes = []
            if out.best is not None:
                outcomes[b] = out
        # Time left before the knob race (a large budget, or trials capped): the closest decisions first
        for b in sorted(outcomes, key=lambda b: outcomes[b].gap(objective)):
            if outcomes[b].playoff_tried:
                continue
            if outcomes[b].gap(objective) >= PLAYOFF_MARGIN:
                break
            if not engine.playoff(outcomes[b], budget.search_end, rnd=_next_round(rounds)):
                continue
            notes += [f"batch {b}: {n}" for n in outcomes[b].notes]
        for b, out in outcomes.items():
            per_batch.append(per_batch_report(b, out, objective))
            finals.append((out.best, out.best_result, b))
        # a fresh set of processes starts in about its share of the first start-up
        started = {c.key(): c.instances for c in [*first[0], *first[1]] if c.key() not in late_keys}
        fresh_start_s = max(1.0, start_s / max(1, sum(started.values())) * max((c.instances for c, _, _ in finals),
                                                                                  default=1))
        if finals and budget.reserved:
            budget.release()
            # the tie-break's least rounds are held back from the knob race, up to half of what is left
            budget.hold(min(time_needed(finals, variant_records, engine, fresh_start_s),
                            TIE_HOLD_SHARE * budget.left(budget.hard_end)))
            knob_result = _race_knobs(groups, engine, budget, objective, outcomes, finals, knobs, traceable,
                                      alt_variants, rounds=final_repeats or repeats, rnd=_next_round(rounds))
            if knob_result is not None:
                notes += [f"knobs: {n}" for n in knob_result.notes]
        best_round = {b: "final" for _, _, b in finals}
        if knob_result is not None:  # a change adopted at a batch size: measured only in the knob race
            for pb in per_batch:
                kb = knob_result.by_batch.get(pb["batch_size"])
                pb["knobs"] = kb
                if kb is not None and kb["adopted"]:
                    b = pb["batch_size"]
                    finals = [(ParallelConfig.from_dict(kb["choice"]), TrialResult(**kb["result"]), b2)
                              if b2 == b else (c, r, b2) for c, r, b2 in finals]
                    best_round[b] = "knobs"
        budget.unhold()
        if any(v.get("near_tie") for v in variant_records):  # with the time left: across fresh processes
            finals.sort(key=lambda cr: objective.score(cr[1]), reverse=True)
            finals, ties, tnotes = break_ties(groups, engine, budget, finals, variant_records,
                                              rnd=_next_round(rounds), start_s=fresh_start_s)
            notes += tnotes
            for t in ties:
                next(pb for pb in per_batch if pb["batch_size"] == t["batch_size"])["tie_break"] = t
                if t["adopted"]:
                    best_round[t["batch_size"]] = "tie-break"
    finally:
        bar.close()
    if not finals:
        raise ConfigurationError(f"tune: no trial of {model!r} fitted the {budget.budget_s:g} s budget",
                                 hint="give a larger --budget")
    per_batch.sort(key=lambda pb: batch_sizes.index(pb["batch_size"]))
    for c, _, b in finals:
        next(pb for pb in per_batch if pb["batch_size"] == b)["choice"] = c.to_dict()
    best_cfg, best_res, b = max(finals, key=lambda cr: objective.score(cr[1]))
    return TuneResult(model=model, objective=objective.kind, latency_limit_ms=objective.limit,
                      budget_s=budget.budget_s, elapsed_s=budget.elapsed(),
                      analysis=None if analysis is None else analysis.to_dict(), best=best_cfg,
                      best_result=best_res, per_batch=per_batch, trials=trials, rounds=rounds, notes=notes,
                      start_s=start_s, knobs=None if knob_result is None else knob_result.to_dict(),
                      best_round=best_round[b], variants=variant_records, ties=ties)


def _race_knobs(groups, engine, budget: Budget, objective: Objective, outcomes: dict, finals: list, knobs,
                traceable: bool, alt_variants, *, rounds: int, rnd: int):
    """The knob race on every batch size's choice that fits the time set aside, the overall
    choice's batch size first (None when nothing is to be raced).

    Process-level knobs matter most where the search cannot see them: the allocator's gain grows
    with the activations' size, so it is raced at each batch size, not carried over from one.
    The lead batch size also races the other backend variants of its choice (the backend's gain,
    measured side by side) and its best baseline; the others race, in the lead's processes only,
    their process-level changes and the lead's choice with its process-level changes.
    """
    lead_cfg, _, lead_b = max(finals, key=lambda cr: objective.score(cr[1]))
    if alt_variants is None:  # a model's backends were raced per process configuration already
        alt_variants = [("default", "default")]
    entries = []
    for cfg, _, b in sorted(finals, key=lambda cr: cr[2] != lead_b):
        alts = alternatives(cfg, knobs, traceable=traceable, variants=alt_variants if b == lead_b else ())
        if alts:
            entries.append(KnobEntry(cfg, _best_baseline(outcomes[b], objective) if b == lead_b else None, alts))
    if not entries:
        return None
    # Other batch sizes race only in the lead's processes: a new process costs seconds of CPU to
    # start, which disturbs every trial of the race on a small machine (Inception here: six
    # start-ups cut the race to 2 rounds with 7x slower trials). So a batch size whose choice runs
    # in other processes races the lead's choice and its process-level changes at its own batch
    # size instead: the allocator's gain can depend on the process configuration (Inception at
    # batch 64: tcmalloc 1.5x for two 1-thread instances, 1.05x for one 2-thread instance).
    lead = entries[0]
    lead_keys = {c.key() for c in lead.contenders()}
    lead_procs = [lead.choice] + [a for a in lead.alts if a.key() != lead.choice.key()]
    fit_notes = []
    for e in entries[1:]:
        b = e.choice.batch_size
        own = [a for a in e.alts if a.key() in lead_keys]
        if len(own) < len(e.alts):
            fit_notes.append(f"batch {b}: its choice ({e.choice.short()}) runs in other processes than batch "
                             f"{lead.choice.batch_size}'s; raced against that choice's processes at batch {b}")
        carried = []
        for c in lead_procs:
            cc = c.replace(batch_size=b, label=f"batch {lead.choice.batch_size}'s "
                           + ("choice" if c is lead.choice else c.label))
            if cc.trial_key() != e.choice.trial_key() and all(cc.trial_key() != o.trial_key() for o in own + carried):
                carried.append(cc)
        e.alts = own + carried
    entries, more = fit_entries([e for e in entries if e.alts], engine, budget.left(budget.hard_end), rounds)
    fit_notes += more
    result = knob_race(groups, engine, budget, objective, entries, rounds=rounds, rnd=rnd,
                       max_trial_s=2 * engine.max_trial_s)
    result.notes = fit_notes + result.notes
    return result


def _best_baseline(out, objective: Objective):
    ranked = sorted(((c, r) for c, r in out.final if c.label != "grid"), key=lambda cr: objective.score(cr[1]),
                    reverse=True)
    return ranked[0][0] if ranked else None


def _next_round(rounds: list) -> int:
    return 1 + max((r["round"] for r in rounds), default=0)


def per_batch_report(b: int, out, objective: Objective) -> dict:
    """Report of one batch size.

    ``best`` and ``baselines`` are final-round medians. ``ratios``: choice over baseline from the
    round that decided between them: the playoff for a baseline in it (``decided_by``), else the
    final round; ``intervals``: the same ratio's interval from that round's paired passes (within
    one set of processes: process-to-process noise is not in it). Both playoff medians are in
    ``playoff``.
    """
    by_key = {c.trial_key(): r for c, r in out.playoff}
    ratios, decided_by, intervals = {}, {}, {}
    best_key = out.best.trial_key()
    for label, res in out.baselines.items():
        base_cfg = next(c for c, r in out.final if r is res)
        base_key = base_cfg.trial_key()
        if out.playoff and base_key in by_key and base_key != best_key:
            ratios[label] = objective.ratio(by_key[best_key], by_key[base_key])
            decided_by[label] = "playoff"
            race_info = out.playoff_race
        else:
            ratios[label] = objective.ratio(out.best_result, res)
            decided_by[label] = "final"
            race_info = out.final_race
        intervals[label] = _interval(race_info, best_key, base_key, objective)
    return {"batch_size": b, "best": out.best_result.to_dict(),
            "baselines": {k: v.to_dict() for k, v in out.baselines.items()}, "ratios": ratios,
            "intervals": intervals, "decided_by": decided_by,
            "final": [r.to_dict() for _, r in out.final], "final_trial_s": out.final_trial_s,
            "playoff": [r.to_dict() for _, r in out.playoff], "playoff_trial_s": out.playoff_trial_s,
            "skipped_trials": out.skipped_trials}


def _interval(race_info, best_key, base_key, objective: Objective) -> dict | None:
    if race_info is None:
        return None
    configs, race = race_info
    keys = [c.trial_key() for c in configs]
    if best_key not in keys or base_key not in keys:
        return None
    i, j = keys.index(best_key), keys.index(base_key)
    if i == j:
        return None
    return race.ratio(i, j, pair=objective.ratio, confidence=ADOPT_CONFIDENCE).to_dict()
