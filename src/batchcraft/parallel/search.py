"""Time-budgeted measured search over (instances, inter-op pools, intra-op threads, batch size).

Per batch size, every candidate configuration (the grid that fits the usable cores, plus the four
baselines of :mod:`batchcraft.parallel.baselines`) is measured briefly; the better 1/eta are
measured again eta times longer, and so on until one is left (successive halving; Jamieson &
Talwalkar, AISTATS 2016). The winner and every baseline are then measured at that final length,
so the choice is never a baseline measured worse than itself, and the ratios compare like with
like. All trials run in worker processes (:class:`~batchcraft.parallel.launcher.WorkerGroup`), so
the tuning process never changes its own thread settings, and each process-level configuration
is started once and reused across batch sizes and rounds.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

from batchcraft.errors import ConfigurationError
from batchcraft.parallel.analysis import GraphAnalysis, analyze
from batchcraft.parallel.baselines import BASELINES, baseline_configs
from batchcraft.parallel.config import ParallelConfig, usable_cpus
from batchcraft.parallel.launcher import TrialResult, WorkerGroup
from batchcraft.parallel.threads import preserved_thread_state
from batchcraft.parallel.workload import build_workload

__all__ = ["OBJECTIVES", "TuneResult", "candidate_grid", "score", "tune", "sweep"]

OBJECTIVES = ("throughput", "latency")


def _powers_of_two_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    if n not in out:
        out.append(n)
    return out


def candidate_grid(analysis: GraphAnalysis | None, batch_size: int, cpus: list[int],
                   *, traceable: bool = True) -> list[ParallelConfig]:
    """Configurations with instances x pools x intra-op threads <= len(cpus), pinned.

    Instances and intra-op threads are powers of two (and the core count); pools go up to the
    graph's maximum width (1 if the model is not traceable or has no parallel branches).
    """
    n = len(cpus)
    max_pools = 1
    if traceable and analysis is not None:
        max_pools = max(1, min(analysis.max_width, n))
    grid = []
    for instances in _powers_of_two_upto(n):
        for pools in _powers_of_two_upto(max_pools):
            for intra in _powers_of_two_upto(n):
                if instances * pools * intra <= n:
                    grid.append(ParallelConfig(instances, pools, intra, batch_size, label="grid"))
    return grid


def score(result: TrialResult, objective: str, latency_limit_ms: float | None = None) -> tuple:
    """Sort key, larger is better.

    throughput: items/s. latency: with a limit, configurations whose p90 latency meets it ranked by
    throughput, then the others by p90 latency; without a limit, the lowest median latency.
    """
    if objective == "throughput":
        return (result.throughput_items_per_s,)
    if latency_limit_ms is not None:
        if result.latency_p90_ms <= latency_limit_ms:
            return (1, result.throughput_items_per_s)
        return (0, -result.latency_p90_ms)
    return (-result.latency_p50_ms,)


@dataclass
class TuneResult:
    """What :func:`tune` found.

    Attributes:
        best (ParallelConfig): the chosen configuration (over all batch sizes).
        best_result (TrialResult): its final measurement.
        per_batch (list[dict]): per batch size: ``best`` (config + result), ``baselines``
            (label -> result), ``ratios`` (label -> best score / baseline score, throughput or
            latency as the objective says).
        trials (list[dict]): every measurement, in order, with ``round``, ``role`` and ``repeat``.
        rounds (list[dict]): per round and configuration, the median of its repeats.
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

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "objective": self.objective,
            "latency_limit_ms": self.latency_limit_ms,
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s,
            "analysis": self.analysis,
            "best": {**self.best.to_dict(), **{k: v for k, v in self.best_result.to_dict().items()
                                              if k not in ("config", "batch_size")}},
            "per_batch": self.per_batch,
            "trials": self.trials,
            "rounds": self.rounds,
            "notes": self.notes,
        }


