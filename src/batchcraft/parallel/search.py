"""Time-budgeted measured search over (instances, inter-op pools, intra-op threads, batch size).

:func:`tune` keeps a hard wall-clock budget, start-up included: the graph analysis prunes and
orders the candidates (inter-op pools only where a real share of the FLOPs can overlap; most
promising first), every process-level configuration is started once, at the same time, and each
batch size gets an equal share of what is left, searched by :class:`~batchcraft.parallel.halving.
HalvingSearch`: successive halving over the grid with trials sized from each configuration's
measured per-call time, then a final round where the best few and **every baseline** are measured
side by side (interleaved, median of repeats). The choice is the best of that final round unless
a *playoff* decides: where a final round's best two are within 15%, they are measured again side
by side with longer trials (a close call is where the noise of short trials decides), and the
winner is the choice. Each batch size keeps up to 35% of its time for its playoff; time left at
the end goes to the closest remaining decisions. All
trials run in worker processes (:class:`~batchcraft.parallel.launcher.WorkerGroup`), so the tuning
process never changes its own thread settings (inter-op threads can be set once per process).
:func:`sweep` measures every configuration at every batch size: the reference for benchmarks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from batchcraft.errors import ConfigurationError
from batchcraft.parallel.analysis import GraphAnalysis, analyze
from batchcraft.parallel.baselines import baseline_configs
from batchcraft.parallel.config import ParallelConfig, usable_cpus
from batchcraft.parallel.halving import (PLAYOFF_MARGIN, SPREAD_LIMIT, CostModel, HalvingSearch, median_result,
                                         score)
from batchcraft.parallel.launcher import TrialResult, WorkerGroup
from batchcraft.parallel.threads import preserved_thread_state
from batchcraft.parallel.workload import build_workload

__all__ = ["OBJECTIVES", "TuneResult", "candidate_grid", "prior_speed", "score", "tune", "sweep"]

OBJECTIVES = ("throughput", "latency")
MIN_PARALLEL_FLOPS_FRACTION = 0.1  # below this share of overlappable FLOPs, pools cannot pay (Amdahl)
START_SHARE = 0.6  # instances not ready within this share of the budget are dropped
SHUTDOWN_RESERVE_S = 0.3  # kept back from the budget for stopping the instances


def _powers_of_two_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    if n not in out:
        out.append(n)
    return out


def candidate_grid(analysis: GraphAnalysis | None, batch_size: int, cpus: list[int],
                   *, traceable: bool = True, prune: bool = True) -> list[ParallelConfig]:
    """Configurations with instances x pools x intra-op threads <= len(cpus), pinned.

    Instances and intra-op threads are powers of two (and the core count); pools go up to the
    graph's maximum width (1 if the model is not traceable or has no parallel branches). With
    ``prune``, pools stay 1 also when less than MIN_PARALLEL_FLOPS_FRACTION of the heavy FLOPs can
    overlap (:attr:`GraphAnalysis.parallel_flops_fraction`; unknown FLOPs do not prune).
    """
    n = len(cpus)
    max_pools = 1
    if traceable and analysis is not None:
        max_pools = max(1, min(analysis.max_width, n))
        fraction = analysis.parallel_flops_fraction
        if prune and fraction is not None and fraction < MIN_PARALLEL_FLOPS_FRACTION:
            max_pools = 1
    grid = []
    for instances in _powers_of_two_upto(n):
        for pools in _powers_of_two_upto(max_pools):
            for intra in _powers_of_two_upto(n):
                if instances * pools * intra <= n:
                    grid.append(ParallelConfig(instances, pools, intra, batch_size, label="grid"))
    return grid


def prior_speed(cfg: ParallelConfig, analysis: GraphAnalysis | None, objective: str) -> float:
    """Rough relative speed of ``cfg``, used only to order candidates (larger first).

    Amdahl over the graph: a share f of the work (parallel_flops_fraction) overlaps on
    min(pools, max width) pools, intra-op threads scale as threads^0.8, instances multiply
    throughput but not latency.
    """
    f = (analysis.parallel_flops_fraction or 0.0) if analysis is not None else 0.0
    width = max(1, analysis.max_width) if analysis is not None else 1
    per_call = ((1 - f) + f / min(cfg.inter_op_threads, width)) / (cfg.intra_op_threads or 1) ** 0.8
    return (cfg.instances if objective == "throughput" else 1) / per_call


@dataclass
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        best (ParallelConfig): the chosen configuration (over all batch sizes).
        best_result (TrialResult): its final-round median.
        per_batch (list[dict]): per batch size: ``best`` (config + result), ``baselines``
            (label -> final-round result), ``ratios`` (label -> best / baseline, throughput or
            latency as the objective says), ``final`` (every final-round median, best first),
            ``final_trial_s``, ``skipped_trials``.
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
            "per_batch": self.per_batch,
            "trials": self.trials,
            "rounds": self.rounds,
            "notes": self.notes,
        }


class _Groups:
    """Worker groups by process-level configuration, started together, closed together."""

    def __init__(self, model, model_kwargs, image_size, cpus):
        self.model, self.model_kwargs, self.image_size, self.cpus = model, model_kwargs, image_size, cpus
        self._groups: dict[tuple, WorkerGroup] = {}

    def _new(self, cfg: ParallelConfig) -> WorkerGroup:
        return WorkerGroup(cfg, self.model, model_kwargs=self.model_kwargs, image_size=self.image_size,
                           cpus=self.cpus, oversubscribe=cfg.label != "grid")

    def start_all(self, configs, timeout_s: float = math.inf) -> list[ParallelConfig]:
        """Spawn every configuration's processes at once (start-up overlaps) and wait for them.

        Returns the configurations whose instances were not ready within ``timeout_s`` (their
        processes are stopped). An instance that fails raises WorkerError.
        """
        deadline = time.monotonic() + timeout_s
        try:
            for cfg in configs:
                if cfg.key() not in self._groups:
                    self._groups[cfg.key()] = self._new(cfg).spawn()
            late = [cfg for cfg in configs
                    if not self._groups[cfg.key()].ready(min(3600.0, max(0.0, deadline - time.monotonic())))]
        except BaseException:
            self.close()
            raise
        for cfg in late:
            self._groups.pop(cfg.key()).close()
        return late

    def measure(self, cfg: ParallelConfig, duration_s: float, warmup_s: float = 0.3) -> TrialResult:
        g = self._groups.get(cfg.key())
        if g is None:
            self._groups[cfg.key()] = g = self._new(cfg).start()
        res = g.measure(cfg.batch_size, duration_s, warmup_s=warmup_s)
        res.config["label"] = cfg.label
        return res

    def close(self):
        for g in self._groups.values():
            g.close()
        self._groups.clear()


def _candidates(analysis, traceable, batch_size, cpus, objective="throughput", *, prune=True):
    """(search candidates, most promising first; baselines). Grid points equal to a baseline go."""
    baselines = baseline_configs(analysis, batch_size, cpus, traceable=traceable)
    grid = candidate_grid(analysis, batch_size, cpus, traceable=traceable, prune=prune)
    base_keys = {b.key() for b in baselines}
    search = [c for c in grid if c.key() not in base_keys]
    search.sort(key=lambda c: -prior_speed(c, analysis if traceable else None, objective))
    return search, baselines


def _prepare(model, model_kwargs, image_size, batch_sizes, objective, cpus):
    if objective not in OBJECTIVES:
        raise ConfigurationError(f"tune: objective must be one of {OBJECTIVES}, got {objective!r}")
    if not batch_sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batch_sizes):
        raise ConfigurationError(f"tune: batch sizes must be ints >= 1, got {batch_sizes!r}")
    cpus = usable_cpus() if cpus is None else list(cpus)
    work = build_workload(model, model_kwargs=model_kwargs, image_size=image_size)
    analysis, traceable = None, False
    if work.traceable:
        try:
            analysis, traceable = analyze(work.model, work.make_batch(1)), True
        except ConfigurationError:
            pass
    return cpus, analysis, traceable


def _check_args(budget_s, eta, repeats, objective, latency_limit_ms):
    if not isinstance(budget_s, (int, float)) or not budget_s > 0:
        raise ConfigurationError(f"tune: budget_s must be > 0, got {budget_s!r}")
    if not isinstance(eta, int) or eta < 2:
        raise ConfigurationError(f"tune: eta must be an int >= 2, got {eta!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ConfigurationError(f"tune: repeats must be an int >= 1, got {repeats!r}")
    if latency_limit_ms is not None and (objective != "latency" or latency_limit_ms <= 0):
        raise ConfigurationError(
            f"tune: latency_limit_ms={latency_limit_ms!r} needs objective='latency' and a value > 0 "
            f"(objective is {objective!r})", hint="pass --objective latency with --latency-limit-ms")


def tune(model: str, *, batch_sizes=(1, 8, 64), objective: str = "throughput", budget_s: float = 120.0,
         latency_limit_ms: float | None = None, model_kwargs: dict | None = None,
         image_size: int | None = None, cpus: list[int] | None = None, eta: int = 3,
         repeats: int = 3, k_final: int = 2, progress: bool = False) -> TuneResult:
    """Find the best parallel configuration for registry model ``model`` within ``budget_s``.

    Args:
        model (str): registry name (:func:`batchcraft.models.names`).
        batch_sizes (sequence of int): batch sizes to consider. Default: (1, 8, 64).
        objective (str): "throughput" (items/s) or "latency" (see :func:`score`).
        budget_s (float): hard wall-clock budget in seconds, from the call to the return: model
            analysis, instance start-up, every trial and shutdown. It can be passed by at most
            about one model call plus the shutdown of the instances. Default: 120.
        latency_limit_ms (float, optional): p90 latency limit for objective "latency".
        model_kwargs (dict, optional), image_size (int, optional): see WorkerGroup.
        cpus (list[int], optional): CPUs to use. Default: the usable CPUs (affinity mask).
        eta (int): successive-halving factor (>= 2). Default: 3.
        repeats (int): interleaved passes per round; each configuration keeps its median (>= 1).
            Default: 3.
        k_final (int): grid candidates that reach the final round beside the baselines. Default: 2.
        progress (bool): show a tqdm progress bar on stderr. Default: False.
    Returns:
        TuneResult: the choice, per batch size the final round (choice and every baseline measured
        side by side), the playoff if there was one, ratios (from the playoff for the baseline
        in it, else from the final round), every trial.
    Raises:
        ConfigurationError: unknown model or objective, bad batch sizes, budget <= 0, or a budget
            too short for any instance to start.
        WorkerError: an instance died.
    Source:
        Search space, width analysis and baselines: Wang et al., arXiv 1908.04705. Successive
        halving: Jamieson & Talwalkar, "Non-stochastic Best Arm Identification and
        Hyperparameter Optimization", AISTATS 2016.
    """
    clock = time.monotonic
    t_start = clock()
    _check_args(budget_s, eta, repeats, objective, latency_limit_ms)
    with preserved_thread_state():
        cpus, analysis, traceable = _prepare(model, model_kwargs, image_size, batch_sizes, objective, cpus)
        groups = _Groups(model, model_kwargs, image_size, cpus)
        try:
            result = _tune(groups, clock, t_start, model, list(batch_sizes), objective, budget_s,
                           latency_limit_ms, analysis, traceable, cpus, eta=eta, repeats=repeats,
                           k_final=k_final, progress=progress)
        finally:
            groups.close()
    result.elapsed_s = clock() - t_start  # the instances' shutdown included
    return result


def _tune(groups, clock, t_start, model, batch_sizes, objective, budget_s, limit, analysis, traceable,
          cpus, *, eta, repeats, k_final, progress) -> TuneResult:
    """The budgeted part of :func:`tune` on any ``groups`` and ``clock`` (tests use fake ones)."""
    from batchcraft.measure.progress import progress_bar

    hard_end = t_start + budget_s - SHUTDOWN_RESERVE_S
    order = sorted(batch_sizes)  # small first: per-call times at larger sizes are extrapolated
    plans = {b: _candidates(analysis, traceable, b, cpus, objective) for b in order}
    first = plans[order[0]]
    late = groups.start_all([*first[1], *first[0]], max(0.0, t_start + START_SHARE * budget_s - clock()))
    notes = []
    if late:
        if len(late) == len(first[0]) + len(first[1]):
            raise ConfigurationError(
                f"tune: no instance of {model!r} was ready within {START_SHARE * budget_s:.1f} s "
                f"({START_SHARE:.0%} of the {budget_s:g} s budget); gave up after {clock() - t_start:.1f} s",
                hint="give a larger --budget (starting the instances alone takes a few seconds)")
        notes.append(f"not ready within {START_SHARE:.0%} of the budget, left out: "
                     + ", ".join(f"{c.short()} [{c.label}]" for c in late))
    late_keys = {c.key() for c in late}
    start_s = clock() - t_start
    trials, rounds, per_batch, finals, outcomes = [], [], [], [], {}
    bar = progress_bar(desc=f"tune {model}", unit="trial", enabled=progress)
    engine = HalvingSearch(groups.measure, clock, objective, limit, eta=eta, repeats=repeats, k_final=k_final,
                           trials=trials, rounds=rounds, on_trial=lambda: bar.update(1))
    live = {b: tuple([c for c in cs if c.key() not in late_keys] for cs in plans[b]) for b in order}
    try:
        # One call of one configuration at every batch size: per-call times to share the budget.
        probe = next(iter(live[order[0]][1] or live[order[0]][0]))
        for b in order:
            engine.probe(next(c for c in [*live[b][1], *live[b][0]] if c.key() == probe.key()), hard_end)
        for i, b in enumerate(order):
            search, baselines = live[b]
            # Each batch size gets the time of its shortest plan (trials of min_calls calls) and an
            # equal part of the rest. If the shortest plans do not all fit, the smaller batch sizes
            # (cheaper, and measured first) get theirs: a few batch sizes measured properly beat
            # every batch size measured with too few trials.
            floors = [engine.floor_cost(*live[b2]) for b2 in order[i:]]
            left = hard_end - clock()
            share = (floors[0] + (left - sum(floors)) / len(floors) if sum(floors) <= left
                     else min(floors[0], left))
            deadline = clock() + share
            # part of the share is kept for a playoff of the final round's best two (used by the
            # next batch sizes when the final round is clear)
            # only when every batch size's shortest plan fits and this one keeps its own
            reserve = engine.playoff_reserve([*search, *baselines], share)
            if sum(floors) > left or share - reserve < floors[0]:
                reserve = 0.0
            slack = min(hard_end, deadline + 0.25 * max(0.0, share))
            out = engine.run(search, baselines, deadline - reserve, slack - reserve)
            if out.best is not None and reserve and out.gap(objective, limit) < PLAYOFF_MARGIN:
                engine.playoff(out, deadline, rnd=_next_round(rounds))
            notes += [f"batch {b}: {n}" for n in out.notes]
            out.notes = []
            if out.best is not None:
                outcomes[b] = out
        # Time left (a large budget, or trials capped at max_trial_s): the closest decisions first
        for b in sorted(outcomes, key=lambda b: outcomes[b].gap(objective, limit)):
            if outcomes[b].playoff_tried:
                continue
            if outcomes[b].gap(objective, limit) >= PLAYOFF_MARGIN:
                break
            if not engine.playoff(outcomes[b], hard_end, rnd=_next_round(rounds)):
                continue
            notes += [f"batch {b}: {n}" for n in outcomes[b].notes]
        for b, out in outcomes.items():
            per_batch.append(_per_batch(b, out, objective, limit))
            finals.append((out.best, out.best_result))
    finally:
        bar.close()
    if not finals:
        raise ConfigurationError(f"tune: no trial of {model!r} fitted the {budget_s:g} s budget",
                                 hint="give a larger --budget")
    per_batch.sort(key=lambda pb: batch_sizes.index(pb["batch_size"]))
    best_cfg, best_res = max(finals, key=lambda cr: score(cr[1], objective, limit))
    return TuneResult(model=model, objective=objective, latency_limit_ms=limit, budget_s=budget_s,
                      elapsed_s=clock() - t_start, analysis=None if analysis is None else analysis.to_dict(),
                      best=best_cfg, best_result=best_res, per_batch=per_batch, trials=trials,
                      rounds=rounds, notes=notes, start_s=start_s)


def _next_round(rounds: list) -> int:
    return 1 + max((r["round"] for r in rounds), default=0)


def _per_batch(b: int, out, objective: str, limit=None) -> dict:
    """Report of one batch size.

    ``best`` and ``baselines`` are final-round medians. ``ratios``: choice over baseline from the
    round that decided between them: the playoff for a baseline in it (``decided_by``), else the
    final round. Both playoff medians are in ``playoff``.
    """
    by_key = {c.key(): r for c, r in out.playoff}
    ratios, decided_by = {}, {}
    for label, res in out.baselines.items():
        base_key = next(c.key() for c, r in out.final if r is res)
        if out.playoff and base_key in by_key and base_key != out.best.key():
            ratios[label] = _ratio(by_key[out.best.key()], by_key[base_key], objective, limit)
            decided_by[label] = "playoff"
        else:
            ratios[label] = _ratio(out.best_result, res, objective, limit)
            decided_by[label] = "final"
    return {"batch_size": b, "best": out.best_result.to_dict(),
            "baselines": {k: v.to_dict() for k, v in out.baselines.items()}, "ratios": ratios,
            "decided_by": decided_by,
            "final": [r.to_dict() for _, r in out.final], "final_trial_s": out.final_trial_s,
            "playoff": [r.to_dict() for _, r in out.playoff], "playoff_trial_s": out.playoff_trial_s,
            "skipped_trials": out.skipped_trials}


def _ratio(best: TrialResult, base: TrialResult, objective: str, limit: float | None = None) -> float:
    """How much better ``best`` is than ``base`` under :func:`score` (>= 1 when it ranks higher).

    throughput: items/s ratio. latency with a p90 limit: the items/s ratio when both meet the
    limit, else base p90 / best p90. latency without a limit: base p50 / best p50.
    """
    if objective == "throughput":
        return best.throughput_items_per_s / base.throughput_items_per_s
    if limit is not None:
        if best.latency_p90_ms <= limit and base.latency_p90_ms <= limit:
            return best.throughput_items_per_s / base.throughput_items_per_s
        return base.latency_p90_ms / best.latency_p90_ms
    return base.latency_p50_ms / best.latency_p50_ms  # > 1: the choice is faster per call


def _spread(runs: dict) -> float:
    thr = [[r.throughput_items_per_s for r in rs] for rs in runs.values() if rs]
    return max((max(t) / min(t) for t in thr if min(t) > 0), default=1.0)


def sweep(model: str, *, batch_sizes=(1, 8, 64), duration_s: float = 3.0, repeats: int = 3,
          min_calls: int = 5, warmup_s: float = 0.3, model_kwargs: dict | None = None,
          image_size: int | None = None, cpus: list[int] | None = None) -> list[TrialResult]:
    """Measure every configuration (the unpruned grid and the baselines) at every batch size.

    The tuner's reference. Per batch size, ``repeats`` interleaved passes over all configurations
    (up to twice as many while some configuration's repeats are more than SPREAD_LIMIT apart);
    each trial lasts duration_s / repeats seconds and at least ``min_calls`` calls (per-call time
    from the configuration's warm-up or previous trial); each configuration keeps its median by
    throughput. Returns one TrialResult per (configuration, batch size); ``config["label"]``
    names baselines.
    """
    with preserved_thread_state():
        cpus, analysis, traceable = _prepare(model, model_kwargs, image_size, batch_sizes, "throughput", cpus)
        groups = _Groups(model, model_kwargs, image_size, cpus)
        cost = CostModel(warmup_s)
        out = []
        try:
            search, base = _candidates(analysis, traceable, batch_sizes[0], cpus, prune=False)
            groups.start_all(base + search)
            for b in batch_sizes:
                search, base = _candidates(analysis, traceable, b, cpus, prune=False)
                runs = {id(c): [] for c in base + search}
                rep = 0
                while rep < repeats or (rep < 2 * repeats and _spread(runs) > SPREAD_LIMIT):
                    rep += 1  # a disturbed configuration (repeats far apart): more passes, as in tune
                    for c in base + search:
                        if (c.key(), b) not in cost.call_s:  # warm up and learn the per-call time
                            cost.learn(c, 0.0, 0.0, groups.measure(c, 1e-3, warmup_s))
                        length = max(duration_s / repeats, cost.floor(c, min_calls, 0.0))
                        res = groups.measure(c, length, warmup_s)
                        cost.learn(c, length, 0.0, res)
                        runs[id(c)].append(res)
                out += [median_result(runs[id(c)], "throughput") for c in base + search]
        finally:
            groups.close()
    return out


def head_to_head(model: str, configs: list[ParallelConfig], *, rounds: int = 7, duration_s: float = 1.0,
                 min_calls: int = 5, warmup_s: float = 0.3, model_kwargs: dict | None = None,
                 image_size: int | None = None, cpus: list[int] | None = None) -> list[TrialResult]:
    """Re-measure a few configurations side by side: ``rounds`` interleaved trials each.

    The best of an exhaustive sweep is the maximum of many noisy estimates, so its measured
    throughput is biased upwards (the winner's curse); comparing another configuration with it
    on the sweep's own numbers overstates the gap. This measures the given configurations again,
    in rounds whose starting configuration rotates, each trial ``duration_s`` seconds and at
    least ``min_calls`` calls, and returns each configuration's median trial (by throughput),
    in the order given. Configurations may have different batch sizes.

    Raises:
        ConfigurationError: no configurations, or ``rounds`` < 1.
    """
    if not configs:
        raise ConfigurationError("head_to_head: no configurations to compare")
    if not isinstance(rounds, int) or rounds < 1:
        raise ConfigurationError(f"head_to_head: rounds must be an int >= 1, got {rounds!r}")
    with preserved_thread_state():
        cpus = usable_cpus() if cpus is None else list(cpus)
        groups = _Groups(model, model_kwargs, image_size, cpus)
        cost = CostModel(warmup_s)
        runs: list[list[TrialResult]] = [[] for _ in configs]
        try:
            groups.start_all(configs)
            for c in configs:  # warm up and learn each per-call time
                cost.learn(c, 0.0, 0.0, groups.measure(c, 1e-3, warmup_s))
            for r in range(rounds):
                for j in range(len(configs)):
                    k = (r + j) % len(configs)  # rotate who goes first: no order effect
                    c = configs[k]
                    length = max(duration_s, cost.floor(c, min_calls, 0.0))
                    res = groups.measure(c, length, warmup_s)
                    cost.learn(c, length, 0.0, res)
                    runs[k].append(res)
        finally:
            groups.close()
    return [median_result(rs, "throughput") for rs in runs]
