"""Peak extra host memory of a call, measured from the CPU allocator's own events.

What is measured: with ``torch.profiler`` memory profiling on, every allocation and free made
through c10's CPU allocator is reported with its address and size (tensors, oneDNN scratchpads
and weight reorders, slow_conv2d's columns, FFT buffers). We replay those events in time order
and keep the maximum of the bytes of blocks *allocated during the call* that are live at once:
the call's own workspace. Memory obtained by a library's own ``malloc`` outside c10 is not seen.

Frees of blocks the call did not allocate are ignored. They are not the call's to spend: a
garbage collection inside the call, or a tensor of the caller's dropped there, must not lower
the measured workspace (c10's reporter even reports such a free with a stale size when the
address was last allocated under an earlier profile). A free stamped before its own allocation
(clocks of different cores) leaves the block counted as live: the error is on the safe side.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable

__all__ = ["peak_extra_bytes", "peak_of_events"]


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto writes a 'profiler_start/stop' line to fd 2 at every start and stop (its log level
    is read only when torch loads); hide fd 2 for that moment so progress bars stay readable."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (embedded interpreters): just run
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_of_events(events) -> int:
    """Peak bytes live at once of blocks allocated within ``events``.

    ``events``: iterable of ``(time_ns, address, nbytes)``, nbytes > 0 for an allocation and < 0
    for a free. Frees of addresses not allocated within the events are ignored.
    """
    live: dict[int, int] = {}
    total = peak = 0
    for _, addr, nbytes in sorted(events, key=lambda e: e[0]):
        if nbytes > 0:
            total += nbytes - live.get(addr, 0)  # an address allocated twice: its free was lost
            live[addr] = nbytes
            peak = max(peak, total)
        elif nbytes < 0 and addr in live:
            total -= live.pop(addr)
    return peak


def _allocation_events(prof) -> list[tuple[int, int, int]]:
    """(time_ns, address, nbytes) of every CPU allocator event of a stopped profile."""
    results = prof.profiler.kineto_results
    stack = list(results.experimental_event_tree())
    out = []
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        f = e.extra_fields
        if hasattr(f, "alloc_size") and hasattr(f, "ptr"):
            out.append((e.start_time_ns, int(f.ptr), int(f.alloc_size)))
    return out


def peak_extra_bytes(fn: Callable[[], object]) -> tuple[object, int]:
    """Run ``fn()`` once and return ``(its result, peak workspace bytes of the call)``.

    The workspace: the most bytes that blocks allocated during the call held at once (see the
    module docstring). The result is still alive when the peak is taken, so bytes of the result
    count; callers that own the result as an output subtract its size.
    """
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr():
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        prof.start()
    try:
        result = fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    return result, peak_of_events(_allocation_events(prof))
