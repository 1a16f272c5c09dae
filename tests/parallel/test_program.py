"""Tuning a whole program: reports read back, windows measured, non-reporting programs timed as a
whole, failures and silence reported, nothing left running. The programs sleep rather than
compute, so what they report does not depend on the machine's load."""

import json
import os
import sys
import textwrap

import pytest

from batchcraft.errors import WorkerError
from batchcraft.parallel import ParallelConfig, report
from batchcraft.parallel.program import ProgramGroups, read_reports, window_throughput
from batchcraft.parallel.reporting import REPORT_ENV


def test_report_appends_time_and_items_and_is_silent_outside_the_tuner(tmp_path, monkeypatch):
    monkeypatch.delenv(REPORT_ENV, raising=False)
    report(5)  # nothing to do, no error
    path = tmp_path / "r.txt"
    monkeypatch.setenv(REPORT_ENV, str(path))
    report(3)
    report(2.5)
    events = read_reports(str(path))
    assert [n for _, n in events] == [3, 2.5] and events[0][0] <= events[1][0]
    with pytest.raises(ValueError):
        report(-1)
    path.write_text(path.read_text() + "12.5 not-a-number\n99.0")  # a torn last line is skipped
    assert len(read_reports(str(path))) == 2


def test_the_window_counts_items_after_its_first_report():
    events = [(0.0, 1), (1.0, 10), (2.0, 10), (3.0, 10), (4.0, 10)]
    lat, items, elapsed = window_throughput(events, 0.5, 3.5)
    assert (items, elapsed, lat) == (20, 2.0, [1.0, 1.0])  # 20 items in the 2 s from t=1 to t=3
    assert window_throughput(events, 3.5, 9.0) == ([], 0.0, 0.0)  # one report: no interval


SERVE = textwrap.dedent("""
    import os, sys, time
    import batchcraft.parallel as bp
    open(os.path.join(sys.argv[1], "pid-" + os.environ["BATCHCRAFT_INSTANCE"]), "w").write(str(os.getpid()))
    while True:
        time.sleep(0.01)
        bp.report(2)   # 2 items every 10 ms: up to 200 items/s per instance
""")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow
def test_a_reporting_program_is_measured_over_the_window_and_stopped(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    g = ProgramGroups([sys.executable, str(script), str(tmp_path)], [0, 1])
    try:
        res = g.measure(ParallelConfig(instances=2, intra_op_threads=1), 0.5, 0.2)
    finally:
        g.close()
    assert g.reporting is True and res.calls >= 10
    assert 100 < res.throughput_items_per_s / 2 <= 201  # per instance; sleep overshoots, never undershoots
    assert res.latency_p50_ms >= 10.0
    pids = [int((tmp_path / f"pid-{i}").read_text()) for i in range(2)]
    assert not any(_alive(p) for p in pids)  # stopped after the window


@pytest.mark.slow
def test_a_program_that_does_not_report_is_timed_as_a_whole(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import time\ntime.sleep(0.3)\n")
    g = ProgramGroups([sys.executable, str(script)], [0, 1])
    try:
        res = g.measure(ParallelConfig(instances=1, intra_op_threads=1), 0.1, 0.1)
    finally:
        g.close()
    assert g.reporting is False
    assert 0.3 <= res.latency_p50_ms / 1e3 and res.throughput_items_per_s == pytest.approx(1e3 / res.latency_p50_ms)


@pytest.mark.slow
def test_a_failing_or_silent_program_is_an_error_that_shows_its_output(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nprint('the model file is missing', file=sys.stderr)\nsys.exit(4)\n")
    g = ProgramGroups([sys.executable, str(bad)], [0, 1])
    try:
        with pytest.raises(WorkerError, match=r"exited with code 4(.|\n)*the model file is missing"):
            g.measure(ParallelConfig(instances=1, intra_op_threads=1), 0.1, 0.1)
    finally:
        g.close()  # (its temporary directory was left in /tmp by every test run)
    silent = tmp_path / "silent.py"
    silent.write_text(f"import os, time\nopen({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    g = ProgramGroups([sys.executable, str(silent)], [0, 1], first_report_timeout_s=3.0)
    with pytest.raises(WorkerError, match="neither reported work"):
        g.measure(ParallelConfig(instances=1, intra_op_threads=1), 0.1, 0.1)
    g.close()
    pid_file = tmp_path / "pid"
    # on a busy machine the interpreter may not have reached its first line within the timeout:
    # then it was stopped before writing its pid, which is fine too
    if pid_file.exists() and pid_file.read_text():
        assert not _alive(int(pid_file.read_text()))
