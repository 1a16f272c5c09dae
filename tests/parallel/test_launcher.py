"""Launcher: instances pinned and threaded before torch loads (seen from inside), clean shutdown."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from batchcraft.errors import ConfigurationError, WorkerError
from batchcraft.parallel import ParallelConfig, WorkerGroup, launch, usable_cpus

TWO_CPUS = len(usable_cpus()) >= 2
needs_two = pytest.mark.skipif(not TWO_CPUS, reason="needs 2 usable cores")

REPORT = textwrap.dedent("""
    import json, os, sys
    import torch
    out = os.path.join(sys.argv[1], "instance%s.json" % os.environ["BATCHCRAFT_INSTANCE"])
    with open(out, "w") as f:
        json.dump({"affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                   "interop": torch.get_num_interop_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                   "argv": sys.argv[1:], "name": __name__}, f)
""")


@needs_two
@pytest.mark.slow
def test_worker_group_pins_and_sets_threads_inside_workers():
    cpus = usable_cpus()[:2]
    with WorkerGroup(ParallelConfig(instances=2, intra_op_threads=1), "mlp_fc512", cpus=cpus) as g:
        assert [i["affinity"] for i in g.info] == [[cpus[0]], [cpus[1]]]
        for info in g.info:
            assert info["torch_num_threads"] == 1 and info["omp_num_threads_env"] == "1"
            assert info["torch_num_interop_threads"] == 1
            assert info["torch_loaded_before_bootstrap"] is False
        res = g.measure(batch_size=4, duration_s=0.2, warmup_s=0.05)
    assert res.calls >= 2 and res.throughput_items_per_s > 0
    assert res.latency_p50_ms <= res.latency_p90_ms <= res.latency_p99_ms


@needs_two
@pytest.mark.slow
def test_worker_death_is_reported_and_the_rest_stopped():
    g = WorkerGroup(ParallelConfig(instances=2, intra_op_threads=1), "mlp_fc512").start()
    try:
        os.kill(g.info[1]["pid"], signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"instance 1 .* died with exit code -9"):
            g.measure(batch_size=2, duration_s=0.1, warmup_s=0.01)
    finally:
        g.close()
    assert all(p.poll() is not None for p in g._procs)  # every instance reaped


@needs_two
@pytest.mark.slow
def test_launch_python_script_pins_threads_and_passes_arguments(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    cfg = ParallelConfig(instances=2, inter_op_threads=1, intra_op_threads=1)
    cpus = usable_cpus()[:2]
    assert launch(cfg, [sys.executable, str(script), str(tmp_path)], cpus=cpus) == 0
    seen = [json.loads((tmp_path / f"instance{i}.json").read_text()) for i in range(2)]
    assert [s["affinity"] for s in seen] == [[cpus[0]], [cpus[1]]]
    assert all(s["threads"] == 1 and s["interop"] == 1 and s["omp"] == "1" for s in seen)
    assert all(s["argv"] == [str(tmp_path)] and s["name"] == "__main__" for s in seen)


@needs_two
@pytest.mark.slow
def test_launch_any_command_is_pinned_before_exec(tmp_path):
    out = tmp_path / "seen"
    cmd = ["sh", "-c", f'grep Cpus_allowed_list /proc/self/status > {out}$BATCHCRAFT_INSTANCE; '
                       f'echo "$OMP_NUM_THREADS $MKL_NUM_THREADS" >> {out}$BATCHCRAFT_INSTANCE']
    cpus = usable_cpus()[:2]
    assert launch(ParallelConfig(instances=2, intra_op_threads=1), cmd, cpus=cpus) == 0
    for i in range(2):
        allowed, threads = (out.parent / f"seen{i}").read_text().splitlines()
        assert allowed.split()[-1] == str(cpus[i]) and threads == "1 1"


@needs_two
@pytest.mark.slow
def test_failing_instance_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['BATCHCRAFT_INSTANCE'] == '1': sys.exit(3)\n"
                      "time.sleep(60)\n")
    t0 = time.monotonic()
    rc = launch(ParallelConfig(instances=2, intra_op_threads=1), [sys.executable, str(script)], grace_s=2)
    assert rc == 3 and time.monotonic() - t0 < 20


@needs_two
@pytest.mark.slow
def test_ctrl_c_stops_every_instance(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import os, sys, time\n"
                      "open(os.path.join(sys.argv[1], os.environ['BATCHCRAFT_INSTANCE']), 'w').write(str(os.getpid()))\n"
                      "time.sleep(60)\n")
    code = ("import sys; from batchcraft.parallel import ParallelConfig, launch; "
            f"sys.exit(launch(ParallelConfig(instances=2, intra_op_threads=1), "
            f"[sys.executable, {str(script)!r}, {str(tmp_path)!r}], grace_s=2))")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 60
    while not ((tmp_path / "0").exists() and (tmp_path / "1").exists()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C to the launcher only: it must stop the instances
    assert proc.wait(timeout=30) == 130
    for i in (0, 1):
        pid = int((tmp_path / str(i)).read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("argv,match", [
    (["python3", "definitely_missing_script.py"], "no such script"),
    (["definitely-not-a-command-xyz"], "command not found"),
    ([], "no command given"),
])
def test_bad_commands_are_configuration_errors(argv, match):
    with pytest.raises(ConfigurationError, match=match):
        launch(ParallelConfig(intra_op_threads=1), argv)


@pytest.mark.parametrize("cfg,match", [
    (ParallelConfig(instances=0), "instances must be an int >= 1"),
    (ParallelConfig(instances=1, intra_op_threads=len(usable_cpus()) + 1), "threads but only"),
])
def test_bad_configurations_are_refused_before_starting(cfg, match):
    with pytest.raises(ConfigurationError, match=match):
        launch(cfg, [sys.executable, "-c", "pass"])
    with pytest.raises(ConfigurationError, match=match):
        WorkerGroup(cfg, "mlp_fc512")
