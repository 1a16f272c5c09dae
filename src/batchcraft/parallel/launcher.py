"""Multi-instance launcher: N pinned processes with their thread counts set before torch loads.

Every instance is a freshly exec'ed interpreter (spawned, never forked from a process that already
ran OpenMP: PyTorch #17199, #82219 report hangs and oversubscription). Its first code
(:mod:`batchcraft.parallel._bootstrap`) pins it with ``os.sched_setaffinity`` to its own block of
cores and only then imports torch; OMP_NUM_THREADS / MKL_NUM_THREADS are in its environment from
the start, and ``torch.set_num_threads`` / ``set_num_interop_threads`` run before any work.

Two uses:

* :class:`WorkerGroup` keeps instances of a registry model alive and measures aggregate throughput
  and latency percentiles (used by the tuner; one group per process-level configuration).
* :func:`launch` runs any command once per instance under a saved configuration
  (``batchcraft launch --config best.json -- python script.py``).

Both shut every instance down on Ctrl-C and when one instance dies.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from batchcraft.errors import ConfigurationError, WorkerError
from batchcraft.parallel.config import ParallelConfig, usable_cpus

__all__ = ["WorkerGroup", "TrialResult", "launch"]

_BOOTSTRAP = Path(__file__).with_name("_bootstrap.py")
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _bootstrap_code() -> str:
    return _BOOTSTRAP.read_text()


def _instance_env(config: ParallelConfig, instance: int) -> dict[str, str]:
    env = dict(os.environ)
    if config.intra_op_threads is None:
        for var in _THREAD_VARS:  # "PyTorch default" means: nothing set for it
            env.pop(var, None)
    env.update(config.thread_env())
    env["BATCHCRAFT_INSTANCE"] = str(instance)
    return env


def _spec(config: ParallelConfig, instance: int, cpus: list[int], mode: str) -> dict:
    return {
        "mode": mode,
        "instance": instance,
        "cpus": config.cpus_for(instance, cpus),
        "intra_op_threads": config.intra_op_threads,
        # torch's own inter-op pool (TorchScript forks) matches the executor's pools when set
        "inter_op_threads": None if config.intra_op_threads is None else config.inter_op_threads,
    }


def _stop(procs: list[subprocess.Popen], grace_s: float, first_signal=signal.SIGTERM) -> None:
    """Signal every live process, wait up to ``grace_s``, then kill what is left (always reaped)."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(first_signal)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass
