"""Tuning a whole program: ``batchcraft tune -- python serve.py ...`` (:func:`tune_program`).

Each trial starts the program's instances afresh under the configuration (as
:func:`~batchcraft.parallel.launcher.launch` would: pinned, threads and knobs set before the
program's first line, each instance its own process group), and measures items/s from what the
program reports with :func:`batchcraft.parallel.report`:

* **Reporting programs**: the trial's window opens ``warmup_s`` after every instance's first
  report (start-up and the first, slow calls are not counted) and lasts the trial's length; each
  instance's throughput is the items it reported between its first and last report in the window
  over the time between them; the instances are then stopped (SIGTERM to their groups, then
  SIGKILL). Latency percentiles are the intervals between consecutive reports. A program that
  ends on its own before the window closes is measured over the reports it made.
* **Programs that never report** are timed as a whole: they must end by themselves; the
  throughput is 1 / the slowest instance's wall time (runs per second of the whole job), start-up
  included.

Every trial pays the program's start-up, so trials here are longer than for a model
(:data:`PROGRAM_ENGINE`), and a program gets only process-level knobs in its grid: instances,
threads, pinning; backends, allocator and wait policy are tried in the knob race.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time

from batchcraft.errors import WorkerError
from batchcraft.parallel.backends import available_matmul
from batchcraft.parallel.budget import Budget
from batchcraft.parallel.config import ParallelConfig
from batchcraft.parallel.knobs import DEFAULT_KNOBS
from batchcraft.parallel.launcher import program_mode
from batchcraft.parallel.objective import Objective
from batchcraft.parallel.processes import bootstrap_code, instance_env, instance_spec, spawn, stop
from batchcraft.parallel.reporting import REPORT_ENV
from batchcraft.parallel.threads import preserved_thread_state
from batchcraft.parallel.trial import aggregate

__all__ = ["ProgramGroups", "tune_program", "read_reports", "window_throughput", "PROGRAM_ENGINE"]

PROGRAM_ENGINE = {"min_trial_s": 0.5, "max_trial_s": 2.0, "warmup_s": 0.5}
FIRST_REPORT_TIMEOUT_S = 120.0


def read_reports(path: str) -> list[tuple[float, float]]:
    """(time, items) lines of a report file, in time order; a torn last line is ignored."""
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        try:
            out.append((float(parts[0]), float(parts[1])))
        except ValueError:
            continue
    return sorted(out)


def window_throughput(events: list[tuple[float, float]], start: float, end: float) -> tuple[list[float], float, float]:
    """(report intervals s, items, elapsed s) of the reports in [start, end].

    The first report in the window marks its start; the items of the later reports are counted
    over the time from it to the last one (the work before the first report in the window
    belongs to an interval that began earlier).
    """
    inside = [(t, n) for t, n in events if start <= t <= end]
    if len(inside) < 2:
        return [], 0.0, 0.0
    times = [t for t, _ in inside]
    items = sum(n for _, n in inside[1:])
    return [b - a for a, b in zip(times, times[1:])], items, times[-1] - times[0]


class ProgramGroups:
    """The tuner's ``groups`` for a program: every :meth:`measure` starts its instances afresh.

    Args:
        argv (list[str]): the program's command.
        cpus (list[int]): CPUs to spread instances over.
        first_report_timeout_s (float): seconds every instance may take to its first report (or to
            its end, for a program that does not report). Default: 120.
    """

    def __init__(self, argv: list[str], cpus: list[int], *, first_report_timeout_s: float = FIRST_REPORT_TIMEOUT_S):
        self.argv = list(argv)
        self.mode, self.interpreter, self.rest = program_mode(self.argv)
        self.cpus = cpus
        self.first_report_timeout_s = first_report_timeout_s
        self.dir = tempfile.mkdtemp(prefix="batchcraft-program-")
        self.trial = 0
        self.reporting: bool | None = None  # learned from the first trial

    def start_all(self, configs, timeout_s: float = 0.0) -> list:
        """Nothing to start ahead: every trial starts its own instances. Validates the configurations."""
        for c in configs:
            c.validate(self.cpus, oversubscribe=c.label not in ("grid", "tuned"))
        return []

    def drop(self, cfg) -> None:
        pass

    def spawn_all(self, configs) -> None:
        pass

    def is_ready(self, cfg) -> bool:
        return True

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _tail(self, path: str, n: int = 2000) -> str:
        try:
            return open(path, encoding="utf-8", errors="replace").read()[-n:]
        except OSError:
            return ""

    def measure(self, cfg: ParallelConfig, duration_s: float, warmup_s: float = 0.5):
        """One trial of ``cfg``: start, wait for reports, measure the window, stop (see the module doc)."""
        self.trial += 1
        code = bootstrap_code()
        procs, reports, logs = [], [], []
        t_start = time.monotonic()
        try:
            for i in range(cfg.instances):
                rpath = os.path.join(self.dir, f"t{self.trial}-i{i}.report")
                lpath = os.path.join(self.dir, f"t{self.trial}-i{i}.log")
                env = instance_env(cfg, i)
                env[REPORT_ENV] = rpath
                spec = instance_spec(cfg, i, self.cpus, self.mode)
                with open(lpath, "wb") as log:
                    procs.append(spawn([*self.interpreter, "-c", code, json.dumps(spec), *self.rest], env,
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=log))
                reports.append(rpath)
                logs.append(lpath)
            per_instance = self._wait_and_measure(cfg, procs, reports, logs, t_start, duration_s, warmup_s)
        finally:
            stop(procs, grace_s=2.0)
        config = {**cfg.to_dict(), "batch_size": cfg.batch_size}
        return aggregate(config, cfg.batch_size, per_instance, duration_s)

    def _failed(self, procs, logs):
        for i, p in enumerate(procs):
            rc = p.poll()
            if rc not in (None, 0):
                raise WorkerError(f"program instance {i} (pid {p.pid}) exited with code {rc}; its output ends "
                                  f"with:\n{self._tail(logs[i])}")

    def _wait_and_measure(self, cfg, procs, reports, logs, t_start, duration_s, warmup_s):
        deadline = t_start + self.first_report_timeout_s
        # every instance's first report, or every instance's end
        while True:
            self._failed(procs, logs)
            firsts = [read_reports(r)[:1] for r in reports]
            done = [p.poll() is not None for p in procs]
            if all(f or d for f, d in zip(firsts, done)):
                break
            if time.monotonic() > deadline:
                raise WorkerError(f"program {' '.join(self.argv)!r} neither reported work "
                                  f"(batchcraft.parallel.report) nor ended within {self.first_report_timeout_s:.0f} s",
                                  hint="call batchcraft.parallel.report(items) as work is done, or let the program end")
            time.sleep(0.01)
        if not any(firsts):  # no reports at all: timed as a whole
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise WorkerError(f"program {' '.join(self.argv)!r} did not end within "
                                      f"{self.first_report_timeout_s:.0f} s and reports nothing")
                time.sleep(0.01)
            self._failed(procs, logs)
            wall = time.monotonic() - t_start
            self.reporting = False
            return [([wall], 1.0, wall)] + [([], 0.0, 0.0)] * (len(procs) - 1)
        self.reporting = True
        open_at = max(f[0][0] for f in firsts if f) + warmup_s
        close_at = open_at + duration_s
        while time.monotonic() < close_at + 0.01 and any(p.poll() is None for p in procs):
            self._failed(procs, logs)
            time.sleep(min(0.01, max(0.0, close_at - time.monotonic())))
        self._failed(procs, logs)
        out = []
        for r in reports:
            events = read_reports(r)
            lat, items, elapsed = window_throughput(events, open_at, close_at)
            if elapsed <= 0:  # ended early: all its reports after the first
                lat, items, elapsed = window_throughput(events, events[0][0] if events else 0.0, float("inf"))
            out.append((lat, items, elapsed))
        return out


def tune_program(argv: list[str], *, batch_sizes=(1,), objective: str = "throughput", budget_s: float = 120.0,
                 latency_limit_ms: float | None = None, cpus: list[int] | None = None, eta: int = 3,
                 repeats: int = 3, final_repeats: int = 5, k_final: int = 2, knobs=DEFAULT_KNOBS,
                 max_trial_s: float = PROGRAM_ENGINE["max_trial_s"], progress: bool = False,
                 first_report_timeout_s: float = FIRST_REPORT_TIMEOUT_S):
    """Find the best configuration for running the program ``argv`` within ``budget_s``.

    The program runs once per trial under each configuration (see the module docstring);
    BATCHCRAFT_BATCH_SIZE tells it the trial's batch size if it wants one (``batch_sizes``; the
    default (1,) leaves the batch size to the program). Knobs: instances and threads in the grid;
    matmul / conv backends (installed before a Python program starts), allocator and wait policy in
    the knob race; "compile" is not offered (the program compiles its model itself, via
    :func:`batchcraft.parallel.prepare`).

    Returns:
        TuneResult: as :func:`batchcraft.parallel.tune`; ``model`` is the command line.
    Raises:
        ConfigurationError: an unknown command or missing script, bad arguments.
        WorkerError: the program failed, or neither reported work nor ended in time.
    """
    from batchcraft.parallel.search import check_arguments, run_search

    budget = Budget(budget_s)
    goal = Objective(objective, latency_limit_ms)
    cpus = check_arguments(list(batch_sizes), knobs, cpus, eta=eta, repeats=repeats, final_repeats=final_repeats,
                           max_trial_s=max_trial_s)
    groups = ProgramGroups(argv, cpus, first_report_timeout_s=first_report_timeout_s)
    alt_variants = [("default", "default")]
    if groups.mode != "exec":
        if "matmul" in knobs:
            alt_variants += [(m, "default") for m in available_matmul() if m != "default"]
        if "conv" in knobs:
            alt_variants.append(("default", "channels-last"))
    try:
        with preserved_thread_state():
            result = run_search(groups, budget, " ".join(argv), list(batch_sizes), goal, None, False, cpus,
                                eta=eta, repeats=repeats, final_repeats=final_repeats, k_final=k_final,
                                knobs=tuple(k for k in knobs if k != "compile"), progress=progress,
                                engine_options={**PROGRAM_ENGINE, "max_trial_s": float(max_trial_s),
                                                "min_trial_s": min(PROGRAM_ENGINE["min_trial_s"], float(max_trial_s))},
                                alt_variants=alt_variants)
    finally:
        groups.close()
    if groups.reporting is False:
        result.notes.append("the program reports nothing (batchcraft.parallel.report): timed as a whole, "
                            "start-up included; items/s = runs of the whole job per second")
    result.elapsed_s = budget.elapsed()
    return result
