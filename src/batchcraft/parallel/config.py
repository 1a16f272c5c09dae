"""Parallel configurations and the machine's usable cores.

A :class:`ParallelConfig` is one point of the search space of Wang et al. (arXiv 1908.04705):
model *instances* (processes), *inter-op threads* (pools running independent branches, see
:mod:`batchcraft.parallel.executor`), *intra-op threads* (each pool's OpenMP team) and the batch
size. Core counts are affinity-aware: a process restricted by ``taskset``, a container's cpuset or a
CPU quota sees fewer cores than ``os.cpu_count()`` reports (PyTorch #64864, #49971).
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchcraft.errors import ConfigurationError
from batchcraft.parallel.backends import CONV_BACKENDS, MATMUL_BACKENDS
from batchcraft.parallel.env_knobs import ALLOCATORS, WAIT_POLICIES, knob_env
from batchcraft.parallel.topology import compact_order, cpu_place, nodes_of, numa_nodes

__all__ = ["ParallelConfig", "usable_cpus", "physical_cores", "sockets", "cpu_quota", "local_rank", "rank_cpus"]


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
    return compact_order(cpus)


def physical_cores(cpus: list[int] | None = None) -> int:
    """Physical cores among ``cpus`` (default: the usable CPUs)."""
    cpus = usable_cpus() if cpus is None else cpus
    return len({cpu_place(c)[1:] for c in cpus}) or 1


def sockets(cpus: list[int] | None = None) -> int:
    """Sockets (packages) among ``cpus`` (default: the usable CPUs)."""
    cpus = usable_cpus() if cpus is None else cpus
    return len({cpu_place(c)[1] for c in cpus}) or 1


def local_rank() -> tuple[int, int] | None:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) when this process is one of several ranks started on this
    node by torchrun (or another launcher that sets both), else None.

    Raises:
        ConfigurationError: the variables are set but not integers with 0 <= rank < size.
    """
    rank, size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if rank is None or size is None:
        return None
    try:
        r, n = int(rank), int(size)
    except ValueError:
        r, n = -1, 0
    if not 0 <= r < n:
        raise ConfigurationError(f"LOCAL_RANK={rank!r} / LOCAL_WORLD_SIZE={size!r}: expected integers "
                                 f"with 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE")
    return r, n


def rank_cpus(cpus: list[int], rank: int, world: int) -> list[int]:
    """Local rank ``rank``'s share of ``cpus`` when ``world`` ranks share them (torchrun).

    A contiguous block of the compact order (whole cores, one NUMA node when possible), the same
    split every rank computes, so the ranks' blocks are disjoint. With more ranks than CPUs,
    ranks share CPUs round-robin (one each).
    """
    cpus = compact_order(list(cpus))
    if world <= 1:
        return cpus
    if world > len(cpus):
        return [cpus[rank % len(cpus)]]
    block = len(cpus) // world
    return cpus[rank * block:(rank + 1) * block]


KNOBS = {  # knob -> its values, "default" (nothing changed) first
    "matmul": MATMUL_BACKENDS,
    "conv": CONV_BACKENDS,
    "compile": (False, True),
    "allocator": ALLOCATORS,
    "omp_wait_policy": WAIT_POLICIES,
}
MODEL_KNOBS = ("matmul", "conv", "compile")  # switch inside a running process (same instances)
PROCESS_KNOBS = ("allocator", "omp_wait_policy")  # need their own processes