class TrialResult:
    """Aggregate measurement of one configuration at one batch size.

    Attributes:
        throughput_items_per_s (float): sum over instances of items / elapsed seconds.
        latency_p50_ms, latency_p90_ms, latency_p99_ms (float): per-call latency percentiles over
            all instances' calls (one call = one batch).
        calls (int): forward calls measured, all instances together.
        duration_s (float): requested measuring time per instance.
    """

    config: dict
    batch_size: int
    throughput_items_per_s: float
    latency_p50_ms: float
    latency_p90_ms: float
    latency_p99_ms: float
    calls: int
    duration_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def _percentile(sorted_ms: list[float], q: float) -> float:
    if len(sorted_ms) == 1:
        return sorted_ms[0]
    k = (len(sorted_ms) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (k - lo)


class WorkerGroup:
    """``config.instances`` pinned worker processes, each holding registry model ``model``.

    Args:
        config (ParallelConfig): instances, threads, pinning (its batch_size is ignored here).
        model (str): registry name in :mod:`batchcraft.models`.
        model_kwargs (dict, optional): passed to the model factory. Default: None.
        image_size (int, optional): input size for image models without ``example_input``.
        cpus (list[int], optional): CPUs to spread instances over. Default: the usable CPUs.
        oversubscribe (bool): allow more threads than cores (for baselines). Default: False.
        start_timeout_s (float): seconds to wait for each instance's model. Default: 180.
    Raises:
        ConfigurationError: the configuration does not fit the CPUs (see ParallelConfig.validate).
        WorkerError: an instance died or failed; the message has its exit code and stderr tail.
    Example:
        >>> with WorkerGroup(ParallelConfig(instances=2, intra_op_threads=1), "mlp_fc512") as g:
        ...     r = g.measure(batch_size=8, duration_s=1.0)
    """

    def __init__(self, config: ParallelConfig, model: str, *, model_kwargs: dict | None = None,
                 image_size: int | None = None, cpus: list[int] | None = None,
                 oversubscribe: bool = False, start_timeout_s: float = 180.0):
        self.cpus = usable_cpus() if cpus is None else list(cpus)
        config.validate(self.cpus, oversubscribe=oversubscribe)
        self.config = config
        self.model = model
        self.model_kwargs = dict(model_kwargs or {})
        self.image_size = image_size
        self.start_timeout_s = start_timeout_s
        self.info: list[dict] = []
        self._procs: list[subprocess.Popen] = []
        self._conns = []
        self._logs = []
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> "WorkerGroup":
        """Start the instances and wait until each has built its model."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> "WorkerGroup":
        """Start the instance processes without waiting (see :meth:`wait_ready`)."""
        code = _bootstrap_code()
        src_root = str(Path(__file__).resolve().parents[2])  # the directory holding batchcraft/
        try:
            for i in range(self.config.instances):
                parent_conn, child_conn = multiprocessing.Pipe()
                spec = _spec(self.config, i, self.cpus, "worker")
                spec.update(fd=child_conn.fileno(), sys_path=[src_root], model=self.model,
                            model_kwargs=self.model_kwargs, image_size=self.image_size,
                            executor_threads=self.config.inter_op_threads)
                log = tempfile.TemporaryFile()
                proc = subprocess.Popen(
                    [sys.executable, "-c", code, json.dumps(spec)], env=_instance_env(self.config, i),
                    pass_fds=(child_conn.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
                child_conn.close()
                self._procs.append(proc)
                self._conns.append(parent_conn)
                self._logs.append(log)
        except BaseException:
            self.close()
            raise
        return self

    def wait_ready(self) -> "WorkerGroup":
        """Wait until every spawned instance has built its model; raise WorkerError if one failed."""
        try:
            self.info += [self._expect(i, "ready", self.start_timeout_s)[1]
                          for i in range(len(self.info), len(self._procs))]
        except BaseException:
            self.close()
            raise
        return self

    def ready(self, timeout_s: float) -> bool:
        """True once every spawned instance has built its model; False if that takes over ``timeout_s``.

        Unlike :meth:`wait_ready` a slow start is not an error (the group stays as it is, so the
        caller can wait again or close it); an instance that died or failed still raises WorkerError.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            while len(self.info) < len(self._procs):
                i = len(self.info)
                try:
                    has_msg = self._conns[i].poll(max(0.0, deadline - time.monotonic()))
                except (EOFError, OSError):
                    has_msg = True  # let _expect report the exit code
                if not has_msg and self._procs[i].poll() is None:
                    return False
                self.info.append(self._expect(i, "ready", 0)[1])
        except BaseException:
            self.close()
            raise
        return True

    def close(self) -> None:
        """Stop every instance (idempotent): ask, then SIGTERM, then SIGKILL; all are reaped."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 3.0
        for p in self._procs:  # asked to stop: give them a moment, then escalate
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _stop(self._procs, grace_s=2.0)
        for conn in self._conns:
            conn.close()
        for log in self._logs:
            log.close()

    def __enter__(self) -> "WorkerGroup":
        return self.start() if not self._procs else self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- messaging --------------------------------------------------------------------------
    def _stderr_tail(self, i: int, n: int = 2000) -> str:
        log = self._logs[i]
        try:
            log.flush()
            log.seek(0)
            return log.read().decode(errors="replace")[-n:]
        except (OSError, ValueError):
            return ""

    def _expect(self, i: int, kind: str, timeout_s: float):
        conn, proc = self._conns[i], self._procs[i]
        try:
            ready = conn.poll(timeout_s)
        except (EOFError, OSError):
            ready = False
        if not ready and proc.poll() is None:
            raise WorkerError(f"instance {i} (pid {proc.pid}) sent no {kind!r} within {timeout_s:.0f} s",
                              hint="the model may be too slow for this trial length")
        try:
            if not ready:
                raise EOFError
            msg = conn.recv()
        except (EOFError, OSError):
            try:
                rc = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rc = None
            raise WorkerError(f"instance {i} (pid {proc.pid}) died with exit code {rc} while waiting for "
                              f"{kind!r}; its output ends with:\n{self._stderr_tail(i)}") from None
        if msg[0] == "error":
            raise WorkerError(f"instance {i} (pid {proc.pid}) failed:\n{msg[1]}")
        if msg[0] != kind:
            raise WorkerError(f"instance {i}: expected {kind!r}, got {msg[0]!r}")
        return msg

    def _broadcast(self, msg) -> None:
        for i, conn in enumerate(self._conns):
            try:
                conn.send(msg)
            except (OSError, ValueError):
                self._expect(i, "alive", 0)  # raises WorkerError with the exit code

    # -- measuring --------------------------------------------------------------------------
    def measure(self, batch_size: int, duration_s: float = 1.0, *, warmup_s: float = 0.2) -> TrialResult:
        """Run all instances concurrently for ``duration_s`` at ``batch_size``; aggregate.

        Each instance first warms up (the first time at this batch size: at least one call and
        ``warmup_s``), then all start at the same monotonic instant (after untimed calls that keep
        their threads awake) and call the model back to back until ``duration_s`` has passed.

        Raises:
            ConfigurationError: batch_size < 1 or duration_s <= 0.
            WorkerError: an instance died or failed.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"WorkerGroup.measure: batch_size must be an int >= 1, got {batch_size!r}")
        if duration_s <= 0:
            raise ConfigurationError(f"WorkerGroup.measure: duration_s must be > 0, got {duration_s!r}")
        if not self._procs:
            self.start()
        slack_s = 120.0 + 20 * (duration_s + warmup_s)
        self._broadcast(("prepare", batch_size, warmup_s))
        for i in range(len(self._procs)):
            self._expect(i, "prepared", slack_s)
        # Instances start together a little later; a single one only needs the message to arrive.
        self._broadcast(("run", time.monotonic() + 0.005 + 0.01 * (len(self._procs) > 1), duration_s))
        latencies_ms, throughput = [], 0.0
        for i in range(len(self._procs)):
            _, lat, items, elapsed = self._expect(i, "result", slack_s)
            latencies_ms += [t * 1e3 for t in lat]
            throughput += items / elapsed
        latencies_ms.sort()
        return TrialResult(
            config={**self.config.to_dict(), "batch_size": batch_size},
            batch_size=batch_size,
            throughput_items_per_s=throughput,
            latency_p50_ms=statistics.median(latencies_ms),
            latency_p90_ms=_percentile(latencies_ms, 0.90),
            latency_p99_ms=_percentile(latencies_ms, 0.99),
            calls=len(latencies_ms),
            duration_s=duration_s,
        )


