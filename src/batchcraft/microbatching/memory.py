"""Peak extra host memory of a call, measured from the CPU allocator's own events.

What is measured: with ``torch.profiler`` memory profiling on, every allocation and free made
through c10's CPU allocator is reported with its size (tensors, oneDNN scratchpads and weight
reorders, slow_conv2d's columns, FFT buffers). We replay those events in order and keep the
maximum of the running sum: the peak number of bytes allocated during the call above what was
live when it started. Memory obtained by a library's own ``malloc`` outside c10 is not seen.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable

__all__ = ["peak_extra_bytes"]


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


def peak_extra_bytes(fn: Callable[[], object]) -> tuple[object, int]:
    """Run ``fn()`` once and return ``(its result, peak extra bytes during the call)``.

    The result is still alive when the peak is taken, so bytes of the result count; callers
    that own the result as an output subtract its size.
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
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return result, peak