@dataclass
class ParallelConfig:
    """One parallel configuration for inference of one model.

    Attributes:
        instances (int): worker processes, each with its own copy of the model (>= 1).
        inter_op_threads (int): pools running independent branches per instance (>= 1; 1 = eager).
        intra_op_threads (int | None): OpenMP threads per pool (>= 1), or None for PyTorch's
            default (then nothing is set and the process is not pinned).
        batch_size (int): items per forward call (>= 1).
        pin (bool): pin each instance to its own contiguous block of cores; on a machine with
            several NUMA nodes its memory is also bound to its block's node(s). Default: True.
        env (dict[str, str]): extra environment for the instances (e.g. KMP_AFFINITY).
        label (str): name for tables ("tuned", "intel-recommended", ...).
        matmul (str): ``nn.Linear`` kernels: "default" (MKL addmm), "mkl-packed", "onednn"
            (:mod:`batchcraft.parallel.backends`).
        conv (str): ``nn.Conv2d`` kernels: "default", "channels-last", "native".
        compile (bool): run the model through ``torch.compile`` (default backends only).
        allocator (str): "default", "jemalloc" or "tcmalloc" (LD_PRELOAD;
            :mod:`batchcraft.parallel.env_knobs`).
        omp_wait_policy (str): "default", "passive" or "active".
    """

    instances: int = 1
    inter_op_threads: int = 1
    intra_op_threads: int | None = None
    batch_size: int = 1
    pin: bool = True
    env: dict[str, str] = field(default_factory=dict)
    label: str = ""
    matmul: str = "default"
    conv: str = "default"
    compile: bool = False
    allocator: str = "default"
    omp_wait_policy: str = "default"

    @property
    def threads_per_instance(self) -> int | None:
        """inter-op x intra-op threads of one instance, None when left to PyTorch."""
        if self.intra_op_threads is None:
            return None
        return self.inter_op_threads * self.intra_op_threads

    def validate(self, cpus: list[int] | None = None, *, oversubscribe: bool = False) -> None:
        """Check the configuration against the usable CPUs.

        Raises:
            ConfigurationError: a count below 1, an unknown knob value, or (unless
                ``oversubscribe``) more threads than usable cores: instances x inter-op x
                intra-op threads > len(cpus).
        """
        cpus = usable_cpus() if cpus is None else cpus
        for name in ("instances", "inter_op_threads", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigurationError(f"ParallelConfig: {name} must be an int >= 1, got {v!r}")
        v = self.intra_op_threads
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigurationError(f"ParallelConfig: intra_op_threads must be an int >= 1 or None, got {v!r}")
        for knob, values in KNOBS.items():
            if getattr(self, knob) not in values:
                raise ConfigurationError(f"ParallelConfig: {knob} must be one of {values}, got {getattr(self, knob)!r}")
        if self.compile and (self.matmul != "default" or self.conv != "default" or self.inter_op_threads > 1):
            raise ConfigurationError("ParallelConfig: compile=True needs matmul and conv 'default' and one "
                                     "inter-op pool (torch.compile chooses its own kernels and runs one graph)")
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

    def oversubscription(self, cpus: list[int] | None = None) -> str | None:
        """Why this configuration runs more threads than ``cpus`` has cores, or None if it does not.

        An unpinned instance with PyTorch's default threads uses every usable core, so two of
        them on the same cores already oversubscribe (``launch --instances 2`` on such a config).
        """
        cpus = usable_cpus() if cpus is None else cpus
        per = self.threads_per_instance
        if per is None:
            per = self.inter_op_threads * len(cpus)  # torch's default intra-op threads: every usable core
            how = f"PyTorch's default {len(cpus)} intra-op threads (unpinned)"
        else:
            how = f"{self.inter_op_threads} inter-op x {self.intra_op_threads} intra-op threads"
        total = self.instances * per
        if total <= len(cpus):
            return None
        return (f"{self.instances} instance(s) x {how} = {total} threads on {len(cpus)} usable cores")

    def cpus_for(self, instance: int, cpus: list[int] | None = None) -> list[int] | None:
        """CPUs instance ``instance`` is pinned to (a contiguous compact block), or None if unpinned.

        Blocks follow the compact order (whole cores, NUMA node after node), so on a machine with
        several nodes an instance's block lies on one node whenever the split allows.
        """
        if not self.pin or self.intra_op_threads is None:
            return None
        cpus = usable_cpus() if cpus is None else compact_order(list(cpus))
        block = max(1, len(cpus) // self.instances)
        return cpus[instance * block: (instance + 1) * block] or cpus[-block:]

    def membind_for(self, instance: int, cpus: list[int] | None = None) -> list[int] | None:
        """NUMA nodes instance ``instance``'s memory is bound to, or None (unpinned, or one node).

        Source: ``numactl --membind`` per instance, as ``torch.backends.xeon.run_cpu`` does on
        multi-socket machines; here done with ``set_mempolicy(MPOL_BIND)`` before torch loads.
        """
        block = self.cpus_for(instance, cpus)
        if block is None or len(numa_nodes()) < 2:
            return None
        return nodes_of(block)

    def thread_env(self) -> dict[str, str]:
        """Environment one instance gets before anything loads OpenMP / MKL (knobs included).

        Raises:
            ConfigurationError: the allocator it names is not installed.
        """
        env = dict(self.env)
        if self.intra_op_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.intra_op_threads)
            env["MKL_NUM_THREADS"] = str(self.intra_op_threads)
        env.update(knob_env(self.allocator, self.omp_wait_policy))
        env["BATCHCRAFT_INTER_OP_THREADS"] = str(self.inter_op_threads)
        env["BATCHCRAFT_INTRA_OP_THREADS"] = "" if self.intra_op_threads is None else str(self.intra_op_threads)
        env["BATCHCRAFT_BATCH_SIZE"] = str(self.batch_size)
        env["BATCHCRAFT_INSTANCES"] = str(self.instances)
        env["BATCHCRAFT_MATMUL"] = self.matmul
        env["BATCHCRAFT_CONV"] = self.conv
        env["BATCHCRAFT_COMPILE"] = "1" if self.compile else ""
        return env

    def key(self) -> tuple:
        """What a worker process is started with (process-level: everything but the batch size
        and the model-level knobs matmul / conv / compile)."""
        return (self.instances, self.inter_op_threads, self.intra_op_threads, self.pin,
                tuple(sorted(self.env.items())), self.allocator, self.omp_wait_policy)

    def variant(self) -> tuple:
        """The model-level knobs: (matmul, conv, compile); switched inside running instances."""
        return (self.matmul, self.conv, self.compile)

    def trial_key(self) -> tuple:
        """Everything a measurement depends on: process, model variant and batch size."""
        return (self.key(), self.variant(), self.batch_size)

    def replace(self, **changes) -> "ParallelConfig":
        """A copy with ``changes`` applied (``env`` copied, not shared)."""
        d = {**self.to_dict(), "env": dict(self.env), **changes}
        return ParallelConfig(**d)

    def knobs(self) -> dict:
        """The knobs that differ from their default: name -> value."""
        return {k: getattr(self, k) for k, values in KNOBS.items() if getattr(self, k) != values[0]}

    def short(self) -> str:
        intra = "default" if self.intra_op_threads is None else str(self.intra_op_threads)
        extra = "".join(f", {k} {v}" if not isinstance(v, bool) else f", {k}" for k, v in self.knobs().items())
        return f"{self.instances}x(inter {self.inter_op_threads}, intra {intra}{extra}) b={self.batch_size}"

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
        """Write ``{"parallel_config": {...}}`` (what ``batchcraft launch --config`` reads)."""
        Path(path).write_text(json.dumps({"parallel_config": self.to_dict()}, indent=2) + "\n")

    @classmethod
    def load(cls, path) -> "ParallelConfig":
        """Read a configuration saved by :meth:`save` or by ``batchcraft tune``.

        Also reads an older tune output (the configuration under key ``best``).

        Raises:
            ConfigurationError: missing or unreadable file, no configuration object in it, unknown
                keys (with the closest known one), or unknown knob values (the message names the file).
        """
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigurationError(f"ParallelConfig.load: no such file {str(p)!r}",
                                     hint="create one with `batchcraft tune --model NAME`") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigurationError(f"ParallelConfig.load: cannot read {str(p)!r}: {exc}") from None
        found = None
        for key in ("parallel_config", "best"):
            if isinstance(data, dict) and isinstance(data.get(key), dict):
                data, found = data[key], key
                break
        if not isinstance(data, dict) or found is None and not set(data) & set(cls.__dataclass_fields__):
            raise ConfigurationError(f"ParallelConfig.load: {str(p)!r} holds no configuration object",
                                     hint='write {"parallel_config": {"instances": 2, ...}}, or create one with '
                                          '`batchcraft tune --model NAME`')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown and found != "best":  # (an older tune output kept measurements beside the knobs)
            close = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
            said = ", ".join(f"{k!r} (did you mean {c[0]!r}?)" if c else repr(k) for k, c in close.items())
            raise ConfigurationError(f"ParallelConfig.load: {str(p)!r}: unknown keys {said}",
                                     hint=f"known keys: {', '.join(sorted(known))}")
        data = {k: v for k, v in data.items() if k in known}
        cfg = cls.from_dict(data)
        for knob, values in KNOBS.items():
            if getattr(cfg, knob) not in values:
                raise ConfigurationError(f"ParallelConfig.load: {str(p)!r}: {knob} must be one of {values}, "
                                         f"got {getattr(cfg, knob)!r}")
        return cfg
