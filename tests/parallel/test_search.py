"""Search space, objectives and an end-to-end tune within a small budget."""

import pytest

from batchcraft.errors import ConfigurationError
from batchcraft.parallel import BASELINES, baseline_configs, tune
from batchcraft.parallel.analysis import GraphAnalysis
from batchcraft.parallel.launcher import TrialResult
from batchcraft.parallel.search import candidate_grid, score


def _result(thr, p50, p90):
    return TrialResult({}, 1, thr, p50, p90, p90, 10, 1.0)


@pytest.mark.parametrize("n_cpus", [1, 2, 4, 6])
def test_grid_fits_the_cores_and_pools_follow_the_width(n_cpus):
    cpus = list(range(n_cpus))
    wide = GraphAnalysis(depth=2, average_width=3.0, max_width=4)
    grid = candidate_grid(wide, 8, cpus)
    assert grid and all(c.instances * c.inter_op_threads * c.intra_op_threads <= n_cpus for c in grid)
    assert all(c.batch_size == 8 for c in grid)
    assert len({c.key() for c in grid}) == len(grid)
    assert any(c.intra_op_threads == n_cpus for c in grid)  # the whole machine for one pool
    narrow = candidate_grid(GraphAnalysis(depth=3, average_width=1.0, max_width=1), 8, cpus)
    assert {c.inter_op_threads for c in narrow} == {1}
    assert {c.inter_op_threads for c in candidate_grid(wide, 8, cpus, traceable=False)} == {1}


def test_baselines_are_what_the_docstring_says():
    cpus = [0, 1]
    base = {b.label: b for b in baseline_configs(GraphAnalysis(depth=5, average_width=4.4, max_width=18), 8, cpus)}
    assert tuple(base) == BASELINES
    d = base["pytorch-default"]
    assert (d.instances, d.inter_op_threads, d.intra_op_threads, d.pin) == (1, 1, None, False)
    t = base["tensorflow-recommended"]
    assert (t.inter_op_threads, t.intra_op_threads) == (len(cpus), len(cpus))
    i = base["intel-recommended"]
    assert i.intra_op_threads >= 1 and i.env["KMP_AFFINITY"] == "granularity=fine,compact,1,0"
    assert i.env["OMP_PROC_BIND"] == "close"


def test_latency_objective_prefers_configurations_within_the_limit():
    fast_but_slow_calls = _result(1000.0, 9.0, 12.0)
    slower_within_limit = _result(500.0, 2.0, 3.0)
    assert score(fast_but_slow_calls, "throughput") > score(slower_within_limit, "throughput")
    assert score(slower_within_limit, "latency", 5.0) > score(fast_but_slow_calls, "latency", 5.0)
    assert score(slower_within_limit, "latency") > score(fast_but_slow_calls, "latency")


@pytest.mark.parametrize("kwargs,match", [
    ({"model": "no_such_model"}, "unknown model"),
    ({"model": "mlp_fc512", "objective": "speed"}, "objective must be one of"),
    ({"model": "mlp_fc512", "batch_sizes": [0]}, "batch sizes must be ints >= 1"),
    ({"model": "mlp_fc512", "budget_s": 0}, "budget_s must be > 0"),
    ({"model": "mlp_fc512", "latency_limit_ms": 5.0}, "needs objective='latency'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        tune(**kwargs)


class _FakeGroups:
    """Deterministic stand-in for worker groups: items/s per configuration label."""

    def __init__(self, speeds):
        self.speeds, self.calls = speeds, []

    def measure(self, cfg, duration_s, warmup_s=0.3):
        self.calls.append(cfg.label)
        thr = self.speeds[cfg.label]
        return TrialResult({**cfg.to_dict()}, cfg.batch_size, thr, 1e3 / thr, 1e3 / thr, 1e3 / thr, 3, duration_s)


def test_halving_picks_the_fastest_and_spares_hopeless_candidates():
    import time

    from tqdm import tqdm

    from batchcraft.parallel import ParallelConfig
    from batchcraft.parallel.search import _Clock, _halving

    speeds = {"a": 100.0, "b": 90.0, "c": 10.0, "d": 80.0, "base": 50.0}
    cands = [ParallelConfig(1, 1, i + 1, 8, label=k) for i, k in enumerate("abcd")]
    base = [ParallelConfig(2, 1, 1, 8, label="base")]
    groups, trials, rounds = _FakeGroups(speeds), [], []
    clock = _Clock(time.monotonic() + 60, eta=2, repeats=3, n_final_baselines=1)
    winner, res, base_res, _ = _halving(cands + base, base, clock, groups, "throughput", None, trials, rounds,
                                        tqdm(disable=True), compare_baselines=True)
    assert winner.label == "a" and res.throughput_items_per_s == 100.0
    assert base_res["base"].throughput_items_per_s == 50.0
    first_round = [t["config"]["label"] for t in trials if t["round"] == 0]
    assert first_round.count("c") == 1 and first_round.count("a") == 3  # c is 10x slower: pruned
    # halving: 5 -> 3 -> 2 -> 1 survivors, then a final round with the baseline
    assert [len({r["config"]["label"] for r in rounds if r["round"] == k}) for k in range(4)] == [5, 3, 2, 2]
