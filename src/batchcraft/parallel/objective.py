"""What "better" means for the tuner: one :class:`Objective` owns scoring, pruning and ratios.

Throughput: more items/s is better. Latency: a lower median per-call latency; with a p90 limit,
the configurations that meet it ranked by throughput, then the others by p90 latency. Every part
of the tuner that compares results (ranking a round, pruning a hopeless candidate, the ratios in
the report, the order candidates are tried in) asks this object, so they cannot disagree.
"""

from __future__ import annotations

from batchcraft.errors import ConfigurationError
from batchcraft.parallel.trial import TrialResult

__all__ = ["OBJECTIVES", "Objective"]

OBJECTIVES = ("throughput", "latency")
PRUNE_FACTOR = 4.0  # a search candidate this many times worse than its round's best skips the other repeats


class Objective:
    """Scoring of trial results.

    Args:
        kind (str): "throughput" or "latency".
        latency_limit_ms (float, optional): p90 latency limit; only with kind "latency".
    Raises:
        ConfigurationError: unknown kind, or a limit without kind "latency" or <= 0.
    """

    def __init__(self, kind: str = "throughput", latency_limit_ms: float | None = None):
        if kind not in OBJECTIVES:
            raise ConfigurationError(f"tune: objective must be one of {OBJECTIVES}, got {kind!r}")
        if latency_limit_ms is not None and (kind != "latency" or not latency_limit_ms > 0):
            raise ConfigurationError(
                f"tune: latency_limit_ms={latency_limit_ms!r} needs objective='latency' and a value > 0 "
                f"(objective is {kind!r})", hint="pass --objective latency with --latency-limit-ms")
        self.kind, self.limit = kind, latency_limit_ms

    def __repr__(self) -> str:
        return f"Objective({self.kind!r}, latency_limit_ms={self.limit!r})"

    def meets_limit(self, r: TrialResult) -> bool:
        return self.limit is not None and r.latency_p90_ms <= self.limit

    def score(self, r: TrialResult) -> tuple:
        """Sort key, larger is better (see the module docstring)."""
        if self.kind == "throughput":
            return (r.throughput_items_per_s,)
        if self.limit is not None:
            if self.meets_limit(r):
                return (1, r.throughput_items_per_s)
            return (0, -r.latency_p90_ms)
        return (-r.latency_p50_ms,)

    def value(self, r: TrialResult) -> float:
        """A positive "higher is better" number: items/s, or 1 / latency (0: misses the limit)."""
        if self.kind == "throughput" or self.meets_limit(r):
            return r.throughput_items_per_s
        if self.limit is not None:
            return 0.0
        return 1.0 / max(r.latency_p50_ms, 1e-9)

    def ratio(self, best: TrialResult, base: TrialResult) -> float:
        """How much better ``best`` is than ``base`` (>= 1 when it ranks at least as high).

        throughput: items/s ratio. latency with a limit: the items/s ratio when both meet it,
        base p90 / best p90 when best meets it and base does not (floored at 1: meeting the
        limit ranks first) or neither does; latency without a limit: base p50 / best p50.
        """
        if self.kind == "throughput":
            return _div(best.throughput_items_per_s, base.throughput_items_per_s)
        if self.limit is not None:
            b_ok, s_ok = self.meets_limit(best), self.meets_limit(base)
            if b_ok and s_ok:
                return _div(best.throughput_items_per_s, base.throughput_items_per_s)
            r = _div(base.latency_p90_ms, best.latency_p90_ms)
            return max(1.0, r) if b_ok and not s_ok else (min(1.0, r) if s_ok and not b_ok else r)
        return _div(base.latency_p50_ms, best.latency_p50_ms)

    def median(self, results: list[TrialResult]) -> TrialResult:
        """The median of ``results`` by :meth:`score` (the upper one of an even count)."""
        ranked = sorted(results, key=self.score)
        return ranked[len(ranked) // 2]

    def hopeless(self, r: TrialResult, best: TrialResult) -> bool:
        """True when ``r`` is PRUNE_FACTOR times worse than ``best`` (it cannot win the round)."""
        return self.value(r) * PRUNE_FACTOR < self.value(best)

    def prior(self, cfg, analysis) -> float:
        """Rough relative speed of a configuration, used only to order candidates (larger first).

        Amdahl over the graph: a share f of the work (parallel_flops_fraction) overlaps on
        min(pools, max width) pools, intra-op threads scale as threads^0.8, instances multiply
        throughput but not latency.
        """
        f = (analysis.parallel_flops_fraction or 0.0) if analysis is not None else 0.0
        width = max(1, analysis.max_width) if analysis is not None else 1
        per_call = ((1 - f) + f / min(cfg.inter_op_threads, width)) / (cfg.intra_op_threads or 1) ** 0.8
        return (cfg.instances if self.kind == "throughput" else 1) / per_call


def _div(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")
