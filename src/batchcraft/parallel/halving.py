"""Budgeted successive halving with a final side-by-side round: the search engine of ``tune``.

For one batch size, the search candidates (grid configurations, most promising first) are measured
in rounds whose trials grow ``eta``-fold while the better 1/eta survive (successive halving;
Jamieson & Talwalkar, AISTATS 2016), until at most ``k_final`` are left. A final round then
measures those **and every baseline** side by side: ``repeats`` interleaved passes, median per
configuration. The choice is the best median of that round, so it is never a configuration that
the same round measured slower than another one, and never below the best baseline by the tuner's
own measurement. :meth:`HalvingSearch.playoff` re-measures a close final (best two within
PLAYOFF_MARGIN) with longer trials when time is left; its winner then decides.

Time is a hard budget. Trial lengths are planned to fit the time a batch size is given; a trial is
at least ``min_calls`` calls of that configuration (its per-call time is learned from earlier
trials), so slow models get fewer, longer-per-call trials and fast models many short ones. A
trial starts only if its predicted end (warm-up, length, one call running past the end, the
learned per-trial overhead) is before the deadline. ``measure`` and ``clock`` are passed in, so
tests run the engine with fake measurements on a fake clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from batchcraft.measure.race import Race
from batchcraft.parallel.config import ParallelConfig
from batchcraft.parallel.objective import Objective
from batchcraft.parallel.trial import TrialResult

__all__ = ["CostModel", "BatchOutcome", "HalvingSearch", "PLAYOFF_MARGIN", "SPREAD_LIMIT"]

SPREAD_LIMIT = 1.15  # repeats of one configuration further apart than this: a disturbed final round
PLAYOFF_MARGIN = 1.15  # final round's best two closer than this: re-measured with longer trials if time is left
PLAYOFF_MAX_TRIAL_S = 1.0
PLAYOFF_MIN_CALLS = 5  # a playoff trial of 2 slow calls ranks worse than the final round did
PLAYOFF_MIN_TRIAL_S = 0.2  # a close call is decided by noise in 0.05-0.1-s trials: see playoff()
PLAYOFF_SHARE = 0.35  # at most this part of a batch size's time is set aside for its playoff


class CostModel:
    """Predicts a trial's wall time from what earlier trials took.

    Per (configuration, batch size) it keeps the per-call time (the lowest median so far); a
    batch size not measured yet is estimated from the same configuration at the nearest smaller
    batch size, scaled by the batch ratio (per-item time rarely grows with the batch). The
    per-trial overhead (messages, start synchronisation) is a moving average of what trials took
    beyond their length and one call.
    """

    def __init__(self, warmup_s: float, overhead_s: float = 0.03):
        self.warmup_s, self.overhead_s = warmup_s, overhead_s
        self.call_s: dict[tuple, float] = {}
        self.warm: set[tuple] = set()

    @staticmethod
    def _key(cfg: ParallelConfig) -> tuple:
        return (cfg.key(), cfg.variant()), cfg.batch_size

    def call_time(self, cfg: ParallelConfig) -> float:
        """Estimated seconds per call of ``cfg`` at its batch size (0 when nothing is known).

        Measured, else scaled from the same configuration at the nearest smaller batch size: by
        how much a configuration measured at both sizes slowed down (the largest such factor),
        or by the batch ratio if none was; else the slowest configuration measured at this size;
        else the slowest at a smaller size times the batch ratio.
        """
        k, b = self._key(cfg), cfg.batch_size
        if k in self.call_s:
            return self.call_s[k]
        smaller = [(b0, c) for (key, b0), c in self.call_s.items() if key == k[0] and b0 < b]
        if smaller:
            b0, c0 = max(smaller)
            factors = [c / self.call_s[(key, b0)] for (key, b1), c in self.call_s.items()
                       if b1 == b and (key, b0) in self.call_s and self.call_s[(key, b0)] > 0]
            return c0 * (max(factors) if factors else b / b0)
        same = [c for (_, b1), c in self.call_s.items() if b1 == b]
        if same:
            return max(same)
        return max((c * b / b1 for (_, b1), c in self.call_s.items() if b1 < b), default=0.0)

    def measured(self, cfg: ParallelConfig) -> bool:
        """Whether ``cfg``'s per-call time at its batch size was measured (not estimated)."""
        return self._key(cfg) in self.call_s

    def warmup(self, cfg: ParallelConfig) -> float:
        """Warm-up the next trial of ``cfg`` needs: 0 once warm, else max(warmup_s, one call)."""
        return 0.0 if self._key(cfg) in self.warm else max(self.warmup_s, self.call_time(cfg))

    def floor(self, cfg: ParallelConfig, min_calls: int, min_trial_s: float) -> float:
        """Shortest useful trial length: ``min_calls`` calls and ``min_trial_s``."""
        return max(min_trial_s, min_calls * self.call_time(cfg))

    def wall(self, cfg: ParallelConfig, length_s: float, *, with_warmup: bool = True) -> float:
        """Predicted wall time of one trial of ``length_s`` seconds."""
        return (self.warmup(cfg) if with_warmup else 0.0) + length_s + self.call_time(cfg) + self.overhead_s

    def learn(self, cfg: ParallelConfig, length_s: float, wall_s: float, result: TrialResult) -> None:
        k = self._key(cfg)
        # The fastest median call seen: another process stalling one trial must not make every
        # later trial of this configuration look unaffordable.
        call = min(result.latency_p50_ms / 1e3, self.call_s.get(k, math.inf))
        if k in self.warm:  # a warm-up trial's extra time is not overhead
            self.overhead_s = 0.7 * self.overhead_s + 0.3 * max(0.0, wall_s - length_s - call)
        self.call_s[k] = call
        self.warm.add(k)


