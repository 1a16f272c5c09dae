"""torch's OpenMP team for the fused kernels (``_fused.c``), found in the process and checked.

A fused elementwise kernel, a segment sum or a row copy runs on the calling thread alone, while
torch runs the products around it on its intra-op team (OpenMP in torch's Linux wheels). On the
2-core machine the other core idles through a quarter of a TreeLSTM batch's kernel time: the
fused gates of 600 rows take 0.35 ms on one core.

:func:`install` hands ``_fused`` the entry points of the OpenMP runtime torch itself loaded
(``GOMP_parallel``, the call a ``#pragma omp parallel`` compiles to, and ``omp_get_max_threads``
/ ``omp_get_thread_num`` / ``omp_get_num_threads``), found by soname among the libraries already
in the process, so the team is torch's own: no thread of batchcraft's, none to wake (torch's
workers still spin after the last product) and as many threads as ``torch.get_num_threads()`` in
the calling thread, since torch's OpenMP backend reads the same ``omp_get_max_threads``. A call
splits rows (a kernel) or columns (a segment sum, a row copy), never the order of the additions
into one value, so the results are the same bits on any number of threads.

It is used only where torch's parallel backend is OpenMP and the runtime answers as torch does;
``BATCHCRAFT_FUSED_THREADS=1`` (read at import) keeps every call on one thread. In a process
forked after install the kernels run on one thread (an OpenMP team does not survive a fork).
torch's own parallel kernels in such a child hang as they do after any multi-threaded torch work
in the parent (libgomp's team is gone); with batchcraft's kernels that can now happen after a
parent that ran only them on several threads. ``torch.set_num_threads(1)`` in the child, as
DataLoader workers do, avoids it (a hostile pass's note, stop 42).
"""

from __future__ import annotations

import ctypes
import os

import torch

#: sonames of the OpenMP runtimes torch builds link (GNU, Intel, LLVM); each exports GOMP_parallel
SONAMES = ("libgomp.so.1", "libiomp5.so", "libomp.so")
ENTRY_POINTS = ("GOMP_parallel", "omp_get_max_threads", "omp_get_thread_num", "omp_get_num_threads")

#: why the kernels run on one thread ("" when torch's team runs them)
reason = "not installed"
_pid = 0


def _addresses(symbols) -> tuple | None:
    """The addresses of ``symbols`` in the OpenMP runtime torch loaded (never loads one): one of
    :data:`SONAMES` already in the process, exporting them all, whose ``omp_get_max_threads`` is
    torch's thread count in this thread (the runtime torch asks)."""
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:", 1)[-1].split("\n", 1)[0]:
        return None
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    for name in SONAMES:
        try:
            lib = ctypes.CDLL(name, mode=mode)
        except OSError:  # not in the process
            continue
        try:
            addrs = tuple(ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value for sym in symbols)
            max_threads = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value)
        except AttributeError:
            continue
        if all(addrs) and max_threads() == torch.get_num_threads():
            return addrs
    return None


def find() -> tuple | None:
    """The addresses of :data:`ENTRY_POINTS` in the OpenMP runtime torch loaded, or None."""
    return _addresses(ENTRY_POINTS)


_STATE_FUNCS = None  # torch's runtime's omp_get_* of STATE_QUERIES, () where not found
#: what :func:`runtime_state` asks torch's OpenMP runtime, in order
STATE_QUERIES = ("omp_get_dynamic", "omp_get_thread_limit", "omp_get_max_threads", "omp_get_max_active_levels",
                 "omp_get_active_level")


def runtime_state() -> tuple | None:
    """``(dynamic, thread limit, max threads, max active levels, active level)`` as torch's OpenMP
    runtime holds them for the calling thread (:data:`STATE_QUERIES`), or None where torch's
    parallel backend is not a loaded OpenMP runtime. These are the values the runtime uses: it
    reads ``OMP_DYNAMIC``, ``OMP_THREAD_LIMIT`` and ``OMP_MAX_ACTIVE_LEVELS`` once, when it loads
    (a later change of ``os.environ`` does not reach it), and ``omp_set_dynamic`` or
    ``omp_set_max_active_levels`` change them at run time."""
    global _STATE_FUNCS
    if _STATE_FUNCS is None:
        addrs = _addresses(STATE_QUERIES)
        _STATE_FUNCS = () if addrs is None else tuple(ctypes.CFUNCTYPE(ctypes.c_int)(a) for a in addrs)
    if not _STATE_FUNCS:
        return None
    return tuple(f() for f in _STATE_FUNCS)


def full_team(state) -> bool:
    """Does a parallel region started from here get the team that ``omp_get_max_threads`` promises,
    by :func:`runtime_state`'s ``state``? Not under dynamic adjustment (the team follows the
    load), a thread limit below the thread count, nested inside an active region, or with no
    active levels allowed: oneDNN then plans for threads that never run and leaves rows
    unwritten (reliability #211, #223)."""
    dynamic, limit, threads, max_levels, level = state
    return not dynamic and limit >= threads and level == 0 and max_levels >= 1


def team_ok() -> bool:
    """May a oneDNN product start here and now (:func:`full_team` of the current state)? True where
    the runtime cannot be asked: the agreement checks alone decide then. A choice made or checked
    earlier in the process does not hold after ``omp_set_dynamic(1)``, ``omp_set_max_active_levels(0)``
    or inside an active parallel region (#223). About 2.7 µs here (five runtime queries)."""
    state = runtime_state()
    return state is None or full_team(state)


def install(fused) -> str:
    """Give ``fused`` (the ``_fused`` module) torch's OpenMP entry points; returns :data:`reason`."""
    global reason, _pid
    if os.environ.get("BATCHCRAFT_FUSED_THREADS", "").strip() == "1":
        reason = "BATCHCRAFT_FUSED_THREADS=1"
    else:
        addrs = find()
        if addrs is None:
            reason = "torch's parallel backend is not a loaded OpenMP runtime"
        else:
            fused.set_openmp(*addrs)
            first = _pid == 0
            reason, _pid = "", os.getpid()
            if first and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=lambda: _forked(fused))
            return reason
    fused.set_openmp(0, 0, 0, 0)
    return reason


def _forked(fused) -> None:
    global reason
    if reason == "" and os.getpid() != _pid:
        fused.set_openmp(0, 0, 0, 0)
        reason = "a forked process (the OpenMP team stays with the parent)"


def uninstall(fused) -> None:
    """One thread for every call (tests compare the two)."""
    global reason
    fused.set_openmp(0, 0, 0, 0)
    reason = "uninstalled"


__all__ = ["install", "uninstall", "find", "runtime_state", "full_team", "team_ok", "STATE_QUERIES", "reason", "SONAMES", "ENTRY_POINTS"]
