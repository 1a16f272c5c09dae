"""The tuner's instances: :class:`WorkerGroup`, N pinned processes holding one model each.

Each instance is started by :mod:`batchcraft.parallel.processes` (fresh interpreter, pinned and
threaded before torch loads, its own process group, gone when we are) and runs
:mod:`batchcraft.parallel._worker`. The group measures aggregate throughput and latency
percentiles: every instance warms up, then all start at the same monotonic instant and call the
model back to back for the trial's duration. Model-level knobs (matmul / conv backends,
``torch.compile``) switch inside the running instances; everything else needs its own group.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchcraft.errors import ConfigurationError, WorkerError
from batchcraft.parallel.config import ParallelConfig, usable_cpus
from batchcraft.parallel.processes import bootstrap_code, instance_env, instance_spec, spawn, stop
from batchcraft.parallel.trial import TrialResult, aggregate
from batchcraft.parallel.workload import ModelSpec, model_spec

__all__ = ["WorkerGroup"]


def _sys_path() -> list[str]:
    src_root = str(Path(__file__).resolve().parents[2])  # the directory holding batchcraft/
    out = []
    for p in [src_root, os.getcwd(), *sys.path]:
        p = os.path.abspath(p) if p else os.getcwd()
        if p not in out:
            out.append(p)
    return out


class WorkerGroup:
    """``config.instances`` pinned worker processes, each holding the model.

    Args:
        config (ParallelConfig): instances, threads, pinning, process-level knobs (its batch size
            and model-level knobs are ignored here: :meth:`measure` takes them).
        model (str | ModelSpec): registry name, ``"module:factory"``, or a :class:`ModelSpec`.
        model_kwargs (dict, optional): passed to the model factory. Default: None.
        image_size (int, optional): input size for image models without ``example_input``.
        cpus (list[int], optional): CPUs to spread instances over. Default: the usable CPUs.
        oversubscribe (bool): allow more threads than cores (for baselines). Default: False.
        start_timeout_s (float): seconds to wait for each instance's model. Default: 180.
    Raises:
        ConfigurationError: the configuration does not fit the CPUs (see ParallelConfig.validate),
            or names an allocator that is not installed.
        WorkerError: an instance died or failed; the message has its exit code and stderr tail.
    Example:
        >>> with WorkerGroup(ParallelConfig(instances=2, intra_op_threads=1), "mlp_fc512") as g:
        ...     r = g.measure(batch_size=8, duration_s=1.0)
    """

    def __init__(self, config: ParallelConfig, model, *, model_kwargs: dict | None = None,
                 image_size: int | None = None, cpus: list[int] | None = None,
                 oversubscribe: bool = False, start_timeout_s: float = 180.0):
        self.cpus = usable_cpus() if cpus is None else list(cpus)
        config.validate(self.cpus, oversubscribe=oversubscribe)
        config.thread_env()  # an allocator that is not installed fails here, before any start
        self.config = config
        self._tmpdir = None
        if isinstance(model, ModelSpec):
            spec = model
        else:
            if not isinstance(model, str):
                self._tmpdir = tempfile.mkdtemp(prefix="batchcraft-model-")
            spec = model_spec(model, model_kwargs=model_kwargs, image_size=image_size, tmpdir=self._tmpdir)
        if model_kwargs and isinstance(model, ModelSpec):
            spec = ModelSpec.from_dict({**spec.to_dict(), "kwargs": {**spec.kwargs, **model_kwargs}})
        if image_size is not None:
            spec.image_size = image_size
        self.spec = spec
        self.model = spec.name
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
        code = bootstrap_code()
        try:
            for i in range(self.config.instances):
                parent_conn, child_conn = multiprocessing.Pipe()
                spec = instance_spec(self.config, i, self.cpus, "worker")
                spec.update(fd=child_conn.fileno(), sys_path=_sys_path(), model=self.spec.to_dict(),
                            executor_threads=self.config.inter_op_threads)
                log = tempfile.TemporaryFile()
                proc = spawn([sys.executable, "-c", code, json.dumps(spec)], instance_env(self.config, i),
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
        """Stop every instance (idempotent): ask, then SIGTERM its group, then SIGKILL; all reaped."""
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
        stop(self._procs, grace_s=2.0)
        for conn in self._conns:
            conn.close()
        for log in self._logs:
            log.close()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

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
    def race_variants(self, batch_size: int, variants: list[tuple], duration_s: float, *, warmup_s: float = 0.2,
                      block_s: float = 0.01, min_rounds: int = 5) -> list[list[tuple]]:
        """Model-level variants taking turns inside every instance at once, in short blocks.

        A fine-grained race: each instance warms every variant up, then all start together and
        run the variants in turn, blocks of at least ``block_s`` seconds (and one call) each, the
        first of a round rotating, until ``duration_s`` and ``min_rounds`` rounds are done. Drift
        and other processes' load hit neighbouring blocks alike, so a few hundred milliseconds
        resolve differences of a few percent that whole trials, seconds apart, do not.

        Returns:
            list: per instance, its blocks (round, variant index, calls, seconds).
        Raises:
            WorkerError: an instance failed (a variant whose values differ from the default's too).
        """
        for v in variants:  # warm-up per variant (weights packed, kernels chosen), one message each
            self._broadcast(("prepare", batch_size, warmup_s, list(v)))
            failure = None
            for i in range(len(self._procs)):
                try:
                    self._expect(i, "prepared", 120.0 + 20 * warmup_s + (600.0 if v[2] else 0.0))
                except WorkerError as exc:
                    failure = failure or exc
            if failure is not None:
                raise failure
        start_at = time.monotonic() + 0.005 + 0.01 * (len(self._procs) > 1)
        self._broadcast(("vrace", batch_size, [list(v) for v in variants], start_at, duration_s, block_s, min_rounds))
        slack_s = 120.0 + 20 * duration_s
        return [self._expect(i, "vraced", slack_s)[1] for i in range(len(self._procs))]

    def measure(self, batch_size: int, duration_s: float = 1.0, *, warmup_s: float = 0.2,
                variant: tuple = ("default", "default", False)) -> TrialResult:
        """Run all instances concurrently for ``duration_s`` at ``batch_size``; aggregate.

        Each instance first warms up (the first time at this batch size and variant: at least
        one call and ``warmup_s``), then all start at the same monotonic instant (after untimed
        calls that keep their threads awake) and call the model back to back until
        ``duration_s`` has passed.

        Args:
            variant (tuple): (matmul, conv, compile), see :meth:`ParallelConfig.variant`.
        Raises:
            ConfigurationError: batch_size < 1 or duration_s <= 0.
            WorkerError: an instance died or failed (a variant whose values differ from the
                default's included).
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"WorkerGroup.measure: batch_size must be an int >= 1, got {batch_size!r}")
        if duration_s <= 0:
            raise ConfigurationError(f"WorkerGroup.measure: duration_s must be > 0, got {duration_s!r}")
        if not self._procs:
            self.start()
        compile_s = 600.0 if variant[2] else 0.0  # torch.compile's first call: minutes on a busy machine
        slack_s = 120.0 + compile_s + 20 * (duration_s + warmup_s)
        self._broadcast(("prepare", batch_size, warmup_s, list(variant)))
        failure = None
        for i in range(len(self._procs)):  # every reply is read, so one failure leaves no stale message
            try:
                self._expect(i, "prepared", slack_s)
            except WorkerError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        # Instances start together a little later; a single one only needs the message to arrive.
        self._broadcast(("run", time.monotonic() + 0.005 + 0.01 * (len(self._procs) > 1), duration_s))
        per_instance = []
        for i in range(len(self._procs)):
            _, lat, items, elapsed = self._expect(i, "result", slack_s)
            per_instance.append((lat, items, elapsed))
        matmul, conv, compiled = variant
        config = {**self.config.to_dict(), "batch_size": batch_size, "matmul": matmul, "conv": conv,
                  "compile": bool(compiled)}
        return aggregate(config, batch_size, per_instance, duration_s)