class _Groups:
    """Worker groups by process-level configuration, started on first use, closed together."""

    def __init__(self, model, model_kwargs, image_size, cpus):
        self.model, self.model_kwargs, self.image_size, self.cpus = model, model_kwargs, image_size, cpus
        self._groups: dict[tuple, WorkerGroup] = {}

    def _new(self, cfg: ParallelConfig) -> WorkerGroup:
        return WorkerGroup(cfg, self.model, model_kwargs=self.model_kwargs, image_size=self.image_size,
                           cpus=self.cpus, oversubscribe=cfg.label != "grid")

    def start_all(self, configs) -> None:
        """Start every configuration's processes at once (start-up overlaps), then wait for all."""
        new = []
        for cfg in configs:
            if cfg.key() not in self._groups:
                self._groups[cfg.key()] = g = self._new(cfg).spawn()
                new.append(g)
        for g in new:
            g.wait_ready()

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


def _candidates(analysis, traceable, batch_size, cpus) -> tuple[list[ParallelConfig], list[ParallelConfig]]:
    baselines = baseline_configs(analysis, batch_size, cpus, traceable=traceable)
    grid = candidate_grid(analysis, batch_size, cpus, traceable=traceable)
    base_keys = {b.key() for b in baselines}
    return [c for c in grid if c.key() not in base_keys] + baselines, baselines


def _prepare(model, model_kwargs, image_size, batch_sizes, objective, cpus):
    if objective not in OBJECTIVES:
        raise ConfigurationError(f"tune: objective must be one of {OBJECTIVES}, got {objective!r}")
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
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


