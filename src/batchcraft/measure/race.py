"""Measurement race: k variants timed in interleaved rounds, with medians, IQRs and ratio intervals.

Why a race and not k separate measurements: on a shared machine the speed of everything drifts
(another process takes a core, the clock ramps, caches are cold after a pause), so variants
measured one after the other differ by when they ran. In a race every *round* measures each
variant once, so drift hits all of them alike, and the variant that starts a round rotates, so
none always runs right after the same other one (cache and frequency state left behind).

Comparisons are *paired*: for two variants the unit of evidence is one round, in which both were
measured next to each other; the ratio of their two samples in that round is one observation of
how much faster one is. The estimate is the median of these paired ratios, and its confidence
interval is the distribution-free interval for a median from order statistics (the sign-test
interval: with n paired ratios sorted, ``[r_(k), r_(n+1-k)]`` covers the true median with
probability ``1 - 2 P(Binomial(n, 1/2) <= k - 1)``; the largest k that reaches the requested
confidence is used, and the *achieved* coverage is reported, since with few rounds 95% cannot
be reached: 5 rounds give at most 93.8%, 6 rounds 96.9%). No normality is assumed, and one
disturbed round moves the interval by at most one order statistic.

Rounds are independent only as far as what varies between them is what varies in use. When
samples of one round share something that varies between *process instances* (all rounds in
the same worker processes, say), the interval covers the noise within those processes, not the
process-to-process noise. Give each round a ``cluster`` (e.g. the process start it belongs to):
the interval is then computed over clusters (the median paired ratio of each cluster is one
observation), which is honest when process instances differ and wide when there are few.

Example:
    >>> r = race([lambda: time_a(), lambda: time_b()], rounds=7, higher_is_better=False)
    >>> r.summary(0).median, r.ratio(0, 1).low   # seconds; speed of a over b, lower bound

Source: the order-statistics interval for a median is the classical sign-test interval (e.g.
Conover, *Practical Nonparametric Statistics*, 3rd ed., the quantile test); interleaving with a
rotating start replaces the six copies of that loop batchcraft had (tuner rounds, sweep,
head-to-head, micro-batching verification).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Sequence

__all__ = ["Race", "Summary", "RatioInterval", "race", "timed", "median_interval"]


@dataclass(frozen=True)
class Summary:
    """Median and quartiles of one variant's samples (the unit of the samples: seconds, items/s...).

    Attributes:
        n (int): samples.
        median, q1, q3 (float): median and the first / third quartile (``statistics.quantiles``,
            exclusive method; with fewer than 2 samples all three are the sample).
    """

    n: int
    median: float
    q1: float
    q3: float

    @property
    def iqr(self) -> float:
        """Interquartile range q3 - q1."""
        return self.q3 - self.q1

    def to_dict(self) -> dict:
        return {"n": self.n, "median": self.median, "q1": self.q1, "q3": self.q3, "iqr": self.iqr}


def summarize(values: Sequence[float]) -> Summary:
    """:class:`Summary` of ``values``.

    Raises:
        ValueError: no values.
    """
    vals = sorted(float(v) for v in values)
    if not vals:
        raise ValueError("summarize: no samples")
    med = statistics.median(vals)
    if len(vals) < 2:
        return Summary(len(vals), med, vals[0], vals[0])
    q1, _, q3 = statistics.quantiles(vals, n=4)
    return Summary(len(vals), med, q1, q3)


@dataclass(frozen=True)
class RatioInterval:
    """How much faster variant a is than variant b: median paired ratio and its interval.

    ``estimate`` > 1 means a is faster (more items/s, or less time). ``low``..``high`` is the
    order-statistics interval of the median with coverage ``confidence`` (the achieved one,
    which can be below the requested one with few units; 0 with a single unit). ``units`` is
    the number of independent observations it rests on (rounds, or clusters of rounds).
    """

    estimate: float
    low: float
    high: float
    confidence: float
    units: int

    def within(self, tolerance: float = 0.05) -> bool:
        """True when the whole interval lies within ``tolerance`` of 1 (the two are equal to it)."""
        return self.units > 0 and self.low >= 1.0 - tolerance and self.high <= 1.0 + tolerance

    def at_least(self, bound: float) -> str:
        """"yes" if the interval lies at or above ``bound``, "no" if wholly below, else "undecided"."""
        if self.units == 0:
            return "undecided"
        if self.low >= bound:
            return "yes"
        if self.high < bound:
            return "no"
        return "undecided"

    def describe(self, tolerance: float = 0.05) -> str:
        """One word for tables: "faster", "slower", "equal" (within ``tolerance``) or "unresolved"."""
        if self.units == 0:
            return "unresolved"
        if self.low > 1.0:
            return "faster"
        if self.high < 1.0:
            return "slower"
        return "equal" if self.within(tolerance) else "unresolved"

    def text(self) -> str:
        """``"1.23 [1.10, 1.31] 94%"``: estimate, interval and its coverage."""
        return f"{self.estimate:.3g} [{self.low:.3g}, {self.high:.3g}] {self.confidence:.0%}"

    def to_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high,
                "confidence": self.confidence, "units": self.units}


def _binom_cdf_half(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(0, k + 1)) / 2 ** n


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, high, achieved coverage) of the order-statistics interval for the median of ``values``.

    The largest k with ``1 - 2 P(Bin(n, 1/2) <= k - 1) >= confidence`` gives ``[v_(k), v_(n+1-k)]``;
    if even k = 1 (the range) falls short, the range is returned with its lower coverage.

    Raises:
        ValueError: no values, or confidence not in (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"median_interval: confidence must be in (0, 1), got {confidence!r}")
    vals = sorted(values)
    n = len(vals)
    if n == 0:
        raise ValueError("median_interval: no values")
    best_k, coverage = 1, 1.0 - 2.0 * _binom_cdf_half(0, n)
    for k in range(2, n // 2 + 1):
        cov = 1.0 - 2.0 * _binom_cdf_half(k - 1, n)
        if cov < confidence:
            break
        best_k, coverage = k, cov
    return vals[best_k - 1], vals[n - best_k], max(0.0, coverage)


class Race:
    """k variants measured in interleaved rounds with a rotating start.

    Args:
        variants (sequence of callables): ``variant() -> sample``; a sample is a number, or any
            object ``value`` turns into one (e.g. a trial result), or None for "not measured in
            this round" (a deadline, a pruned variant).
        labels (sequence of str, optional): names for :meth:`to_dict`. Default: "0", "1", ...
        higher_is_better (bool): True for speeds (items/s), False for times (seconds).
            Default: True.
        value (callable, optional): ``value(sample) -> float``. Default: ``float``.
    Attributes:
        samples (list[list]): ``samples[i][r]``: variant i's sample of round r, or None.
        clusters (list): the cluster of each round (see the module docstring).
    """

    def __init__(self, variants: Sequence[Callable[[], Any]], *, labels: Sequence[str] | None = None,
                 higher_is_better: bool = True, value: Callable[[Any], float] = float):
        if not variants:
            raise ValueError("Race: no variants")
        self.variants = list(variants)
        self.labels = [str(i) for i in range(len(variants))] if labels is None else list(labels)
        if len(self.labels) != len(self.variants):
            raise ValueError(f"Race: {len(self.labels)} labels for {len(self.variants)} variants")
        self.higher_is_better = higher_is_better
        self.value = value
        self.samples: list[list] = [[] for _ in self.variants]
        self.clusters: list[Hashable] = []

    @classmethod
    def from_samples(cls, samples: Sequence[Sequence], *, labels: Sequence[str] | None = None,
                     higher_is_better: bool = True, value: Callable[[Any], float] = float,
                     clusters: Sequence[Hashable] | None = None) -> "Race":
        """A race whose rounds were run elsewhere (e.g. inside a worker process).

        Args:
            samples: ``samples[i][r]``: variant i's sample of round r (None: not measured); every
                variant the same number of rounds.
            clusters: each round's cluster. Default: the round index.
        Raises:
            ValueError: no variants, or variants with different numbers of rounds.
        """
        if not samples or len({len(col) for col in samples}) != 1:
            raise ValueError("Race.from_samples: every variant needs the same number of rounds")
        n = len(samples[0])
        race = cls([lambda: None] * len(samples), labels=labels, higher_is_better=higher_is_better, value=value)
        race.samples = [list(col) for col in samples]
        race.clusters = list(range(n)) if clusters is None else list(clusters)
        if len(race.clusters) != n:
            raise ValueError("Race.from_samples: one cluster per round")
        return race

    @property
    def rounds(self) -> int:
        """Rounds run so far."""
        return len(self.clusters)

    def order(self, active: Sequence[int]) -> list[int]:
        """The order round :attr:`rounds` measures ``active`` in: rotated by the round index."""
        active = list(active)
        if not active:
            return []
        shift = self.rounds % len(active)
        return active[shift:] + active[:shift]

    def run_round(self, active: Iterable[int] | None = None, *, cluster: Hashable = None) -> int:
        """Measure each active variant once (rotated order); return how many gave a sample.

        Args:
            active (iterable of int, optional): variant indices to measure. Default: all.
            cluster (hashable, optional): this round's cluster. Default: the round index.
        """
        idx = list(range(len(self.variants))) if active is None else list(active)
        row: dict[int, Any] = {}
        for i in self.order(idx):
            row[i] = self.variants[i]()
        for i, col in enumerate(self.samples):
            col.append(row.get(i))
        self.clusters.append(self.rounds if cluster is None else cluster)
        return sum(1 for v in row.values() if v is not None)

    def run(self, rounds: int, *, warmup: int = 0, stop: Callable[[], bool] | None = None) -> "Race":
        """``warmup`` untimed calls of each variant, then up to ``rounds`` rounds (until ``stop()``).

        Raises:
            ValueError: rounds < 1 or warmup < 0.
        """
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"Race.run: rounds must be an int >= 1, got {rounds!r}")
        if warmup < 0:
            raise ValueError(f"Race.run: warmup must be >= 0, got {warmup!r}")
        for _ in range(warmup):
            for v in self.variants:
                v()
        for _ in range(rounds):
            if stop is not None and stop():
                break
            self.run_round()
        return self

    # -- statistics -------------------------------------------------------------------------
    def raw(self, i: int) -> list:
        """Variant i's samples as measured (None-free), in round order."""
        return [s for s in self.samples[i] if s is not None]

    def values(self, i: int) -> list[float]:
        """Variant i's sample values, in round order."""
        return [float(self.value(s)) for s in self.raw(i)]

    def summary(self, i: int) -> Summary:
        """Median and quartiles of variant i. Raises ValueError if it has no sample."""
        return summarize(self.values(i))

    def median_sample(self, i: int):
        """Variant i's sample whose value is the median (the upper one of an even count)."""
        raw = self.raw(i)
        if not raw:
            raise ValueError(f"Race: variant {self.labels[i]!r} has no sample")
        ranked = sorted(raw, key=lambda s: float(self.value(s)))
        return ranked[len(ranked) // 2]

    def ranking(self) -> list[int]:
        """Variants with samples, best median first."""
        have = [i for i in range(len(self.variants)) if self.raw(i)]
        return sorted(have, key=lambda i: self.summary(i).median, reverse=self.higher_is_better)

    def paired(self, i: int, j: int, pair: Callable[[Any, Any], float] | None = None) -> list[tuple[Hashable, float]]:
        """(cluster, speed ratio of i over j) for every round that measured both.

        ``pair(a, b)`` computes the ratio from the two raw samples; default: value(a) / value(b)
        for speeds, value(b) / value(a) for times (> 1: i is faster).
        """
        out = []
        for r, (a, b) in enumerate(zip(self.samples[i], self.samples[j])):
            if a is None or b is None:
                continue
            if pair is not None:
                ratio = float(pair(a, b))
            else:
                va, vb = float(self.value(a)), float(self.value(b))
                num, den = (va, vb) if self.higher_is_better else (vb, va)
                ratio = num / den if den > 0 else math.inf
            out.append((self.clusters[r], ratio))
        return out

    def ratio(self, i: int, j: int, *, confidence: float = 0.95,
              pair: Callable[[Any, Any], float] | None = None) -> RatioInterval:
        """Median paired speed ratio of variant i over variant j with its interval.

        With clusters, each cluster's median ratio is one unit (see the module docstring).
        Without a round that measured both, the interval is empty (units 0, estimate nan).
        """
        pairs = self.paired(i, j, pair)
        if not pairs:
            return RatioInterval(math.nan, math.nan, math.nan, 0.0, 0)
        by_cluster: dict[Hashable, list[float]] = {}
        for c, r in pairs:
            by_cluster.setdefault(c, []).append(r)
        units = [statistics.median(rs) for rs in by_cluster.values()]
        estimate = statistics.median(r for _, r in pairs)
        low, high, cov = median_interval(units, confidence)
        return RatioInterval(estimate, low, high, cov if len(units) > 1 else 0.0, len(units))

    def to_dict(self, *, confidence: float = 0.95) -> dict:
        """Samples, summaries and every variant's ratio over the best median, by label."""
        ranking = self.ranking()
        best = ranking[0] if ranking else None
        out = {"rounds": self.rounds, "higher_is_better": self.higher_is_better, "variants": {}}
        for i, label in enumerate(self.labels):
            vals = self.values(i)
            entry = {"samples": vals}
            if vals:
                entry["summary"] = self.summary(i).to_dict()
                if best is not None and i != best:
                    entry["ratio_to_best"] = self.ratio(i, best, confidence=confidence).to_dict()
            out["variants"][label] = entry
        return out


def race(variants: Sequence[Callable[[], Any]], rounds: int, *, warmup: int = 0,
         labels: Sequence[str] | None = None, higher_is_better: bool = True,
         value: Callable[[Any], float] = float, stop: Callable[[], bool] | None = None) -> Race:
    """Run a :class:`Race` of ``rounds`` rounds (after ``warmup`` untimed calls each) and return it.

    Example (times: lower is better):
        >>> r = race([timed(f), timed(g)], rounds=7, warmup=1, higher_is_better=False)
        >>> r.ratio(1, 0).text()   # how much faster g is than f: "1.2 [1.1, 1.3] 98%"
    """
    return Race(variants, labels=labels, higher_is_better=higher_is_better, value=value).run(
        rounds, warmup=warmup, stop=stop)


def timed(fn: Callable[[], object], *, calls: int = 1,
          clock: Callable[[], float] = time.perf_counter) -> Callable[[], float]:
    """A race variant that runs ``fn()`` ``calls`` times and returns seconds per call.

    Raises:
        ValueError: calls < 1.
    """
    if not isinstance(calls, int) or calls < 1:
        raise ValueError(f"timed: calls must be an int >= 1, got {calls!r}")

    def sample() -> float:
        t0 = clock()
        for _ in range(calls):
            fn()
        return (clock() - t0) / calls

    return sample
