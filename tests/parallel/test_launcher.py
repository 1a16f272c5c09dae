"""Launcher and worker groups: instances pinned and threaded before torch loads (seen from inside),
knobs applied, NUMA binding, torchrun ranks; stopping (see test_stopping.py)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

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


SEEN = textwrap.dedent("""
    import json, os, sys
    import torch
    def seen(path):
        with open(path + os.environ["BATCHCRAFT_INSTANCE"], "w") as f:
            json.dump({"affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                       "interop": torch.get_num_interop_threads(), "argv": sys.argv, "name": __name__,
                       "utf8": sys.flags.utf8_mode, "linear": torch.nn.Linear.forward.__name__,
                       "conv": torch.nn.Conv2d.forward.__name__, "wait": os.environ.get("OMP_WAIT_POLICY"),
                       "maps": open("/proc/self/maps").read().count("jemalloc")}, f)
""")


def _seen(tmp_path, i=0):
    return json.loads((tmp_path / f"seen{i}").read_text())


@needs_two
def test_python_dash_c_and_interpreter_options_get_the_thread_settings_too(tmp_path):
    (tmp_path / "seenlib.py").write_text(SEEN)
    cfg = ParallelConfig(instances=2, inter_op_threads=1, intra_op_threads=1)
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import seenlib; seenlib.seen({str(tmp_path / 'seen')!r})"
    assert launch(cfg, [sys.executable, "-X", "utf8", "-c", code, "a", "b"], cpus=usable_cpus()[:2]) == 0
    for i in range(2):
        s = _seen(tmp_path, i)
        assert s["threads"] == 1 and s["interop"] == 1 and s["affinity"] == [usable_cpus()[i]]
        assert s["argv"] == ["-c", "a", "b"] and s["utf8"] == 1


def test_knobs_named_by_the_configuration_are_applied(tmp_path):
    from batchcraft.parallel.env_knobs import find_allocator

    (tmp_path / "seenlib.py").write_text(SEEN)
    script = tmp_path / "run.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import seenlib; "
                      f"seenlib.seen({str(tmp_path / 'seen')!r})\n")
    allocator = "jemalloc" if find_allocator("jemalloc") else "default"
    cfg = ParallelConfig(instances=1, intra_op_threads=1, matmul="onednn", conv="channels-last",
                         omp_wait_policy="passive", allocator=allocator)
    assert launch(cfg, [sys.executable, str(script)]) == 0
    s = _seen(tmp_path)
    assert (s["linear"], s["conv"], s["wait"]) == ("linear_forward", "conv_forward", "PASSIVE")
    assert (s["maps"] > 0) == (allocator == "jemalloc")  # LD_PRELOAD put jemalloc into the process


def test_a_missing_allocator_is_a_clear_error_before_anything_starts(monkeypatch, tmp_path):
    import batchcraft.parallel.env_knobs as env_knobs

    monkeypatch.setattr(env_knobs, "find_allocator", lambda name: None)
    with pytest.raises(ConfigurationError, match="allocator 'tcmalloc' is not installed"):
        launch(ParallelConfig(intra_op_threads=1, allocator="tcmalloc"), [sys.executable, "-c", "pass"])


@pytest.mark.slow
def test_unpinned_instances_that_oversubscribe_get_a_warning(capfd):
    cfg = ParallelConfig(instances=2, intra_op_threads=None, pin=False, label="pytorch-default")
    assert launch(cfg, [sys.executable, "-c", "pass"], oversubscribe=True) == 0
    err = capfd.readouterr().err
    assert "warning: oversubscribed" in err and "PyTorch's default" in err
    assert launch(ParallelConfig(instances=1, intra_op_threads=1), [sys.executable, "-c", "pass"]) == 0
    assert "oversubscribed" not in capfd.readouterr().err


@needs_two
@pytest.mark.slow
def test_launch_under_local_rank_pins_disjoint_cores(tmp_path):
    (tmp_path / "seenlib.py").write_text(SEEN)
    (tmp_path / "cfg.json").write_text(json.dumps({"parallel_config": {"instances": 2, "intra_op_threads": 1}}))
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import seenlib, os; "
            f"seenlib.seen({str(tmp_path)!r} + '/rank' + os.environ['LOCAL_RANK'] + '-')")
    procs = []
    for rank in range(2):  # what torchrun --nproc-per-node 2 starts: one launcher per local rank
        env = {**os.environ, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, "-m", "batchcraft", "launch", "--config",
                                       str(tmp_path / "cfg.json"), "--", sys.executable, "-c", code], env=env))
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    seen = [json.loads((tmp_path / f"rank{r}-0").read_text()) for r in range(2)]
    assert not (tmp_path / "rank0-1").exists()  # one instance per rank
    assert seen[0]["affinity"] != seen[1]["affinity"]
    assert not set(seen[0]["affinity"]) & set(seen[1]["affinity"])
    assert all(s["threads"] == 1 for s in seen)


@needs_two
@pytest.mark.slow
def test_under_real_torchrun_the_ranks_split_the_cores(tmp_path):
    # one os.write per rank: both ranks share torchrun's stdout, and print's pieces interleave there
    (tmp_path / "show.py").write_text("import json, os, torch\n"
                                      "os.write(1, ('SEEN ' + json.dumps([os.environ['LOCAL_RANK'], sorted(os.sched_getaffinity(0)),"
                                      " torch.get_num_threads()]) + '\\n').encode())\n")
    (tmp_path / "cfg.json").write_text(json.dumps({"parallel_config": {"instances": 1, "intra_op_threads": 2}}))
    batchcraft = str(Path(sys.executable).with_name("batchcraft"))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "--no-python", batchcraft, "launch", "--config", str(tmp_path / "cfg.json"), "--",
                          sys.executable, str(tmp_path / "show.py")], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = sorted(json.loads(line.split("SEEN ", 1)[1]) for line in out.stdout.splitlines() if "SEEN " in line)
    assert [s[0] for s in seen] == ["0", "1"]
    assert not set(seen[0][1]) & set(seen[1][1]) and all(s[2] == 1 for s in seen)  # 2 threads capped to 1 core each
    assert "intra-op threads 2 -> 1" in out.stderr


def test_for_local_rank_splits_a_larger_machine():
    from batchcraft.parallel.launcher import for_local_rank

    cfg = ParallelConfig(instances=4, inter_op_threads=1, intra_op_threads=2)
    shares = [for_local_rank(cfg, list(range(16)), r, 4) for r in range(4)]
    assert [s[1] for s in shares] == [list(range(4 * r, 4 * r + 4)) for r in range(4)]
    assert all(c.instances == 1 and c.intra_op_threads == 2 and c.pin for c, _, _ in shares)
    default = ParallelConfig(intra_op_threads=None, pin=False)
    c, share, _ = for_local_rank(default, list(range(16)), 1, 2)
    assert (c.intra_op_threads, c.pin, share) == (8, True, list(range(8, 16)))
    c, share, notes = for_local_rank(ParallelConfig(intra_op_threads=8), list(range(4)), 0, 2)
    assert c.intra_op_threads == 2 and "8 -> 2" in notes[0]


def test_memory_is_bound_to_the_instances_node(tmp_path):
    # this machine has one node: bind to node 0 for real and read the policy back from the kernel
    from batchcraft.parallel.processes import bootstrap_code, instance_env, instance_spec, spawn, stop

    probe = tmp_path / "policy.py"
    probe.write_text(textwrap.dedent("""
        import ctypes, platform, sys
        nr = {"x86_64": 239, "aarch64": 236}[platform.machine()]  # get_mempolicy
        mode, mask = ctypes.c_int(), (ctypes.c_ulong * 16)()
        assert ctypes.CDLL(None).syscall(nr, ctypes.byref(mode), mask, ctypes.c_ulong(16 * 64), None, 0) == 0
        open(sys.argv[1], "w").write(f"{mode.value} {mask[0]}")
    """))
    if __import__("platform").machine() not in ("x86_64", "aarch64"):
        pytest.skip("get_mempolicy number known for x86_64 / aarch64 only")
    cfg = ParallelConfig(instances=1, intra_op_threads=1)
    spec = {**instance_spec(cfg, 0, usable_cpus(), "python-script"), "membind": [0]}
    p = spawn([sys.executable, "-c", bootstrap_code(), json.dumps(spec), str(probe), str(tmp_path / "out")],
              instance_env(cfg, 0))
    assert p.wait(timeout=300) == 0
    stop([p], 1.0)
    mode, mask = (tmp_path / "out").read_text().split()
    assert (int(mode), int(mask)) == (2, 1)  # MPOL_BIND, node 0


def test_a_model_variant_whose_values_differ_is_refused():
    from torch import nn

    from batchcraft.parallel._worker import DEFAULT_VARIANT, Variants
    from batchcraft.parallel.workload import Workload

    class Fragile(nn.Module):  # its output depends on the layer's class: a converted layer changes it
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + (0.0 if type(self.lin) is nn.Linear else 1.0)

    m = Fragile().eval()
    v = Variants(Workload("fragile", m, lambda b: torch.randn(b, 4), m), pools=1, intra=None)
    x = torch.randn(3, 4)
    assert v.get(DEFAULT_VARIANT, x) is v.runners[DEFAULT_VARIANT]
    with pytest.raises(AssertionError, match="variant"):
        v.get(("onednn", "default", False), x)
    lin = nn.Linear(4, 2).eval()
    ok = Variants(Workload("lin", lin, lambda b: torch.randn(b, 4), lin), pools=1, intra=None)
    assert ok.get(("onednn", "default", False), x) is not None  # equal to float32 rounding: accepted


@needs_two
@pytest.mark.slow
def test_worker_groups_apply_process_knobs_and_switch_model_variants():
    from batchcraft.parallel.env_knobs import find_allocator

    allocator = "jemalloc" if find_allocator("jemalloc") else "default"
    cfg = ParallelConfig(instances=2, intra_op_threads=1, omp_wait_policy="passive", allocator=allocator)
    with WorkerGroup(cfg, "mlp_fc512", cpus=usable_cpus()[:2]) as g:
        assert all(i["omp_wait_policy_env"] == "PASSIVE" for i in g.info)
        assert all(("jemalloc" in (i["ld_preload_env"] or "")) == (allocator == "jemalloc") for i in g.info)
        a = g.measure(4, 0.1, warmup_s=0.02)
        b = g.measure(4, 0.1, warmup_s=0.02, variant=("onednn", "default", False))
    assert a.throughput_items_per_s > 0 and b.throughput_items_per_s > 0
    assert (a.config["matmul"], b.config["matmul"]) == ("default", "onednn")


@needs_two
@pytest.mark.slow
def test_backends_race_inside_the_instances_for_real():
    from batchcraft.parallel.groups import variant_race_result

    cfg = ParallelConfig(instances=2, intra_op_threads=1, batch_size=8)
    cfgs = [cfg, cfg.replace(matmul="onednn"), cfg.replace(matmul="mkl-packed")]
    with WorkerGroup(cfg, "mlp_fc512", cpus=usable_cpus()[:2]) as g:
        blocks = g.race_variants(8, [c.variant() for c in cfgs], 0.2, warmup_s=0.02, block_s=0.005, min_rounds=5)
    assert len(blocks) == 2 and all(len({(r, j) for r, j, _, _ in bl}) == len(bl) for bl in blocks)
    results, race = variant_race_result(cfgs, blocks, 0.2)
    assert race.rounds >= 5 and all(r.throughput_items_per_s > 0 and r.calls >= 5 for r in results)
    assert [r.config["matmul"] for r in results] == ["default", "onednn", "mkl-packed"]
    iv = race.ratio(1, 0)
    assert iv.units == race.rounds and iv.low <= iv.estimate <= iv.high


def _children() -> set[int]:
    """PIDs of this process's children (any state), from /proc."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                out.add(int(d))
    return out


