"""Wall-clock timing with warm-up and repeats; median and IQR, never a single run."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Measurement:
    """Repeated wall-clock timings of one callable.

    Attributes:
        times_s (list[float]): one entry per repeat, seconds.
    """

    label: str
    times_s: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_s) * 1e3

    @property
    def iqr_ms(self) -> float:
        if len(self.times_s) < 4:
            return (max(self.times_s) - min(self.times_s)) * 1e3
        q = statistics.quantiles(self.times_s, n=4)
        return (q[2] - q[0]) * 1e3

    @property
    def min_ms(self) -> float:
        return min(self.times_s) * 1e3

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "median_ms": self.median_ms,
            "iqr_ms": self.iqr_ms,
            "min_ms": self.min_ms,
            "repeats": len(self.times_s),
        }


def measure(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1,
            label: str = "", min_time_s: float = 0.0) -> Measurement:
    """Time ``fn()`` ``repeats`` times after ``warmup`` untimed calls.

    Args:
        fn: zero-argument callable; its result is discarded.
        repeats (int): timed calls (>= 1). Default: 5.
        warmup (int): untimed calls first (caches, lazy init). Default: 1.
        min_time_s (float): keep repeating past ``repeats`` until this much time is spent.
    Returns:
        Measurement: the per-repeat times.
    """
    if repeats < 1:
        raise ValueError(f"measure: repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    m = Measurement(label)
    start = time.perf_counter()
    while len(m.times_s) < repeats or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        m.times_s.append(time.perf_counter() - t0)
    return m