@dataclass
class BatchOutcome:
    """What the search found at one batch size.

    Attributes:
        best (ParallelConfig | None): the choice (None if no trial fitted the budget).
        best_result (TrialResult | None): its median in the final round.
        final (list[tuple[ParallelConfig, TrialResult]]): every configuration of the final round
            with its median, best first.
        baselines (dict[str, TrialResult]): baseline label -> its final-round median.
        final_trial_s (float): planned length of one final-round trial (seconds).
        skipped_trials (int): trials not started because they would have passed the deadline.
        notes (list[str]): what did not go as planned.
    """

    best: ParallelConfig | None
    best_result: TrialResult | None
    final: list = field(default_factory=list)
    baselines: dict = field(default_factory=dict)
    final_trial_s: float = 0.0
    skipped_trials: int = 0
    notes: list = field(default_factory=list)
    playoff: list = field(default_factory=list)
    playoff_trial_s: float = 0.0
    playoff_tried: bool = False
    final_race: tuple | None = None  # (configs, Race) of the final round: paired ratios, intervals
    playoff_race: tuple | None = None

    def gap(self, objective: Objective) -> float:
        """How far ahead the final round's best is of its runner-up (ratio >= 1; inf if alone)."""
        if len(self.final) < 2:
            return math.inf
        a, b = (objective.value(r) for _, r in self.final[:2])
        return a / b if b > 0 else math.inf


