"""Dynamic batching of single-instance requests into auto-batched calls.

Requests arrive one instance at a time from any number of threads (``submit`` returns a
``concurrent.futures.Future``). One worker thread gathers them under a :class:`BatchPolicy`
(full batch in instances or work, or the oldest request's maximum wait), runs each batch as one
``autobatch`` call through :func:`run_isolated` (a failing instance fails only its own request)
and completes each request's future with its own result.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from batchcraft.autobatching import AutoBatched, autobatch
from batchcraft.errors import BatchcraftError
from batchcraft.serving.gather import BatchPolicy
from batchcraft.serving.isolate import run_isolated


class BatcherClosedError(BatchcraftError, RuntimeError):
    """A request was submitted to a batcher that is closed or closing."""

    code = "batcher-closed"


class MonotonicClock:
    """The real clock: ``time.monotonic`` and a condition wait with a timeout."""

    def now(self) -> float:
        return time.monotonic()

    def wait(self, cond: threading.Condition, timeout_s: float) -> None:
        cond.wait(None if timeout_s == float("inf") else max(timeout_s, 0.0))


@dataclass
class BatcherStats:
    """What a batcher did. ``batch_sizes[k]``: instances in the k-th batch run."""

    requests: int = 0
    failed: int = 0
    batch_sizes: list = field(default_factory=list)

    @property
    def batches(self) -> int:
        return len(self.batch_sizes)

    @property
    def mean_batch(self) -> float:
        return sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else 0.0


@dataclass
class _Request:
    instance: Any
    work: float
    arrived_s: float
    future: Future


class DynamicBatcher:
    """Serve single-instance requests of an auto-batched function in dynamic batches.

    Args:
        fn (callable): per-instance function (wrapped with :func:`batchcraft.autobatch`) or an
            already auto-batched one.
        max_batch_size (int): instances per batch at most. Default: 32.
        max_batch_work (float | None): work units per batch at most (tokens, tree nodes), measured
            by ``work``. Default: None.
        max_wait_s (float): the longest a request waits for others to join its batch, seconds.
            Default: 0.005.
        work (callable | None): ``work(instance) -> float``. Default: ``len(instance)`` when
            ``max_batch_work`` is set, else 1 per instance.
        copy_outputs (bool): give each caller its own copy of tensor results (the batch's result
            tensors are then freed). Default: True.
        clock: an object with ``now() -> seconds`` and ``wait(condition, timeout_s)``; tests pass a
            fake one. Default: :class:`MonotonicClock`.
        **autobatch_options: passed to :func:`batchcraft.autobatch` when ``fn`` is not wrapped yet.
    Use:
        ``submit(x)`` -> Future of ``fn(x)``; ``batcher(x)`` waits for it. Close with ``close()`` or
        a ``with`` block: waiting requests are still served, then the worker thread ends.
    Raises:
        BatcherClosedError: ``submit`` after ``close``.
    Source:
        Dynamic batching as in Clipper (Crankshaw et al., NSDI 2017, §4.3) and TensorFlow Serving;
        each batch is one auto-batched call (ACRoBat, arXiv 2305.10611).
    Example:
        >>> lin = torch.nn.Linear(3, 2)
        >>> with DynamicBatcher(lambda x: lin(x), max_wait_s=0.001) as serve:
        ...     futures = [serve.submit(torch.randn(3)) for _ in range(8)]   # from any thread
        ...     ys = [f.result() for f in futures]                         # 8 tensors (2,)
    """

    def __init__(self, fn: Callable, *, max_batch_size: int = 32, max_batch_work: float | None = None,
                 max_wait_s: float = 0.005, work: Callable | None = None, copy_outputs: bool = True,
                 clock=None, name: str = "batchcraft-batcher", **autobatch_options):
        self.policy = BatchPolicy(max_batch_size, max_batch_work, max_wait_s)
        if isinstance(fn, AutoBatched) and autobatch_options:
            raise ValueError(f"DynamicBatcher: fn is auto-batched already; options "
                             f"{sorted(autobatch_options)} belong in its autobatch() call")
        self.fn = fn if isinstance(fn, AutoBatched) else autobatch(fn, **autobatch_options)
        if work is None:
            work = (lambda x: float(len(x))) if max_batch_work is not None else (lambda x: 1.0)
        self._work = work
        self._copy = copy_outputs
        self._clock = clock or MonotonicClock()
        self._cond = threading.Condition()
        self._pending: deque[_Request] = deque()
        self._closing = False
        self.stats = BatcherStats()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- callers' side -------------------------------------------------------------------------
    def submit(self, instance) -> Future:
        """Queue one instance; the future gets ``fn(instance)`` or the exception it raised."""
        w = float(self._work(instance))
        fut: Future = Future()
        with self._cond:
            if self._closing:
                raise BatcherClosedError("DynamicBatcher.submit: the batcher is closed")
            self._pending.append(_Request(instance, w, self._clock.now(), fut))
            self.stats.requests += 1
            self._cond.notify_all()
        return fut

    def __call__(self, instance, timeout: float | None = None):
        """``fn(instance)``, served in a batch with whatever else arrives meanwhile."""
        return self.submit(instance).result(timeout)

    def close(self, cancel_pending: bool = False, timeout: float | None = None) -> None:
        """Stop accepting requests, serve (or cancel) the waiting ones, end the worker thread.

        Raises:
            TimeoutError: the worker thread did not end within ``timeout`` seconds (a batch is
                still running); it ends when that batch does.
        """
        with self._cond:
            self._closing = True
            if cancel_pending:
                while self._pending:
                    self._pending.popleft().future.cancel()
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"DynamicBatcher.close: the worker thread still runs after {timeout} s")

    @property
    def closed(self) -> bool:
        return self._closing and not self._thread.is_alive()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- worker thread -------------------------------------------------------------------------
    def _next_batch(self) -> list[_Request] | None:
        """Wait (under the lock) until the policy closes a batch; None once closed and drained."""
        with self._cond:
            while True:
                if not self._pending and self._closing:
                    return None
                oldest = self._clock.now() - self._pending[0].arrived_s if self._pending else 0.0
                n, wait_s = self.policy.decide([r.work for r in self._pending], oldest, self._closing)
                if n:
                    batch = [self._pending.popleft() for _ in range(n)]
                    # a caller may have cancelled its future while it waited
                    return [r for r in batch if r.future.set_running_or_notify_cancel()]
                self._clock.wait(self._cond, wait_s)

    def _loop(self) -> None:
        batch: list[_Request] = []
        try:
            while (batch := self._next_batch()) is not None:
                if not batch:
                    continue
                outcomes = run_isolated(self.fn, [r.instance for r in batch], copy=self._copy)
                self.stats.batch_sizes.append(len(batch))
                for r, o in zip(batch, outcomes):
                    if o.error is None:
                        r.future.set_result(o.value)
                    else:
                        self.stats.failed += 1
                        r.future.set_exception(o.error)
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            for r in batch or ():
                if not r.future.done():
                    r.future.set_exception(exc)
            with self._cond:
                self._closing = True
                while self._pending:
                    fut = self._pending.popleft().future
                    if fut.set_running_or_notify_cancel():
                        fut.set_exception(exc)
            raise
