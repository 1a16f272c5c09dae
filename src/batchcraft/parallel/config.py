"""Parallel configurations and the machine's usable cores.

A :class:`ParallelConfig` is one point of the search space of Wang et al. (arXiv 1908.04705):
model *instances* (processes), *inter-op threads* (pools running independent branches, see
:mod:`batchcraft.parallel.executor`), *intra-op threads* (each pool's OpenMP team) and the batch
size. Core counts are affinity-aware: a process restricted by ``taskset``, a container's cpuset or a
CPU quota sees fewer cores than ``os.cpu_count()`` reports (PyTorch #64864, #49971).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchcraft.errors import ConfigurationError

__all__ = ["ParallelConfig", "usable_cpus", "physical_cores", "sockets", "cpu_quota"]


def cpu_quota() -> float | None:
    """CPUs allowed by a cgroup v2 quota (``cpu.max``), or None when unlimited / unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def usable_cpus() -> list[int]:
    """Logical CPUs this process may run on (its affinity mask), trimmed to a cgroup CPU quota."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = list(range(os.cpu_count() or 1))
    quota = cpu_quota()
    if quota is not None:
        cpus = cpus[: max(1, math.ceil(quota))]
    return _compact_order(cpus)


def _topology(cpu: int) -> tuple[int, int]:
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((base / "physical_package_id").read_text()), int((base / "core_id").read_text())
    except (OSError, ValueError):
        return 0, cpu


def _compact_order(cpus: list[int]) -> list[int]:
    # "Compact": hyper-thread siblings next to each other, sockets one after the other, so that a
    # contiguous slice of this list is a set of whole cores on one socket when possible.
    return sorted(cpus, key=lambda c: (*_topology(c), c))


def physical_cores(cpus: list[int] | None = None) -> int:
    """Physical cores among ``cpus`` (default: the usable CPUs)."""
    cpus = usable_cpus() if cpus is None else cpus
    return len({_topology(c) for c in cpus}) or 1


def sockets(cpus: list[int] | None = None) -> int:
    """Sockets (packages) among ``cpus`` (default: the usable CPUs)."""
    cpus = usable_cpus() if cpus is None else cpus
    return len({_topology(c)[0] for c in cpus}) or 1


@dataclass
class ParallelConfig:
    """One parallel configuration for inference of one model.

    Attributes:
        instances (int): worker processes, each with its own copy of the model (>= 1).
        inter_op_threads (int): pools running independent branches per instance (>= 1; 1 = eager).
        intra_op_threads (int | None): OpenMP threads per pool (>= 1), or None for PyTorch's
            default (then nothing is set and the process is not pinned).
        batch_size (int): items per forward call (>= 1).
        pin (bool): pin each instance to its own contiguous block of cores. Default: True.
        env (dict[str, str]): extra environment for the instances (e.g. KMP_AFFINITY).
        label (str): name for tables ("tuned", "intel-recommended", ...).
    """

    instances: int = 1
    inter_op_threads: int = 1
    intra_op_threads: int | None = None
    batch_size: int = 1
    pin: bool = True
    env: dict[str, str] = field(default_factory=dict)
    label: str = ""

    @property
    def threads_per_instance(self) -> int | None:
        """inter-op x intra-op threads of one instance, None when left to PyTorch."""
        if self.intra_op_threads is None:
            return None
        return self.inter_op_threads * self.intra_op_threads

    def validate(self, cpus: list[int] | None = None, *, oversubscribe: bool = False) -> None:
        """Check the configuration against the usable CPUs.

        Raises:
            ConfigurationError: a count below 1, or (unless ``oversubscribe``) more threads than
                usable cores: instances x inter-op x intra-op threads > len(cpus).
        """
        cpus = usable_cpus() if cpus is None else cpus
        for name in ("instances", "inter_op_threads", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigurationError(f"ParallelConfig: {name} must be an int >= 1, got {v!r}")
        v = self.intra_op_threads
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigurationError(f"ParallelConfig: intra_op_threads must be an int >= 1 or None, got {v!r}")
        if self.instances > len(cpus) and (self.pin or not oversubscribe):
            raise ConfigurationError(
                f"ParallelConfig: {self.instances} instances but only {len(cpus)} usable cores "
                f"(affinity mask {cpus})",
                hint="use at most one instance per usable core")
        per = self.threads_per_instance
        if per is not None and not oversubscribe and self.instances * per > len(cpus):
            raise ConfigurationError(
                f"ParallelConfig: {self.instances} instances x {self.inter_op_threads} inter-op x "
                f"{self.intra_op_threads} intra-op threads = {self.instances * per} threads but only "
                f"{len(cpus)} usable cores (affinity mask {cpus})",
                hint="lower a thread count; oversubscribed cores slow every thread down")

    def cpus_for(self, instance: int, cpus: list[int] | None = None) -> list[int] | None:
        """CPUs instance ``instance`` is pinned to (a contiguous compact block), or None if unpinned."""
        if not self.pin or self.intra_op_threads is None:
            return None
        cpus = usable_cpus() if cpus is None else cpus
        block = max(1, len(cpus) // self.instances)
        return cpus[instance * block: (instance + 1) * block] or cpus[-block:]

    def thread_env(self) -> dict[str, str]:
        """Environment one instance gets before anything loads OpenMP / MKL."""
        env = dict(self.env)
        if self.intra_op_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.intra_op_threads)
            env["MKL_NUM_THREADS"] = str(self.intra_op_threads)
        env["BATCHCRAFT_INTER_OP_THREADS"] = str(self.inter_op_threads)
        env["BATCHCRAFT_INTRA_OP_THREADS"] = "" if self.intra_op_threads is None else str(self.intra_op_threads)
        env["BATCHCRAFT_BATCH_SIZE"] = str(self.batch_size)
        env["BATCHCRAFT_INSTANCES"] = str(self.instances)
        return env

    def key(self) -> tuple:
        """What a worker process is started with (everything but the batch size)."""
        return (self.instances, self.inter_op_threads, self.intra_op_threads, self.pin,
                tuple(sorted(self.env.items())))

    def short(self) -> str:
        intra = "default" if self.intra_op_threads is None else str(self.intra_op_threads)
        return f"{self.instances}x(inter {self.inter_op_threads}, intra {intra}) b={self.batch_size}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ConfigurationError(f"ParallelConfig: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps({"parallel_config": self.to_dict()}, indent=2) + "\n")

    @classmethod
    def load(cls, path) -> "ParallelConfig":
        """Read a configuration saved by :meth:`save` or by ``batchcraft tune`` (key ``best``)."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigurationError(f"ParallelConfig.load: no such file {str(p)!r}",
                                     hint="create one with `batchcraft tune --model NAME`") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigurationError(f"ParallelConfig.load: cannot read {str(p)!r}: {exc}") from None
        for key in ("parallel_config", "best"):
            if isinstance(data, dict) and isinstance(data.get(key), dict):
                data = data[key]
                break
        if not isinstance(data, dict):
            raise ConfigurationError(f"ParallelConfig.load: {str(p)!r} holds no configuration object")
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls.from_dict(data)