class HalvingSearch:
    """Successive halving + final side-by-side round at one batch size after another.

    Args:
        measure (callable): ``measure(config, duration_s, warmup_s) -> TrialResult``.
        clock (callable): seconds, monotonic (``time.monotonic``, or a fake one in tests).
        objective (Objective): what "better" means (scoring, pruning, ratios).
        eta (int): survivors per round = ceil(n / eta); trials grow eta-fold per round. Default: 3.
        repeats (int): interleaved passes per search round, median kept. Default: 3.
        final_repeats (int, optional): passes of the final round and of playoffs (their paired
            ratios give the report's intervals: 5 passes cover the median ratio with 94%).
            Default: ``repeats``.
        k_final (int): search candidates that reach the final round. Default: 2.
        min_calls (tuple[int, int]): least calls per trial in search rounds / the final round.
        min_trial_s (float): least seconds per trial. Default: 0.02.
        max_trial_s (float): longest final-round trial unless ``min_calls`` needs more; a larger
            budget ends early. Default: 0.5.
        warmup_s (float): least warm-up the first time a configuration runs a batch size (and at
            least one call). Default: 0.05.
        trials (list), rounds (list): every measurement / every round median is appended here.
    """

    def __init__(self, measure: Callable, clock: Callable[[], float], objective: Objective | None = None,
                 *, eta: int = 3, repeats: int = 3, final_repeats: int | None = None, k_final: int = 2,
                 min_calls: tuple[int, int] = (1, 2), min_trial_s: float = 0.02, max_trial_s: float = 0.5,
                 warmup_s: float = 0.05, trials: list | None = None, rounds: list | None = None,
                 on_trial: Callable[[], None] | None = None):
        self.measure, self.clock = measure, clock
        self.objective = objective or Objective()
        self.eta, self.repeats, self.k_final = eta, repeats, k_final
        self.final_repeats = repeats if final_repeats is None else final_repeats
        self.min_calls, self.min_trial_s, self.max_trial_s = min_calls, min_trial_s, max_trial_s
        self.cost = CostModel(warmup_s)
        self.trials = [] if trials is None else trials
        self.rounds = [] if rounds is None else rounds
        self.on_trial = on_trial or (lambda: None)

    # -- planning ---------------------------------------------------------------------------
    def _levels(self, n: int) -> list[int]:
        levels = []
        while n > self.k_final:
            levels.append(n)
            n = max(self.k_final, math.ceil(n / self.eta))
        return levels

    def _plan_cost(self, final_s: float, levels: list[int], search, final) -> float:
        """Predicted seconds for ``levels`` search rounds and a final round of length ``final_s``."""
        c, r = self.cost, self.repeats
        total = sum(c.warmup(cfg) for cfg in {id(x): x for x in [*search, *final]}.values())
        r_final = self.final_repeats
        for i, n in enumerate(levels):
            length = final_s / self.eta ** (len(levels) - i)
            walls = sorted((c.wall(cfg, max(length, c.floor(cfg, self.min_calls[0], self.min_trial_s)),
                                   with_warmup=False) for cfg in search), reverse=True)
            total += r * sum(walls[:n])  # the slowest n assumed to survive: plan for the worst
        total += r_final * sum(c.wall(cfg, max(final_s, c.floor(cfg, self.min_calls[1], self.min_trial_s)),
                                      with_warmup=False) for cfg in final)
        return total

    def _fit(self, levels: list[int], search: list, final: list, time_s: float) -> float | None:
        """Longest final trial (<= max_trial_s) whose plan fits ``time_s``; None if none does."""
        if self._plan_cost(0.0, levels, search, final) > time_s:
            return None
        lo, hi = 0.0, self.max_trial_s
        if self._plan_cost(hi, levels, search, final) <= time_s:
            return hi
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self._plan_cost(mid, levels, search, final) <= time_s else (lo, mid)
        return lo

    def plan(self, search: list, baselines: list, time_s: float) -> tuple[list[int], float, bool]:
        """(search round sizes, final trial length, fits) for ``time_s`` seconds.

        Two plans are compared: every candidate straight into the final round, or successive
        halving down to ``k_final`` first (search trials eta-fold shorter per round). The one
        with the longer final trials wins (the cheaper one if both reach ``max_trial_s``): halving
        pays for large grids, not for a handful of candidates with slow calls. If neither fits
        even with the shortest trials, the search is dropped and the final round gets the first
        ``k_final`` candidates (the most promising by the prior order); ``fits`` is then False if
        that does not fit either.
        """
        base = list(baselines)
        worst = sorted(search, key=lambda cfg: -self.cost.call_time(cfg))[:self.k_final]
        options = [([], list(search), list(search) + base)]
        levels = self._levels(len(search))
        if levels:
            options.append((levels, list(search), worst + base))
        best = None
        for lv, srch, final in options:
            length = self._fit(lv, srch if lv else [], final, time_s)
            if length is None:
                continue
            rank = (length, -self._plan_cost(length, lv, srch if lv else [], final))
            if best is None or rank > best[0]:
                best = (rank, lv, length)
        if best is not None:
            return best[1], best[2], True
        return [], 0.0, False

    def floor_cost(self, search: list, baselines: list) -> float:
        """Predicted seconds for the shortest plan at one batch size (for sharing the budget)."""
        base = list(baselines)
        cost = self._plan_cost(0.0, [], [], list(search) + base)
        levels = self._levels(len(search))
        if levels:
            worst = sorted(search, key=lambda cfg: -self.cost.call_time(cfg))[:self.k_final]
            cost = min(cost, self._plan_cost(0.0, levels, search, worst + base))
        return cost

    def probe(self, cfg: ParallelConfig, hard_deadline: float) -> None:
        """One minimal trial (warm-up and one call) of ``cfg`` to learn its per-call time."""
        t0 = self.clock()
        if t0 + self.cost.wall(cfg, 0.0) > hard_deadline:
            return
        res = self.measure(cfg, 1e-3, self.cost.warmup_s)
        self.cost.learn(cfg, 1e-3, self.clock() - t0, res)
        res.config["label"] = cfg.label
        self.trials.append({"round": -1, "role": "probe", "repeat": 0, "duration_s": 1e-3, **res.to_dict()})
        self.on_trial()

    def playoff_reserve(self, configs: list, share_s: float) -> float:
        """Seconds to set aside for a playoff at one batch size: PLAYOFF_SHARE of ``share_s``,
        or 0 if even the shortest playoff (``repeats`` passes of two trials of PLAYOFF_MIN_TRIAL_S
        and PLAYOFF_MIN_CALLS calls of the slowest of ``configs``) would not fit in it.
        """
        if not configs:
            return 0.0
        slowest = max(configs, key=self.cost.call_time)
        length = max(PLAYOFF_MIN_TRIAL_S, self.cost.floor(slowest, PLAYOFF_MIN_CALLS, 0.0))
        need = 2 * self.final_repeats * self.cost.wall(slowest, length, with_warmup=False)
        return PLAYOFF_SHARE * share_s if need <= PLAYOFF_SHARE * share_s else 0.0

    def playoff(self, outcome: BatchOutcome, end: float, rnd: int) -> bool:
        """Re-measure the final round's best two side by side with longer trials, if they fit.

        Trials of a few calls are noisy, and a close final round is where noise decides, so
        the closest decisions get ``repeats`` more interleaved passes of trials as long as fit
        by ``end``: at most PLAYOFF_MAX_TRIAL_S, at least
        PLAYOFF_MIN_TRIAL_S, 1.5x the final round's and PLAYOFF_MIN_CALLS calls. The winner
        becomes the choice (``best``; ``best_result`` stays its final-round median, and the
        playoff's medians are in ``playoff``). Returns False when no playoff was completed.
        """
        pair = [c for c, _ in outcome.final[:2]]
        left = end - self.clock()
        shortest = max(PLAYOFF_MIN_TRIAL_S, 1.5 * outcome.final_trial_s, self.min_trial_s)
        length = PLAYOFF_MAX_TRIAL_S
        while length >= shortest:
            walls = [self.cost.wall(c, max(length, self.cost.floor(c, PLAYOFF_MIN_CALLS, 0.0))) for c in pair]
            if self.final_repeats * sum(walls) <= left:
                break
            length *= 0.8
        else:
            return False
        outcome.playoff_tried = True
        ranked = self._round(pair, length, PLAYOFF_MIN_CALLS, rnd, "playoff", end, outcome)
        if len(ranked) < 2 or any(r.calls == 0 for _, r in ranked):
            return False
        outcome.playoff, outcome.playoff_trial_s = ranked, length
        winner = ranked[0][0]
        if winner.trial_key() != outcome.best.trial_key():
            outcome.notes.append(f"playoff with {length:.2g}-s trials chose {winner.short()} "
                                 f"[{winner.label}] over the final round's {outcome.best.short()} "
                                 f"[{outcome.best.label}]")
        # best_result stays a final-round median: comparable with the baselines' medians there
        outcome.best, outcome.best_result = next((c, r) for c, r in outcome.final if c.trial_key() == winner.trial_key())
        return True

    # -- measuring --------------------------------------------------------------------------
    def _round(self, configs: list, length_s: float, min_calls: int, rnd: int, role: str,
               end: float, outcome: BatchOutcome, extra_end: float = -math.inf
               ) -> list[tuple[ParallelConfig, TrialResult]]:
        """One round: interleaved passes (a :class:`~batchcraft.measure.race.Race`); each
        configuration's median, best first. The race is kept in ``outcome`` for final rounds and
        playoffs (paired ratios and their intervals).

        Trials start only if predicted to end by ``end``; extra passes of a disturbed final round
        only by ``extra_end``.
        """
        repeats = self.repeats if role == "search" else self.final_repeats

        def variant(i: int):
            def trial():
                cfg = configs[i]
                length = max(length_s, self.cost.floor(cfg, min_calls, self.min_trial_s))
                planned = race.rounds < repeats
                t0 = self.clock()
                if t0 + self.cost.wall(cfg, length) > (end if planned else min(end, extra_end)):
                    outcome.skipped_trials += planned
                    return None
                res = self.measure(cfg, length, max(self.cost.warmup_s, 0.0))
                self.cost.learn(cfg, length, self.clock() - t0, res)
                res.config["label"] = cfg.label
                self.trials.append({"round": rnd, "role": role, "repeat": race.rounds, "duration_s": length,
                                    **res.to_dict()})
                self.on_trial()
                return res
            return trial

        race = Race([variant(i) for i in range(len(configs))], labels=[c.label for c in configs],
                    value=self.objective.value)
        active = list(range(len(configs)))
        while race.rounds < repeats or (role == "final" and race.rounds < 2 * repeats and self._disturbed(race)):
            # Final round: while some configuration's repeats disagree by more than SPREAD_LIMIT
            # (another process took the cores during some of them), more interleaved passes, up
            # to twice the repeats and as long as the deadline allows; the median takes them all.
            if race.rounds and role == "search":
                last = {i: race.samples[i][-1] for i in active if race.samples[i] and race.samples[i][-1] is not None}
                if last:  # already PRUNE_FACTOR x worse than the round's best: cannot win this round
                    best = max(last.values(), key=self.objective.value)
                    active = [i for i in active if i not in last or not self.objective.hopeless(last[i], best)]
            measured = race.run_round(active)
            if race.rounds > repeats and not measured:
                break  # no time left for extra passes
        medians = [(configs[i], self.objective.median(race.raw(i)), len(race.raw(i)))
                   for i in range(len(configs)) if race.raw(i)]
        self.rounds.extend({"round": rnd, "role": role, "repeats": n, **r.to_dict()} for _, r, n in medians)
        ranked = sorted(medians, key=lambda m: self.objective.score(m[1]), reverse=True)
        if role == "final":
            outcome.final_race = (list(configs), race)
        elif role == "playoff":
            outcome.playoff_race = (list(configs), race)
        return [(c, r) for c, r, _ in ranked]

    def _disturbed(self, race: Race) -> bool:
        for i in range(len(race.variants)):
            thr = race.values(i)
            if len(thr) >= 2 and min(thr) > 0 and max(thr) / min(thr) > SPREAD_LIMIT:
                return True
        return False

    def run(self, search: list, baselines: list, deadline: float, hard_deadline: float) -> BatchOutcome:
        """Search one batch size until ``deadline`` (a trial may run on to ``hard_deadline``).

        Args:
            search (list[ParallelConfig]): candidates that are not baselines, most promising first.
            baselines (list[ParallelConfig]): measured in the final round whatever happens before.
            deadline (float): clock time by which this batch size should be done (trial lengths
                are planned for it).
            hard_deadline (float): no trial is started that is predicted to end after it.
        Returns:
            BatchOutcome: the choice and the final round; ``best`` is None only if no trial fitted.
        """
        out = BatchOutcome(None, None)
        alive, rnd, measured = list(search), 0, []
        levels, final_s, fits = self.plan(alive, baselines, deadline - self.clock())
        if not fits:
            out.notes.append("the budget is too short for one trial of every baseline and candidate; "
                             "trials that would pass the deadline were skipped")
        while levels:
            length = final_s / self.eta ** len(levels)
            measured = self._round(alive, length, self.min_calls[0], rnd, "search", hard_deadline, out)
            keep = max(self.k_final, math.ceil(len(alive) / self.eta))
            alive = [c for c, _ in measured[:keep]] or alive[:keep]
            rnd += 1
            levels, final_s, fits = self.plan(alive, baselines, deadline - self.clock())
        if not fits:
            alive = alive[:self.k_final]  # ranked by the last search round, else in prior order
        final_cfgs = alive + [b for b in baselines if all(b.trial_key() != c.trial_key() for c in alive)]
        out.final_trial_s = final_s
        out.final = self._round(final_cfgs, final_s, self.min_calls[1], rnd, "final", hard_deadline, out,
                                extra_end=deadline)
        by_key = {c.trial_key(): r for c, r in out.final}
        out.baselines = {b.label: by_key[b.trial_key()] for b in baselines if b.trial_key() in by_key}
        missing = [b.label for b in baselines if b.label not in out.baselines]
        if missing:
            out.notes.append(f"not measured in the final round (budget): {', '.join(missing)}")
        if out.final:
            out.best, out.best_result = out.final[0]
        elif measured:
            out.best, out.best_result = measured[0]
            out.notes.append("no final round fitted the budget; the choice is the last search round's best")
        return out