@needs_two
@pytest.mark.slow
def test_a_fresh_race_starts_its_own_processes_and_stops_them():
    from batchcraft.parallel.groups import Groups
    from batchcraft.parallel.processes import group_alive
    from batchcraft.parallel.workload import model_spec

    cfg = ParallelConfig(instances=2, intra_op_threads=1, batch_size=4)
    groups = Groups(model_spec("mlp_fc512"), usable_cpus()[:2])
    try:
        groups.start_all([cfg])
        running = groups._groups[cfg.key()]
        pids = {i["pid"] for i in running.info}
        before = _children()  # the running set and the stop watchdog
        results, race = groups.race_variants([cfg, cfg.replace(matmul="onednn")], 0.1, 0.02, 0.005, fresh=True)
        assert race.rounds >= 5 and all(r.throughput_items_per_s > 0 for r in results)
        assert groups._groups[cfg.key()] is running and all(p.poll() is None for p in running._procs)
        assert _children() == before  # the fresh set stopped and reaped
        results2, _ = groups.race_variants([cfg, cfg.replace(matmul="onednn")], 0.1, 0.02, 0.005)
        assert all(r.throughput_items_per_s > 0 for r in results2)
        assert {i["pid"] for i in running.info} == pids
    finally:
        groups.close()
    assert not any(group_alive(pid) for pid in pids)


@pytest.mark.slow
def test_the_compile_variant_is_built_checked_and_prepare_compiles_under_launch(monkeypatch):
    from torch import nn

    from batchcraft.parallel import prepare
    from batchcraft.parallel._worker import Variants
    from batchcraft.parallel.workload import Workload

    lin = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    v = Variants(Workload("tiny", lin, lambda b: torch.randn(b, 8), lin), pools=1, intra=None)
    x = torch.randn(4, 8)
    run = v.get(("default", "default", True), x)  # compiles, then checked against the eager output
    with torch.inference_mode():
        torch.testing.assert_close(run(x), lin(x), rtol=1e-5, atol=1e-6)
    monkeypatch.delenv("BATCHCRAFT_COMPILE", raising=False)
    assert prepare(lin) is lin
    monkeypatch.setenv("BATCHCRAFT_COMPILE", "1")
    assert prepare(lin) is not lin and hasattr(prepare(lin), "_orig_mod")