def tune(model: str, *, batch_sizes=(1, 8, 64), objective: str = "throughput", budget_s: float = 120.0,
         latency_limit_ms: float | None = None, model_kwargs: dict | None = None,
         image_size: int | None = None, cpus: list[int] | None = None, eta: int = 2,
         repeats: int = 3, compare_baselines: bool = True, progress: bool = False) -> TuneResult:
    """Find the best parallel configuration for registry model ``model`` within ``budget_s``.

    Args:
        model (str): registry name (:func:`batchcraft.models.names`).
        batch_sizes (sequence of int): batch sizes to consider. Default: (1, 8, 64).
        objective (str): "throughput" (items/s) or "latency" (see :func:`score`).
        budget_s (float): wall-clock budget in seconds, process start-up included; the trial
            length is derived from it. Default: 120.
        latency_limit_ms (float, optional): p90 latency limit for objective "latency".
        model_kwargs (dict, optional), image_size (int, optional): see WorkerGroup.
        cpus (list[int], optional): CPUs to use. Default: the usable CPUs (affinity mask).
        eta (int): successive-halving factor (>= 2). Default: 2.
        repeats (int): interleaved passes per round; each configuration keeps its median (>= 1).
            Default: 3.
        compare_baselines (bool): measure every baseline again in the final round, beside the
            choice, for like-with-like ratios (and replace the choice if a baseline beats it there).
            False: only the choice is measured at the final length; per_batch has no baselines.
            Default: True.
        progress (bool): show a tqdm progress bar on stderr. Default: False.
    Returns:
        TuneResult: best configuration, per-batch-size baselines and ratios, every trial.
    Raises:
        ConfigurationError: unknown model or objective, bad batch sizes, budget <= 0.
        WorkerError: an instance died.
    Source:
        Search space and baselines: Wang et al., arXiv 1908.04705. Successive halving: Jamieson &
        Talwalkar, "Non-stochastic Best Arm Identification and Hyperparameter Optimization", 2016.
    """
    from tqdm import tqdm

    t_start = time.monotonic()
    if budget_s <= 0:
        raise ConfigurationError(f"tune: budget_s must be > 0, got {budget_s!r}")
    if not isinstance(eta, int) or eta < 2:
        raise ConfigurationError(f"tune: eta must be an int >= 2, got {eta!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ConfigurationError(f"tune: repeats must be an int >= 1, got {repeats!r}")
    if latency_limit_ms is not None and (objective != "latency" or latency_limit_ms <= 0):
        raise ConfigurationError(
            f"tune: latency_limit_ms={latency_limit_ms!r} needs objective='latency' and a value > 0 "
            f"(objective is {objective!r})", hint="pass --objective latency with --latency-limit-ms")
    with preserved_thread_state():
        cpus, analysis, traceable = _prepare(model, model_kwargs, image_size, batch_sizes, objective, cpus)
        plans = [_candidates(analysis, traceable, b, cpus) for b in batch_sizes]
        groups = _Groups(model, model_kwargs, image_size, cpus)
        try:
            groups.start_all(plans[0][0])
        except BaseException:
            groups.close()
            raise
        notes = []
        trials, rounds, per_batch, finals = [], [], [], []
        bar = tqdm(desc=f"tune {model}", unit="trial", file=sys.stderr,
                   disable=not progress, leave=False)
        try:
            for i, ((cands, baselines), b) in enumerate(zip(plans, batch_sizes)):
                now = time.monotonic()
                clock = _Clock(now + (t_start + budget_s - now) / (len(batch_sizes) - i), eta, repeats,
                               len(BASELINES) if compare_baselines else 0)
                best_cfg, best_res, base_res, d = _halving(
                    cands, baselines, clock, groups, objective, latency_limit_ms, trials, rounds, bar,
                    compare_baselines=compare_baselines)
                if clock.shortest_s <= 0.05:
                    notes.append(f"batch {b}: the budget left trials of {clock.shortest_s:.3f} s, the minimum (noisy); "
                                 f"give a larger --budget")
                ratios = {}
                for label, r in base_res.items():
                    ratios[label] = _ratio(best_res, r, objective)
                per_batch.append({"batch_size": b, "best": best_res.to_dict(),
                                  "baselines": {k: v.to_dict() for k, v in base_res.items()},
                                  "ratios": ratios, "final_trial_s": d})
                finals.append((best_cfg, best_res))
        finally:
            bar.close()
            groups.close()
    best_cfg, best_res = max(finals, key=lambda cr: score(cr[1], objective, latency_limit_ms))
    if time.monotonic() - t_start > budget_s * 1.1:
        notes.append(f"took {time.monotonic() - t_start:.0f} s, over the {budget_s:.0f} s budget")
    return TuneResult(model=model, objective=objective, latency_limit_ms=latency_limit_ms,
                      budget_s=budget_s, elapsed_s=time.monotonic() - t_start,
                      analysis=None if analysis is None else analysis.to_dict(),
                      best=best_cfg, best_result=best_res, per_batch=per_batch, trials=trials,
                      rounds=rounds, notes=notes)


def _ratio(best: TrialResult, base: TrialResult, objective: str) -> float:
    if objective == "throughput":
        return best.throughput_items_per_s / base.throughput_items_per_s
    return base.latency_p50_ms / best.latency_p50_ms  # > 1: the choice is faster per call


PRUNE_FACTOR = 4.0  # see _halving: candidates this many times worse skip a round's other repeats


def _throughput_like(result: TrialResult, objective: str, limit) -> float:
    """A positive "higher is better" number for pruning: items/s, or 1 / latency."""
    if objective == "throughput" or (limit is not None and result.latency_p90_ms <= limit):
        return result.throughput_items_per_s
    if limit is not None:
        return 0.0
    return 1.0 / max(result.latency_p50_ms, 1e-9)


def _median_result(results: list[TrialResult], objective: str, limit) -> TrialResult:
    ranked = sorted(results, key=lambda r: score(r, objective, limit))
    return ranked[len(ranked) // 2]


class _Clock:
    """Fits trial lengths into what is left of a deadline, learning the per-trial overhead.

    The overhead (warm-up, synchronisation, the last call running past the end) is learned as a
    moving average; trial lengths only shrink below the successive-halving plan when the plan
    would overrun the deadline.
    """

    def __init__(self, deadline: float, eta: int, repeats: int, n_final_baselines: int):
        self.deadline, self.eta, self.repeats, self.n_base = deadline, eta, repeats, n_final_baselines
        self.overhead_s = 0.15
        self.shortest_s = math.inf

    def fit(self, planned_s: float, alive: int) -> float:
        """Round length (all repeats together) for ``alive`` configurations, at most ``planned_s``."""
        levels = [alive]
        while levels[-1] > 1:
            levels.append(math.ceil(levels[-1] / self.eta))
        last = len(levels) - 1
        units = sum(n * self.eta ** k for k, n in enumerate(levels)) + self.n_base * self.eta ** last
        n_trials = (sum(levels) + self.n_base) * self.repeats
        left = self.deadline - time.monotonic() - self.overhead_s * n_trials
        # below ~50 ms per repeat, thread wake-up after idle biases against multi-thread configurations
        d = max(0.05 * self.repeats, min(planned_s, left / units))
        self.shortest_s = min(self.shortest_s, d / self.repeats)
        return d

    def record(self, wall_s: float, duration_s: float) -> None:
        self.overhead_s = 0.7 * self.overhead_s + 0.3 * max(0.0, wall_s - duration_s)


def _halving(cands, baselines, clock, groups, objective, limit, trials, rounds, bar, *, compare_baselines):
    """Successive halving over ``cands``, then the winner and the baselines at the final length.

    Each round measures its configurations ``repeats`` times in interleaved passes of d / repeats
    seconds and keeps each one's median, so that load changing over time (other processes on a
    shared machine) hits all of them alike. Round lengths grow eta-fold while ``clock`` allows.
    """
    repeats = clock.repeats

    def measure_round(configs, d, rnd, role):
        runs = {id(c): [] for c in configs}
        active = list(configs)
        for rep in range(repeats):
            if rep and role == "search":
                # A search candidate already PRUNE_FACTOR x worse than the round's best after a
                # repeat cannot win the round: spare it the other repeats (their calls can be
                # seconds long on an oversubscribed machine).
                best = max(_throughput_like(runs[id(c)][-1], objective, limit) for c in active)
                active = [c for c in active
                          if _throughput_like(runs[id(c)][-1], objective, limit) * PRUNE_FACTOR >= best]
            for c in active:
                t0 = time.monotonic()
                res = groups.measure(c, d / repeats)
                clock.record(time.monotonic() - t0, d / repeats)
                runs[id(c)].append(res)
                trials.append({"round": rnd, "role": role, "repeat": rep, "duration_s": d / repeats,
                               **res.to_dict()})
            bar.update(len(active))
        medians = [(c, _median_result(runs[id(c)], objective, limit)) for c in configs]
        rounds.extend({"round": rnd, "role": role, "repeats": len(runs[id(c)]), **r.to_dict()} for c, r in medians)
        return medians

    alive, rnd = list(cands), 0
    d = clock.fit(math.inf, len(alive))
    while True:
        measured = sorted(measure_round(alive, d, rnd, "search"),
                          key=lambda cr: score(cr[1], objective, limit), reverse=True)
        if len(measured) == 1:
            break
        alive = [c for c, _ in measured[:max(1, math.ceil(len(measured) / clock.eta))]]
        rnd += 1
        d = clock.fit(d * clock.eta, len(alive))
        if len(alive) == 1:
            break
    winner = measured[0][0]
    if not compare_baselines:
        baselines = [b for b in baselines if b.key() == winner.key()]
    final = [winner] + [b for b in baselines if b.key() != winner.key()]
    final_res = dict((c.key(), r) for c, r in measure_round(final, d, rnd, "final"))
    base_res = {b.label: final_res[b.key()] for b in baselines}
    winner_res = final_res[winner.key()]
    # Never keep a choice that a baseline beat in the same final round.
    top = max(baselines, key=lambda b: score(base_res[b.label], objective, limit), default=None)
    if top is not None and score(base_res[top.label], objective, limit) > score(winner_res, objective, limit):
        winner, winner_res = top, base_res[top.label]
    return winner, winner_res, base_res, d / repeats


def sweep(model: str, *, batch_sizes=(1, 8, 64), duration_s: float = 1.0, repeats: int = 3,
          model_kwargs: dict | None = None, image_size: int | None = None,
          cpus: list[int] | None = None) -> list[TrialResult]:
    """Measure every candidate (grid and baselines) at every batch size; the tuner's reference.

    Each configuration gets ``repeats`` interleaved measurements of duration_s / repeats seconds
    (as in a tuning round) and keeps the median by throughput. Returns one TrialResult per
    (configuration, batch size); ``config["label"]`` names baselines.
    """
    with preserved_thread_state():
        cpus, analysis, traceable = _prepare(model, model_kwargs, image_size, batch_sizes, "throughput", cpus)
        groups = _Groups(model, model_kwargs, image_size, cpus)
        out = []
        try:
            groups.start_all(_candidates(analysis, traceable, batch_sizes[0], cpus)[0])
            for b in batch_sizes:
                cands = _candidates(analysis, traceable, b, cpus)[0]
                runs = {id(c): [] for c in cands}
                for rep in range(repeats):
                    for c in cands:
                        runs[id(c)].append(groups.measure(c, duration_s / repeats))
                out += [_median_result(runs[id(c)], "throughput", None) for c in cands]
        finally:
            groups.close()
    return out
