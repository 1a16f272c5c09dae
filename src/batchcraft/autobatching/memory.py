"""Memory retention: the batched working set stays mapped from one call to the next.

A batched group's result is one large tensor (MV-RNN at hidden 128: ``(N, 128, 128)`` float32
matrices, 64 KiB a row, more than 32 MiB a group). glibc's ``malloc`` serves a request above
its mmap threshold (32 MiB at most, however it adapts) with fresh pages from ``mmap`` and gives
them back with ``munmap`` on free, so each call of an auto-batched function faults its whole
working set in again, page by page. Measured on this project's 2-core VM: 73,000 minor faults
and 0.7 s of kernel time per MV-RNN h128 call (64 sentences) whose own user time was 0.25 s;
with the pages kept, 64 faults and a 1.5-3x faster call. DyNet avoids the same cost with
memory pools allocated once and bump-allocated per computation (``dynet/aligned-mem-pool``,
``exec.cc``); PyTorch's CUDA caching allocator does it on GPUs; on the CPU PyTorch has none.

What this module does, only where the C library is glibc (elsewhere nothing):

* while an auto-batched call runs, ``mallopt(M_MMAP_MAX, 0)``: requests come from the heap,
  whose freed memory is reused by the next call instead of being unmapped (glibc still falls
  back to ``mmap`` where the heap cannot grow);
* once per process, ``M_TRIM_THRESHOLD`` = :data:`TRIM_THRESHOLD` (free memory at the top of the
  heap is returned to the system only above it) and ``M_MMAP_THRESHOLD`` = 32 MiB, the largest
  value glibc's own adaptive threshold reaches (setting one parameter turns the adaptation off).

Between calls the process keeps up to about the largest call's working set mapped (the cost
a caching allocator always has); :func:`release` hands free memory back (``malloc_trim``).
``autobatch(..., retain_memory=False)`` leaves ``malloc`` as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
DEFAULT_MMAP_MAX = 65536  # glibc's default number of mmap'd chunks
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept mapped between calls

_lock = threading.Lock()
_active = 0  # calls (any thread) inside retain()
_configured = False


def _load_glibc():
    """The C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version  # glibc only
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return libc


_libc = _load_glibc()


def _after_fork_in_child() -> None:
    """A child forked during a call (DataLoader workers, ``multiprocessing`` with fork) runs no
    call of its parent: it starts with no call inside, glibc's default ``M_MMAP_MAX`` and a lock
    that no thread of the parent may still hold."""
    global _active, _lock
    _lock = threading.Lock()
    if _active and _libc is not None:
        _libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
    _active = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def available() -> bool:
    """True where retention works (the C library is glibc)."""
    return _libc is not None


class retain:
    """Context manager around one auto-batched call: heap memory, not mmap, while it runs.

    Nested and concurrent calls (several threads) share one setting: ``M_MMAP_MAX`` goes back
    to glibc's default when the last of them exits. ``retained`` tells whether it applied.
    """

    __slots__ = ("enabled", "retained")

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.retained = False

    def __enter__(self):
        global _active, _configured
        if not (self.enabled and _libc is not None):
            return self
        with _lock:
            if not _configured:
                _libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                _libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                _configured = True
            if _active == 0:
                _libc.mallopt(M_MMAP_MAX, 0)
            _active += 1
        self.retained = True
        return self

    def __exit__(self, *exc):
        global _active
        if self.retained:
            with _lock:
                _active -= 1
                if _active == 0:
                    _libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        return False


def release() -> bool:
    """Return the free memory that retention kept to the system (glibc ``malloc_trim(0)``).

    Returns:
        bool: True when memory was returned (False: nothing to return, or not glibc).
    """
    return bool(_libc is not None and _libc.malloc_trim(0))


def active_calls() -> int:
    """Calls inside :class:`retain` now (for tests)."""
    return _active


__all__ = ["retain", "release", "available", "active_calls", "TRIM_THRESHOLD", "MMAP_THRESHOLD"]
