"""When to close a batch of waiting requests, and how many to take: the batching policy.

Pure decisions over the waiting requests' work and the oldest one's age, with no clock and
no thread, so that they are tested with made-up times. The rule is the one of Clipper's and
TensorFlow Serving's dynamic batching (Crankshaw et al., NSDI 2017, §4.3; TF Serving's
``BatchingSession``: ``max_batch_size`` and ``batch_timeout_micros``), with the batch measured in
instances or in work units (tree nodes, tokens), since an auto-batched call's cost follows its work.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPolicy:
    """Close a batch when it is full (instances or work) or its oldest request waited long enough.

    Args:
        max_batch_size (int): at most this many instances per batch. Default: 32.
        max_batch_work (float | None): at most this much work per batch (an instance heavier than
            this runs alone). Default: None (no limit).
        max_wait_s (float): longest time the first request of a batch waits for others, seconds.
            0 serves whatever is waiting at once. Default: 0.005.
    Raises:
        ValueError: ``max_batch_size < 1``, ``max_batch_work <= 0`` or ``max_wait_s < 0``.
    """

    max_batch_size: int = 32
    max_batch_work: float | None = None
    max_wait_s: float = 0.005

    def __post_init__(self):
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"BatchPolicy: max_batch_size must be an int >= 1, got {self.max_batch_size!r}")
        if self.max_batch_work is not None and not self.max_batch_work > 0:
            raise ValueError(f"BatchPolicy: max_batch_work must be > 0 or None, got {self.max_batch_work!r}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"BatchPolicy: max_wait_s must be >= 0 seconds, got {self.max_wait_s!r}")

    def take(self, works: list[float]) -> int:
        """How many of the waiting requests (first come first) fit one batch: at least 1."""
        n, load = 0, 0.0
        for w in works[: self.max_batch_size]:
            if n and self.max_batch_work is not None and load + w > self.max_batch_work:
                break
            n, load = n + 1, load + w
        return n

    def full(self, works: list[float]) -> bool:
        """True when the waiting requests already fill a batch (adding more could not help)."""
        if len(works) >= self.max_batch_size:
            return True
        return self.max_batch_work is not None and sum(works) >= self.max_batch_work

    def decide(self, works: list[float], oldest_wait_s: float, closing: bool = False) -> tuple[int, float]:
        """``(n, wait_s)``: run the first ``n`` requests now (``n > 0``), or wait ``wait_s`` more.

        Args:
            works: work of each waiting request, oldest first.
            oldest_wait_s: how long the oldest has waited, seconds.
            closing: the batcher is shutting down: run what waits without waiting.
        Returns:
            ``(n, 0.0)`` to run a batch, ``(0, seconds)`` to wait at most that long (a new
            request may end the wait earlier), ``(0, inf)`` when nothing waits.
        """
        if not works:
            return 0, float("inf")
        if closing or self.full(works) or oldest_wait_s >= self.max_wait_s:
            return self.take(works), 0.0
        return 0, self.max_wait_s - oldest_wait_s
