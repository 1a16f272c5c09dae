"""Configurations: validation against the usable cores, pinning blocks, affinity-aware defaults."""

import json
import os
import threading

import pytest

from batchcraft.errors import ConfigurationError
from batchcraft.parallel import ParallelConfig, baseline_configs, physical_cores, usable_cpus, width_guideline
from batchcraft.parallel.analysis import GraphAnalysis


def test_more_threads_than_cores_is_refused():
    with pytest.raises(ConfigurationError, match=r"2 instances x 1 inter-op x 2 intra-op threads = 4 threads but only 2"):
        ParallelConfig(instances=2, intra_op_threads=2).validate([0, 1])
    ParallelConfig(instances=2, intra_op_threads=2).validate([0, 1], oversubscribe=True)  # baselines may


@pytest.mark.parametrize("field,value", [("instances", 0), ("inter_op_threads", 0), ("batch_size", 0),
                                         ("intra_op_threads", 0), ("instances", 1.5)])
def test_counts_below_one_are_refused(field, value):
    with pytest.raises(ConfigurationError, match=field):
        ParallelConfig(**{field: value}).validate([0, 1])


def test_more_instances_than_cores():
    with pytest.raises(ConfigurationError, match="3 instances but only 2 usable cores"):
        ParallelConfig(instances=3, intra_op_threads=None).validate([0, 1])


def test_instances_get_disjoint_contiguous_blocks():
    cfg = ParallelConfig(instances=2, intra_op_threads=2)
    assert cfg.cpus_for(0, [0, 1, 2, 3]) == [0, 1]
    assert cfg.cpus_for(1, [0, 1, 2, 3]) == [2, 3]
    assert ParallelConfig(intra_op_threads=None).cpus_for(0, [0, 1]) is None  # PyTorch default: unpinned


def test_thread_env_sets_omp_and_mkl():
    env = ParallelConfig(intra_op_threads=3, inter_op_threads=2).thread_env()
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert env["BATCHCRAFT_INTER_OP_THREADS"] == "2"
    assert "OMP_NUM_THREADS" not in ParallelConfig(intra_op_threads=None).thread_env()


def test_save_load_round_trip_and_tune_output(tmp_path):
    cfg = ParallelConfig(instances=2, inter_op_threads=1, intra_op_threads=1, batch_size=8, label="grid")
    cfg.save(tmp_path / "c.json")
    assert ParallelConfig.load(tmp_path / "c.json") == cfg
    (tmp_path / "t.json").write_text(json.dumps({"best": {**cfg.to_dict(), "throughput_items_per_s": 5.0}}))
    assert ParallelConfig.load(tmp_path / "t.json") == cfg


def test_load_errors(tmp_path):
    with pytest.raises(ConfigurationError, match="no such file"):
        ParallelConfig.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigurationError, match="cannot read"):
        ParallelConfig.load(tmp_path / "bad.json")
    # a misspelled key or a file without a configuration ran with the defaults, silently (a new
    # user's find, stop 47)
    (tmp_path / "typo.json").write_text(json.dumps({"parallel_config": {"instanses": 2}}))
    with pytest.raises(ConfigurationError, match="'instanses' \\(did you mean 'instances'\\?\\)"):
        ParallelConfig.load(tmp_path / "typo.json")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ConfigurationError, match="no configuration object"):
        ParallelConfig.load(tmp_path / "empty.json")