_PYTHON = re.compile(r"python[0-9.]*(\.exe)?")


def _program_mode(argv: list[str]) -> tuple[str, list[str], list[str]]:
    """(bootstrap mode, interpreter command, arguments after the bootstrap spec)."""
    if not argv:
        raise ConfigurationError("launch: no command given", hint="batchcraft launch --config best.json -- python script.py")
    exe = shutil.which(argv[0])
    if exe is None:
        raise ConfigurationError(f"launch: command not found: {argv[0]!r}", hint="check the PATH or give a full path")
    if _PYTHON.fullmatch(os.path.basename(argv[0])) and len(argv) >= 2:
        if argv[1] == "-m" and len(argv) >= 3:
            return "python-module", [exe], argv[2:]
        if not argv[1].startswith("-"):
            if not os.path.isfile(argv[1]):
                raise ConfigurationError(f"launch: no such script: {argv[1]!r} (working directory {os.getcwd()})")
            return "python-script", [exe], argv[1:]
    return "exec", [sys.executable], argv


def launch(config: ParallelConfig, argv: list[str], *, cpus: list[int] | None = None,
           oversubscribe: bool = False, grace_s: float = 5.0) -> int:
    """Run ``argv`` once per instance of ``config``, pinned and with its thread settings.

    Each instance gets its block of cores (``os.sched_setaffinity`` before anything loads),
    OMP_NUM_THREADS / MKL_NUM_THREADS, and BATCHCRAFT_INSTANCE (0-based), BATCHCRAFT_INSTANCES,
    BATCHCRAFT_INTRA_OP_THREADS, BATCHCRAFT_INTER_OP_THREADS, BATCHCRAFT_BATCH_SIZE to shard or
    size its work. For ``python script.py ...`` and ``python -m module ...`` the instance also
    calls ``torch.set_num_threads`` and ``torch.set_num_interop_threads`` before the program runs;
    other commands are exec'ed after pinning and get the environment only.

    Args:
        config (ParallelConfig): the configuration (e.g. ``ParallelConfig.load("best.json")``).
        argv (list[str]): the command.
        cpus (list[int], optional): CPUs to spread instances over. Default: the usable CPUs.
        oversubscribe (bool): allow more threads than cores. Default: False.
        grace_s (float): seconds instances get to exit after Ctrl-C or a failure. Default: 5.
    Returns:
        int: 0 if every instance exited 0; else the first failing instance's exit code
        (130 after Ctrl-C); the other instances are stopped.
    Raises:
        ConfigurationError: bad configuration for these CPUs, empty or unknown command, missing script.
    """
    cpus = usable_cpus() if cpus is None else list(cpus)
    config.validate(cpus, oversubscribe=oversubscribe)
    mode, interpreter, rest = _program_mode(list(argv))
    code = _bootstrap_code()
    procs: list[subprocess.Popen] = []
    try:
        for i in range(config.instances):
            spec = _spec(config, i, cpus, mode)
            procs.append(subprocess.Popen([*interpreter, "-c", code, json.dumps(spec), *rest],
                                          env=_instance_env(config, i)))
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, rc = failed[0]
                print(f"batchcraft launch: instance {i} (pid {procs[i].pid}) exited with code {rc}; "
                      f"stopping the others", file=sys.stderr)
                _stop(procs, grace_s)
                return rc
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        # The terminal already sent SIGINT to the whole group; send it again for instances
        # started in another group, then escalate.
        _stop(procs, grace_s, first_signal=signal.SIGINT)
        return 130
    except BaseException:
        _stop(procs, grace_s)
        raise
