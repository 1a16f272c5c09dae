"""Starting and stopping instance processes: environment, bootstrap spec, process groups, signals.

Shared by :class:`~batchcraft.parallel.workers.WorkerGroup` (the tuner's instances),
:func:`~batchcraft.parallel.launcher.launch` (the user's program) and the program runner.

* Every instance is a freshly exec'ed interpreter running :mod:`batchcraft.parallel._bootstrap`
  (never a fork of a process that ran OpenMP: PyTorch #17199, #82219), which pins it, binds its
  memory, sets its threads and knobs, and only then imports torch.
* Every instance is the leader of its own process group (a new session), so stopping it stops
  whatever it started too (FIELD-FAULTS "orphans on shutdown": PyTorch PR #113231). The
  bootstrap also asks the kernel to send it SIGTERM when its parent dies
  (``PR_SET_PDEATHSIG``), so even a launcher killed with SIGKILL leaves no instance running.
* :func:`stop` signals each whole group, waits a grace period, then kills what is left of each
  group, and reaps every instance.
* A **watchdog** (one small process per batchcraft process, no torch) holds a pipe to us and the
  list of live instance groups; if we die without stopping them (even by SIGKILL, where no
  handler runs), it reads end-of-file and stops those groups: the instances' own children too,
  which ``PR_SET_PDEATHSIG`` alone would leave running.
* :class:`StopSignals` turns SIGINT, SIGTERM and SIGHUP into a flag the caller's wait loop polls,
  so a stop request never interrupts the middle of starting a process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from batchcraft.parallel.config import ParallelConfig

__all__ = ["instance_env", "instance_spec", "spawn", "stop", "group_alive", "StopSignals", "bootstrap_code",
           "exit_code_for"]

_BOOTSTRAP = Path(__file__).with_name("_bootstrap.py")
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def bootstrap_code() -> str:
    return _BOOTSTRAP.read_text()


def instance_env(config: ParallelConfig, instance: int, base: dict | None = None) -> dict[str, str]:
    """Environment of instance ``instance``: ``base`` (default: ours) with the configuration's
    thread settings and knobs, and BATCHCRAFT_INSTANCE.

    Raises:
        ConfigurationError: the configuration names an allocator that is not installed.
    """
    env = dict(os.environ if base is None else base)
    if config.intra_op_threads is None:
        for var in _THREAD_VARS:  # "PyTorch default" means: nothing set for it
            env.pop(var, None)
    env.update(config.thread_env())
    env["BATCHCRAFT_INSTANCE"] = str(instance)
    return env


def instance_spec(config: ParallelConfig, instance: int, cpus: list[int], mode: str) -> dict:
    """The bootstrap's JSON spec for instance ``instance`` (see :mod:`batchcraft.parallel._bootstrap`)."""
    return {
        "mode": mode,
        "instance": instance,
        "parent": os.getpid(),
        "cpus": config.cpus_for(instance, cpus),
        "membind": config.membind_for(instance, cpus),
        "intra_op_threads": config.intra_op_threads,
        # torch's own inter-op pool (TorchScript forks) matches the executor's pools when set
        "inter_op_threads": None if config.intra_op_threads is None else config.inter_op_threads,
        "matmul": config.matmul,
        "conv": config.conv,
    }


_WATCHDOG = r"""
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)  # only end-of-file on the pipe stops us (or SIGKILL)
groups, buf = set(), b""
fd = int(sys.argv[1])
while True:
    data = os.read(fd, 4096)
    if not data:
        break
    buf += data
    *lines, buf = buf.split(b"\n")
    for line in lines:
        op, _, pgid = line.decode().partition(" ")
        (groups.add if op == "watch" else groups.discard)(int(pgid))
def kill(sig):
    for g in list(groups):
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            groups.discard(g)
kill(signal.SIGTERM)
deadline = time.monotonic() + float(sys.argv[2])
while groups and time.monotonic() < deadline:
    time.sleep(0.05)
    for g in list(groups):
        try:
            os.killpg(g, 0)
        except (ProcessLookupError, PermissionError):
            groups.discard(g)
kill(signal.SIGKILL)
"""


class _Watchdog:
    def __init__(self, grace_s: float = 2.0):
        r, self.w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(r), str(grace_s)],
                                     pass_fds=(r,), start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        os.close(r)
        self.pid = os.getpid()

    def send(self, op: str, pgid: int) -> None:
        try:
            os.write(self.w, f"{op} {pgid}\n".encode())
        except OSError:
            pass


_watchdog: list = []


def _the_watchdog() -> _Watchdog:
    if not _watchdog or _watchdog[0].pid != os.getpid():  # none yet, or we are a forked child
        _watchdog[:] = [_Watchdog()]
    return _watchdog[0]


def spawn(argv: list[str], env: dict, **popen_kwargs) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new process group (its own session), watched (see above)."""
    dog = _the_watchdog()
    p = subprocess.Popen(argv, env=env, start_new_session=True, **popen_kwargs)
    dog.send("watch", p.pid)
    return p


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the instance leads its group: pgid == pid
    except (ProcessLookupError, PermissionError):
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def stop(procs: list[subprocess.Popen], grace_s: float, first_signal: int = signal.SIGTERM) -> None:
    """Signal every instance's whole group, wait up to ``grace_s``, then kill what is left.

    Groups whose leader already exited are signalled too (an instance's children outlive it
    otherwise). Every instance is reaped.
    """
    for p in procs:
        if p.poll() is None or group_alive(p.pid):
            _signal_group(p, first_signal)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    while any(group_alive(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)  # children of an exited leader get the rest of the grace period
    for p in procs:
        if p.poll() is None or group_alive(p.pid):
            _signal_group(p, signal.SIGKILL)
        p.wait()
        if _watchdog:
            _watchdog[0].send("forget", p.pid)


class StopSignals:
    """Context manager: SIGINT / SIGTERM / SIGHUP set :attr:`received` instead of stopping us.

    Only in the main thread (Python delivers signals there); elsewhere it does nothing and the
    default handlers stay. The previous handlers come back on exit.
    """

    def __init__(self, signals=STOP_SIGNALS):
        self.signals = signals
        self.received: int | None = None
        self._saved: dict = {}

    def _handler(self, signum, frame):  # noqa: ARG002 - signal handler signature
        if self.received is None:
            self.received = signum

    def __enter__(self) -> "StopSignals":
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                try:
                    self._saved[s] = signal.signal(s, self._handler)
                except (ValueError, OSError):
                    pass
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._saved.items():
            signal.signal(s, h)
        self._saved.clear()


def exit_code_for(signum: int) -> int:
    """Shell convention: 128 + signal number (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP)."""
    return 128 + int(signum)
