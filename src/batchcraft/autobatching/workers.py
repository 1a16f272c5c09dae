"""Idle OpenMP workers put to sleep before a long recording.

After a parallel region, GNU OpenMP's worker threads spin for a while before they sleep
(``GOMP_SPINCOUNT``, 300,000 rounds of ``pause`` by default: several milliseconds). An
auto-batched call records in Python on one core right after the previous call's kernels ran on
all of them, and on this project's 2-core VM a worker spinning on the other core slows that
recording by 20-30% (TreeLSTM hidden 256, 2 threads: 4.9 against 3.6 µs a node with
``GOMP_SPINCOUNT=30000``; per-call pause below: 12.8 against 14.0-14.8 µs a node in all, same
process). The spin count is read once, when torch loads OpenMP, so a library cannot lower it;
OpenMP 5.0's ``omp_pause_resource_all(omp_pause_soft)`` instead ends the calling thread's idle
team (GNU) or puts it to sleep (LLVM / Intel), and the next parallel region starts it again
(about 0.1 ms here). :func:`quiet` calls it before a recording expected to last at least
:data:`MIN_RECORD_S`, where that start-up is small beside what the spinning costs.

Only the calling thread's own team is affected (OpenMP keeps one per master thread); a thread
already inside a parallel region is refused by the runtime. Where no OpenMP runtime with that
entry point is loaded (another platform, an old runtime), :func:`quiet` does nothing.
``autobatch(..., quiet_workers=False)`` turns it off.
"""

from __future__ import annotations

import ctypes
import os

#: Seconds of recording (the previous call's) from which a call first puts idle workers to sleep.
MIN_RECORD_S = 1e-3
OMP_PAUSE_SOFT = 1
_RUNTIMES = ("libgomp", "libomp", "libiomp5")


def _loaded_runtime():
    """``omp_pause_resource_all`` of the OpenMP runtime this process has loaded, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = [line.split(None, 5)[-1].strip() for line in f if any(r in line for r in _RUNTIMES)]
    except OSError:
        return None
    for path in dict.fromkeys(paths):
        if not path.startswith("/"):
            continue
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
            fn = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None


_pause = None
_looked = False


def quiet(expected_record_s: float, threads: int) -> bool:
    """Put this thread's idle OpenMP team to sleep before a recording of ``expected_record_s``.

    Args:
        expected_record_s (float): how long the recording is expected to take, in seconds (the
            previous call's); below :data:`MIN_RECORD_S` nothing is done.
        threads (int): intra-op threads (``torch.get_num_threads()``); with 1 there is no team.
    Returns:
        bool: True when the runtime was asked and accepted.
    """
    global _pause, _looked
    if threads <= 1 or expected_record_s < MIN_RECORD_S:
        return False
    if not _looked:
        _pause, _looked = _loaded_runtime(), True
    return _pause is not None and _pause(OMP_PAUSE_SOFT) == 0


__all__ = ["quiet", "MIN_RECORD_S"]
