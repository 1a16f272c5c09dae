"""Process-level knobs set through the environment before the interpreter starts.

* **Memory allocator** (``allocator``): ``"jemalloc"`` or ``"tcmalloc"`` through ``LD_PRELOAD``,
  as PyTorch's ``torch.backends.xeon.run_cpu`` does (with its ``MALLOC_CONF`` for jemalloc), when
  the library is installed (e.g. Debian's ``libjemalloc2`` / ``libtcmalloc-minimal4``); else the
  knob is not offered, and a saved configuration that names it is a clear error. The library is
  looked up where ``run_cpu`` looks (the Python prefix, ``$CONDA_PREFIX``, ``$VIRTUAL_ENV``,
  ``~/.local/lib``, ``/usr/local/lib{,64}``, ``/usr/lib{,64}``), in the multiarch directory
  (``/usr/lib/x86_64-linux-gnu``) and in the dynamic linker's cache.
* **OpenMP wait policy** (``omp_wait_policy``): what an OpenMP thread does between parallel
  regions. ``"passive"`` sleeps at once (OMP_WAIT_POLICY=PASSIVE, and KMP_BLOCKTIME=0 for Intel's
  runtime), ``"active"`` spins (OMP_WAIT_POLICY=ACTIVE, KMP_BLOCKTIME=infinite); ``"default"`` sets
  nothing (GNU OpenMP, which PyTorch's wheels use, spins a while and then sleeps).

Both must be in the environment before the process starts (the allocator is chosen by the
dynamic linker, the wait policy when the OpenMP runtime loads), so they are process-level: the
tuner measures them in their own worker processes.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import sys
import sysconfig
from pathlib import Path

from batchcraft.errors import ConfigurationError

__all__ = ["ALLOCATORS", "WAIT_POLICIES", "find_allocator", "available_allocators", "knob_env"]

ALLOCATORS = ("default", "jemalloc", "tcmalloc")
WAIT_POLICIES = ("default", "passive", "active")

_LIB_NAMES = {
    "jemalloc": ("libjemalloc.so", "libjemalloc.so.2"),
    "tcmalloc": ("libtcmalloc.so", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc_minimal.so.4"),
}
_LINKER_NAMES = {"jemalloc": ("jemalloc",), "tcmalloc": ("tcmalloc", "tcmalloc_minimal")}
# torch.backends.xeon.run_cpu's jemalloc settings
JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:9000000000,muzzy_decay_ms:9000000000"


def _search_dirs() -> list[Path]:
    dirs = [Path(sys.prefix) / "lib"]
    for var in ("CONDA_PREFIX", "VIRTUAL_ENV"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]) / "lib")
    dirs += [Path.home() / ".local" / "lib", Path("/usr/local/lib"), Path("/usr/local/lib64"),
             Path("/usr/lib"), Path("/usr/lib64")]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        dirs += [Path("/usr/lib") / multiarch, Path("/lib") / multiarch]
    return dirs


@functools.lru_cache(maxsize=None)
def find_allocator(name: str) -> str | None:
    """Path (or linker name) of allocator ``name``'s shared library, None if not installed.

    Raises:
        ConfigurationError: unknown allocator name.
    """
    if name not in ALLOCATORS:
        raise ConfigurationError(f"allocator must be one of {ALLOCATORS}, got {name!r}")
    if name == "default":
        return None
    for d in _search_dirs():
        for lib in _LIB_NAMES[name]:
            if (d / lib).is_file():
                return str(d / lib)
    for short in _LINKER_NAMES[name]:
        found = ctypes.util.find_library(short)
        if found:
            return found
    return None


def available_allocators() -> tuple[str, ...]:
    """"default" and every allocator installed here."""
    return ("default", *[a for a in ALLOCATORS[1:] if find_allocator(a)])


def knob_env(allocator: str = "default", omp_wait_policy: str = "default",
             base_env: dict | None = None) -> dict[str, str]:
    """Environment variables that set the two knobs (added to ``base_env``'s LD_PRELOAD, if any).

    Raises:
        ConfigurationError: unknown value, or an allocator that is not installed (the hint says
            what to install).
    """
    if omp_wait_policy not in WAIT_POLICIES:
        raise ConfigurationError(f"omp_wait_policy must be one of {WAIT_POLICIES}, got {omp_wait_policy!r}")
    env: dict[str, str] = {}
    if allocator != "default":
        lib = find_allocator(allocator)
        if lib is None:
            pkg = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}[allocator]
            raise ConfigurationError(
                f"allocator {allocator!r} is not installed on this machine (looked in "
                f"{', '.join(str(d) for d in _search_dirs())} and the linker cache)",
                hint=f"install it (e.g. apt-get install {pkg}) or use a configuration without it")
        preload = (base_env or os.environ).get("LD_PRELOAD", "")
        env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
        if allocator == "jemalloc":
            env["MALLOC_CONF"] = JEMALLOC_CONF
    if omp_wait_policy == "passive":
        env.update(OMP_WAIT_POLICY="PASSIVE", KMP_BLOCKTIME="0")
    elif omp_wait_policy == "active":
        env.update(OMP_WAIT_POLICY="ACTIVE", KMP_BLOCKTIME="infinite")
    return env
