"""What one measurement of one configuration gives: :class:`TrialResult`.

Made by the worker groups (:mod:`batchcraft.parallel.workers`), the program runner
(:mod:`batchcraft.parallel.program`) and fakes in tests; read by the objective, the search and the
tables. Throughput is summed over instances (each instance's items over its own elapsed time);
latency percentiles are over every call of every instance (one call = one batch, or for a program
the time between two of its ``report`` calls).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

__all__ = ["TrialResult", "percentile", "aggregate"]


@dataclass
class TrialResult:
    """Aggregate measurement of one configuration at one batch size.

    Attributes:
        config (dict): the configuration (``ParallelConfig.to_dict()``, batch size and label set).
        batch_size (int): items per call.
        throughput_items_per_s (float): sum over instances of items / elapsed seconds.
        latency_p50_ms, latency_p90_ms, latency_p99_ms (float): per-call latency percentiles over
            all instances' calls.
        calls (int): calls measured, all instances together.
        duration_s (float): requested measuring time per instance.
    """

    config: dict
    batch_size: int
    throughput_items_per_s: float
    latency_p50_ms: float
    latency_p90_ms: float
    latency_p99_ms: float
    calls: int
    duration_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile (0..1) of an ascending, non-empty list."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    k = (len(sorted_values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def aggregate(config: dict, batch_size: int, per_instance: list[tuple[list[float], float, float]],
              duration_s: float) -> TrialResult:
    """A :class:`TrialResult` from each instance's (call latencies in s, items, elapsed s).

    An instance with no elapsed time adds no throughput; with no call at all, the latencies are 0.
    """
    latencies_ms = sorted(t * 1e3 for lat, _, _ in per_instance for t in lat)
    throughput = sum(items / elapsed for _, items, elapsed in per_instance if elapsed > 0)
    if not latencies_ms:
        latencies_ms = [0.0]
    return TrialResult(config=config, batch_size=batch_size, throughput_items_per_s=throughput,
                       latency_p50_ms=statistics.median(latencies_ms),
                       latency_p90_ms=percentile(latencies_ms, 0.90),
                       latency_p99_ms=percentile(latencies_ms, 0.99),
                       calls=sum(len(lat) for lat, _, _ in per_instance), duration_s=duration_s)
