"""Describe the machine a measurement was taken on."""

from __future__ import annotations

import functools
import os
import platform


@functools.lru_cache(maxsize=1)  # read once a process: kernel choices ask at every check
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cache_dir():
    """Where measured choices persist: ``$BATCHCRAFT_CACHE_DIR``, else ``$XDG_CACHE_HOME/batchcraft``,
    else ``~/.cache/batchcraft`` (a :class:`pathlib.Path`; not created here). An empty variable
    counts as unset (not the current directory)."""
    from pathlib import Path

    root = os.environ.get("BATCHCRAFT_CACHE_DIR") or None
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchcraft"
    return Path(root)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says."""
    return _cpu_model()


def busy_cpus(window_s: float = 0.25) -> float:
    """CPUs kept busy (by any process) over ``window_s`` seconds, from ``/proc/stat``: 0.0 to
    ``os.cpu_count()``; 0.0 where it cannot be read. ``batchcraft run`` warns above 0.5 before timing."""
    import time

    def sample():
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        return v[3] + (v[4] if len(v) > 4 else 0), sum(v)  # idle + iowait, total

    try:
        i0, t0 = sample()
        time.sleep(window_s)
        i1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return (1.0 - (i1 - i0) / (t1 - t0)) * (os.cpu_count() or 1) if t1 > t0 else 0.0


def machine_info() -> dict:
    """Return a JSON-able description: CPU, usable cores, torch version and threads, GPU."""
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    info = {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
    }
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