def _in_thread_with_affinity(cpus, fn):
    # sched_setaffinity(0) pins only the calling thread on Linux: a pinned helper thread sees a
    # smaller machine without touching the test process.
    out = {}

    def body():
        os.sched_setaffinity(0, cpus)
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001
            out["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_defaults_follow_the_affinity_mask_not_cpu_count():
    first = sorted(os.sched_getaffinity(0))[:1]
    assert _in_thread_with_affinity(first, usable_cpus) == first
    assert _in_thread_with_affinity(first, physical_cores) == 1
    wide = GraphAnalysis(depth=2, average_width=4.0, max_width=4)
    guided = _in_thread_with_affinity(first, lambda: width_guideline(wide, 1, usable_cpus()))
    assert (guided.inter_op_threads, guided.intra_op_threads) == (1, 1)
    base = _in_thread_with_affinity(first, lambda: baseline_configs(wide, 1, usable_cpus()))
    assert all(b.intra_op_threads in (None, 1) for b in base)
    with pytest.raises(ConfigurationError, match="only 1 usable cores"):
        _in_thread_with_affinity(first, lambda: ParallelConfig(intra_op_threads=2).validate())


def test_width_guideline_on_two_cores():
    cpus = [0, 1]
    if physical_cores(cpus) != 2:
        pytest.skip("needs CPUs 0 and 1 to be two physical cores")
    wide = GraphAnalysis(depth=5, average_width=4.4, max_width=18)
    assert (width_guideline(wide, 8, cpus).inter_op_threads, width_guideline(wide, 8, cpus).intra_op_threads) == (2, 1)
    narrow = GraphAnalysis(depth=5, average_width=1.0, max_width=1)
    assert (width_guideline(narrow, 8, cpus).inter_op_threads, width_guideline(narrow, 8, cpus).intra_op_threads) == (1, 2)


def test_knobs_are_validated_saved_and_loaded(tmp_path):
    cfg = ParallelConfig(instances=1, intra_op_threads=2, matmul="onednn", conv="channels-last",
                         omp_wait_policy="passive")
    cfg.validate([0, 1])
    cfg.save(tmp_path / "c.json")
    assert ParallelConfig.load(tmp_path / "c.json") == cfg
    assert cfg.knobs() == {"matmul": "onednn", "conv": "channels-last", "omp_wait_policy": "passive"}
    assert "matmul onednn" in cfg.short()
    assert cfg.key() == cfg.replace(matmul="default").key() != cfg.replace(omp_wait_policy="active").key()
    assert cfg.variant() == ("onednn", "channels-last", False)
    with pytest.raises(ConfigurationError, match="matmul must be one of"):
        ParallelConfig(matmul="cublas").validate([0, 1])
    with pytest.raises(ConfigurationError, match="compile=True needs"):
        ParallelConfig(compile=True, matmul="onednn").validate([0, 1])
    (tmp_path / "bad.json").write_text(json.dumps({"parallel_config": {"allocator": "hoard"}}))
    with pytest.raises(ConfigurationError, match="bad.json.*allocator must be one of"):
        ParallelConfig.load(tmp_path / "bad.json")


def test_old_saved_configurations_still_load(tmp_path):
    # a best.json of the previous format: the configuration and its result under "best"
    (tmp_path / "old.json").write_text(json.dumps({"best": {"instances": 2, "inter_op_threads": 1,
                                                            "intra_op_threads": 1, "batch_size": 8, "pin": True,
                                                            "env": {}, "label": "grid",
                                                            "throughput_items_per_s": 5.0}}))
    cfg = ParallelConfig.load(tmp_path / "old.json")
    assert (cfg.instances, cfg.matmul, cfg.allocator) == (2, "default", "default")


def test_thread_env_carries_the_knobs():
    env = ParallelConfig(intra_op_threads=1, omp_wait_policy="active", matmul="mkl-packed").thread_env()
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["KMP_BLOCKTIME"] == "infinite"
    assert env["BATCHCRAFT_MATMUL"] == "mkl-packed" and env["BATCHCRAFT_COMPILE"] == ""


@pytest.mark.parametrize("cfg,cpus,expect", [
    (ParallelConfig(instances=2, intra_op_threads=None, pin=False), [0, 1], "2 instance(s) x PyTorch's default 2"),
    (ParallelConfig(instances=2, intra_op_threads=2), [0, 1], "= 4 threads on 2 usable cores"),
    (ParallelConfig(instances=1, intra_op_threads=None, pin=False), [0, 1], None),
    (ParallelConfig(instances=2, intra_op_threads=1), [0, 1], None),
])
def test_oversubscription_is_explained(cfg, cpus, expect):
    why = cfg.oversubscription(cpus)
    assert (why is None) if expect is None else (expect in why)


def test_local_rank_reads_torchrun_variables(monkeypatch):
    from batchcraft.parallel import local_rank, rank_cpus

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_rank() is None
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_rank() == (1, 2)
    assert rank_cpus([0, 1, 2, 3], 1, 2) == [2, 3] and rank_cpus([0, 1], 0, 1) == [0, 1]
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigurationError, match="LOCAL_RANK"):
        local_rank()
