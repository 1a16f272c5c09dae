"""Measure time and peak workspace of (layer geometry, pass, algorithm, micro-batch).

What is measured, per configuration, exactly as :func:`~batchcraft.microbatching.execute.execute_step`
runs it inside a planned layer: the algorithm's call plus, for a micro-batch that is a step of a
divided batch, the copy of its result into the output slice (or the ``+=`` into dW).

* time: the *minimum* wall-clock of ``repeats`` calls after ``warmup`` untimed ones, intra-op
  threads as set in torch. The minimum, not the median: on a shared machine a burst of load
  makes OpenMP barriers wait for a descheduled thread (tens of ms), and a plan must not be
  chosen by such noise; the least-disturbed call is the kernel's own cost. A configuration whose
  first timed call is already more than ``cutoff`` times slower than the best seen for that
  (pass, micro-batch) stops there (one sample), because it cannot be chosen for speed.
* spread: (median - min) / min of the timed calls. Above ``spread_limit`` (default 0.3) the
  machine was busy while measuring: the calls are timed again, up to ``retries`` more rounds
  (the minimum over all rounds is kept, the spread of the last round is stored). A record read
  from the cache with a spread above the limit is measured again rather than trusted.
* workspace: one call under :func:`~batchcraft.microbatching.memory.peak_extra_bytes`, i.e. the
  peak of bytes allocated through the CPU allocator above the level at entry. For an undivided
  call the result is the layer's own output and is subtracted; for a step it is a temporary
  and counts.

Results go to a :class:`~batchcraft.microbatching.cache.MeasurementCache`; a configuration
already there is not measured again unless ``refresh`` is set (``cache="refresh"``,
``--remeasure``) or the record is flagged as noisy. A configuration whose workspace exceeds
``limit_bytes`` is stored without a time (it can never be chosen under that budget) and not timed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from batchcraft.microbatching.algorithms import ConvGeometry, accumulator_dtype
from batchcraft.microbatching.cache import MeasurementCache, MeasurementKey, MeasurementRecord
from batchcraft.microbatching.execute import execute_step
from batchcraft.microbatching.memory import peak_extra_bytes
from batchcraft.microbatching.types import dtype_name

__all__ = ["Measurer", "device_name", "SPREAD_LIMIT", "spread"]

SPREAD_LIMIT = 0.3  # (median - min) / min of one round above which the round is not trusted


def spread(times_ms: list[float]) -> float:
    """(median - min) / min of timed calls; 0 for fewer than two."""
    if len(times_ms) < 2 or min(times_ms) <= 0:
        return 0.0
    return (statistics.median(times_ms) - min(times_ms)) / min(times_ms)


def device_name(device: torch.device) -> str:
    """Name of the device for cache keys: CPU model or CUDA device name."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    from batchcraft.measure.machine import _cpu_model

    return f"cpu:{_cpu_model()}"


@dataclass
class _Inputs:
    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor


