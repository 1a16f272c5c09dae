"""Stopping instances (issue 15, item 6): signals forwarded like Ctrl-C, whole process groups
stopped, nothing left running, on every path. Each case is compared with the same program run
by hand: the instance sees the same signal as it would by hand, and what by hand survives (the
program's own children) does not survive batchcraft.

Waits use generous deadlines (they cost nothing when things work) so that the tests hold while
another process uses both cores; what they bound is "stops at all", checked by pid.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from batchcraft.parallel import ParallelConfig, launch, usable_cpus

pytestmark = pytest.mark.slow
TWO = len(usable_cpus()) >= 2

# A program that starts a child of its own (sleep), says which pids it has, and on the signal
# under test writes a marker and exits without stopping its child (as many real programs do).
PROGRAM = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    out = sys.argv[1]
    sig = getattr(signal, sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "none" else None
    tag = os.environ.get("BATCHCRAFT_INSTANCE", "hand")
    child = subprocess.Popen(["sleep", "600"])
    def on_signal(signum, frame):
        open(os.path.join(out, f"got-{tag}"), "w").write(str(signum))
        os._exit(0)
    if sig is not None:
        signal.signal(sig, on_signal)
    if len(sys.argv) > 3 and sys.argv[3] == "ignore":
        signal.signal(sig, signal.SIG_IGN)
    open(os.path.join(out, f"pids-{tag}.tmp"), "w").write(json.dumps([os.getpid(), child.pid]))
    os.replace(os.path.join(out, f"pids-{tag}.tmp"), os.path.join(out, f"pids-{tag}"))
    if len(sys.argv) > 4:
        sys.exit(int(sys.argv[4]))
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(cond, timeout=120.0, what=""):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def gone(pids, timeout=60.0):
    wait_for(lambda: not any(alive(p) for p in pids), timeout, f"pids {pids} to end")


def kill_quietly(pids):
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launcher_process(tmp_path, script, *args, instances=2, grace_s=2.0):
    code = ("import sys; from batchcraft.parallel import ParallelConfig, launch; "
            f"sys.exit(launch(ParallelConfig(instances={instances}, intra_op_threads=1), "
            f"[sys.executable, {str(script)!r}, {str(tmp_path)!r}, *{list(args)!r}], grace_s={grace_s}))")
    # its own session: a signal sent to it does not also reach the test's process group
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def pids_of(tmp_path, tag):
    return json.loads((tmp_path / f"pids-{tag}").read_text())


@pytest.mark.skipif(not TWO, reason="needs 2 usable cores")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_stop_signals_are_forwarded_and_whole_groups_stopped(tmp_path, sig):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    signum = getattr(signal, sig)
    # by hand: the program gets the signal, writes its marker, and its child survives it
    hand = tmp_path / "hand"
    hand.mkdir()
    p = subprocess.Popen([sys.executable, str(script), str(hand), sig], start_new_session=True)
    try:
        wait_for(lambda: (hand / "pids-hand").exists(), what="the program run by hand")
        own, child = pids_of(hand, "hand")
        os.kill(own, signum)
        assert p.wait(timeout=60) == 0
        assert (hand / "got-hand").read_text() == str(signum)
        time.sleep(0.2)
        assert alive(child)  # by hand, the program's child is left running
    finally:
        kill_quietly([child])
    # under batchcraft launch: each instance gets the same signal, then its whole group is stopped
    proc = launcher_process(tmp_path, script, sig)
    try:
        wait_for(lambda: all((tmp_path / f"pids-{i}").exists() for i in (0, 1)), what="both instances")
        pids = [p for i in (0, 1) for p in pids_of(tmp_path, i)]
        os.kill(proc.pid, signum)
        assert proc.wait(timeout=60) == 128 + signum
        assert all((tmp_path / f"got-{i}").read_text() == str(signum) for i in (0, 1))
        gone(pids)
    finally:
        proc.kill()
        kill_quietly(pids if "pids" in locals() else [])


@pytest.mark.skipif(not TWO, reason="needs 2 usable cores")
def test_an_instance_that_ignores_the_signal_is_killed_after_the_grace_period(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = launcher_process(tmp_path, script, "SIGTERM", "ignore", grace_s=1.0)
    try:
        wait_for(lambda: all((tmp_path / f"pids-{i}").exists() for i in (0, 1)), what="both instances")
        pids = [p for i in (0, 1) for p in pids_of(tmp_path, i)]
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert not any((tmp_path / f"got-{i}").exists() for i in (0, 1))  # it ignored SIGTERM...
        gone(pids)  # ...and was killed with its child
    finally:
        proc.kill()


@pytest.mark.skipif(not TWO, reason="needs 2 usable cores")
def test_a_failing_instance_stops_the_others_and_their_children(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(PROGRAM.replace('if len(sys.argv) > 4:', 'if tag == "1":').replace(
        "sys.exit(int(sys.argv[4]))", "sys.exit(3)"))
    t0 = time.monotonic()
    rc = launch(ParallelConfig(instances=2, intra_op_threads=1), [sys.executable, str(script), str(tmp_path), "none"],
                grace_s=2)
    assert rc == 3
    # the other instance may be stopped before it wrote its pids (the failing one exits at once)
    pids = [p for i in (0, 1) if (tmp_path / f"pids-{i}").exists() for p in pids_of(tmp_path, i)]
    try:
        gone(pids, timeout=10)  # already gone when launch returns, a moment for the kernel
        assert time.monotonic() - t0 < 300  # far below the program's 600-s sleep
    finally:
        kill_quietly(pids)


def test_children_left_by_instances_that_succeeded_are_stopped(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text(PROGRAM)
    # by hand the child outlives the program
    hand = tmp_path / "hand"
    hand.mkdir()
    assert subprocess.run([sys.executable, str(script), str(hand), "none", "no", "0"], timeout=120).returncode == 0
    _, child = pids_of(hand, "hand")
    try:
        assert alive(child)
    finally:
        kill_quietly([child])
    rc = launch(ParallelConfig(instances=1, intra_op_threads=1), [sys.executable, str(script), str(tmp_path), "none",
                                                                  "no", "0"], grace_s=1)
    assert rc == 0
    gone(pids_of(tmp_path, 0), timeout=10)


def test_a_launcher_killed_with_sigkill_leaves_nothing_running(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = launcher_process(tmp_path, script, "none", instances=1)
    try:
        wait_for(lambda: (tmp_path / "pids-0").exists(), what="the instance")
        instance, child = pids_of(tmp_path, 0)
        os.kill(proc.pid, signal.SIGKILL)  # no handler runs: the kernel (PDEATHSIG) and the watchdog act
        proc.wait(timeout=60)
        gone([instance, child])  # the instance's own child too
    finally:
        kill_quietly([instance, child] if "child" in locals() else [])


@pytest.mark.skipif(not TWO, reason="needs 2 usable cores")
def test_worker_groups_stop_their_instances_whole_groups(tmp_path):
    from batchcraft.parallel import WorkerGroup

    g = WorkerGroup(ParallelConfig(instances=2, intra_op_threads=1), "mlp_fc512").start()
    pids = [i["pid"] for i in g.info]
    pgids = [os.getpgid(p) for p in pids]
    assert pgids == pids  # each instance leads its own group
    g.close()
    gone(pids, timeout=10)