class Measurer:
    """Measures configurations on random inputs, through a cache.

    Args:
        cache (MeasurementCache): where records are read and written.
        dtype (torch.dtype): element type of inputs and weights. Default: float32.
        repeats (int): timed calls per configuration (>= 1). Default: 3.
        warmup (int): untimed calls before measuring. Default: 1.
        cutoff (float): see module docstring. Default: 2.0.
        device (torch.device | str): where inputs live. Default: "cpu".
        refresh (bool): measure every configuration again, ignoring (and overwriting) the cache. Default: False.
        spread_limit (float): see module docstring. Default: :data:`SPREAD_LIMIT`.
        retries (int): extra rounds for a noisy configuration. Default: 2.
        clock (callable () -> seconds): timer. Default: ``time.perf_counter``.

    Attributes:
        measured (int): configurations run now (not answered by the cache).
        remeasured_noisy (int): of those, cached records re-measured because their spread was too large.
        noisy (list[MeasurementKey]): configurations still above the spread limit after the retries.
    """

    def __init__(self, cache: MeasurementCache, *, dtype: torch.dtype = torch.float32, repeats: int = 3,
                 warmup: int = 1, cutoff: float = 2.0, device: torch.device | str = "cpu", refresh: bool = False,
                 spread_limit: float = SPREAD_LIMIT, retries: int = 2,
                 clock: Callable[[], float] = time.perf_counter):
        self.cache, self.dtype = cache, dtype
        self.repeats, self.warmup, self.cutoff = max(1, int(repeats)), max(0, int(warmup)), float(cutoff)
        self.device = torch.device(device)
        self.device_name = device_name(self.device)
        self.refresh, self.spread_limit, self.retries, self.clock = bool(refresh), float(spread_limit), int(retries), clock
        self._inputs: tuple[tuple, _Inputs] | None = None
        self._best_ms: dict[tuple, float] = {}
        self._fresh: set[MeasurementKey] = set()  # measured by this Measurer: never re-measured by refresh
        self.measured = 0
        self.remeasured_noisy = 0
        self.noisy: list[MeasurementKey] = []

    def key(self, geom: ConvGeometry, pass_: str, algorithm: str, n: int, divided: bool) -> MeasurementKey:
        return MeasurementKey(self.device_name, torch.__version__, torch.get_num_threads(),
                              dtype_name(self.dtype), geom.key(), pass_, algorithm, n, divided)

    def _tensors(self, geom: ConvGeometry, n: int) -> _Inputs:
        # one geometry and size at a time: keeps at most one set of activations alive
        tag = (geom, n)
        if self._inputs is None or self._inputs[0] != tag:
            self._inputs = None
            g = torch.Generator().manual_seed(0)
            opts = dict(dtype=self.dtype, device=self.device)
            mk = lambda shape: torch.randn(shape, generator=g).to(**opts)  # noqa: E731 (randn: no 16-bit draws needed)
            self._inputs = (tag, _Inputs(mk(geom.input_shape(n)), mk(geom.weight_shape()), mk(geom.output_shape(n))))
        return self._inputs[1]

    def _step(self, geom, pass_, algorithm, n, divided):
        t = self._tensors(geom, n)
        a, b = {"forward": (t.x, t.w), "backward_data": (t.dy, t.w), "backward_filter": (t.dy, t.x)}[pass_]
        if not divided:
            return lambda: execute_step(pass_, algorithm, a, b, geom, None)
        dest = (torch.zeros if pass_ == "backward_filter" else torch.empty)(
            geom.result_shape(pass_, n), device=self.device,
            dtype=accumulator_dtype(self.dtype) if pass_ == "backward_filter" else self.dtype)
        return lambda: (execute_step(pass_, algorithm, a, b, geom, dest), None)[1]

    def _round(self, fn, best_key) -> list[float]:
        times = []
        for _ in range(self.repeats):
            t0 = self.clock()
            fn()
            times.append((self.clock() - t0) * 1e3)
            if times[0] > self.cutoff * self._best_ms.get(best_key, float("inf")):
                break
        return times

    def measure(self, geom: ConvGeometry, pass_: str, algorithm: str, n: int, divided: bool,
                limit_bytes: int | None = None, refresh: bool = False) -> MeasurementRecord:
        """The record of one configuration, measured now unless the cache can answer.

        ``refresh`` measures it again even if cached; the Measurer's own ``refresh`` does so
        once per Measurer.
        """
        key = self.key(geom, pass_, algorithm, n, divided)
        again = refresh or (self.refresh and key not in self._fresh)
        rec = None if again else self.cache.get(key)
        best_key = (geom, pass_, n, divided)
        if rec is not None and rec.time_ms is not None and rec.spread > self.spread_limit and key not in self._fresh:
            self.remeasured_noisy += 1  # measured while the machine was busy: do not trust it
            rec = None
        if rec is not None and (rec.time_ms is not None or (limit_bytes is not None and rec.workspace_bytes > limit_bytes)):
            if rec.time_ms is not None:
                self._best_ms[best_key] = min(self._best_ms.get(best_key, float("inf")), rec.time_ms)
            return rec
        self.measured += 1
        self._fresh.add(key)
        fn = self._step(geom, pass_, algorithm, n, divided)
        for _ in range(self.warmup):
            fn()
        result, peak = peak_extra_bytes(fn)
        if result is not None:  # undivided: the result is the layer's output, not workspace
            peak -= result.numel() * result.element_size()
        del result
        workspace = max(0, int(peak))
        if limit_bytes is not None and workspace > limit_bytes:
            rec = MeasurementRecord(None, 0, workspace)
        else:
            times = self._round(fn, best_key)
            total, best = len(times), min(times)
            for _ in range(self.retries):
                if spread(times) <= self.spread_limit:
                    break
                times = self._round(fn, best_key)
                total, best = total + len(times), min(best, min(times))
            if spread(times) > self.spread_limit:
                self.noisy.append(key)
            rec = MeasurementRecord(best, total, workspace, spread(times))
            self._best_ms[best_key] = min(self._best_ms.get(best_key, float("inf")), rec.time_ms)
        self.cache.put(key, rec)
        return rec

    def race(self, geom: ConvGeometry, pass_: str, n: int, divisions: list[list[tuple[str, int]]],
             rounds: int = 5) -> list[float]:
        """Minimum time (ms) of each whole division of ``n`` samples, timed in interleaved rounds.

        Used to confirm a divided choice against the undivided one before trusting a small
        predicted gain: both run on the same inputs, alternately, so load hits both alike.
        """
        from batchcraft.microbatching.execute import execute_pass

        t = self._tensors(geom, n)
        a, b = {"forward": (t.x, t.w), "backward_data": (t.dy, t.w), "backward_filter": (t.dy, t.x)}[pass_]
        best = [float("inf")] * len(divisions)
        for steps in divisions:  # warm-up
            execute_pass(pass_, steps, a, b, geom)
        for _ in range(max(1, rounds)):
            for i, steps in enumerate(divisions):
                t0 = time.perf_counter()
                execute_pass(pass_, steps, a, b, geom)
                best[i] = min(best[i], (time.perf_counter() - t0) * 1e3)
        return best
