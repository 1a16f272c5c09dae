"""Search space, objectives and an end-to-end tune within a small budget."""

import pytest

from batchcraft.errors import ConfigurationError
from batchcraft.parallel import BASELINES, ParallelConfig, baseline_configs, tune
from batchcraft.parallel.analysis import GraphAnalysis, HeavyOp
from batchcraft.parallel.grid import candidate_grid, candidates
from batchcraft.parallel.objective import Objective
from batchcraft.parallel.trial import TrialResult


def score(result, objective, limit=None):
    return Objective(objective, limit).score(result)


def prior_speed(cfg, analysis, objective):
    return Objective(objective).prior(cfg, analysis)


def _candidates(analysis, traceable, batch_size, cpus, objective="throughput"):
    return candidates(analysis, traceable, batch_size, cpus, Objective(objective))


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


def _analysis(flops_per_level):
    ops = [HeavyOp(f"n{i}_{j}", "conv", "x", f, i + 1) for i, level in enumerate(flops_per_level)
           for j, f in enumerate(level)]
    return GraphAnalysis(heavy_ops=ops, depth=len(flops_per_level), average_width=len(ops) / len(flops_per_level),
                         max_width=max(len(level) for level in flops_per_level),
                         width_per_level=[len(level) for level in flops_per_level], total_flops=sum(o.flops for o in ops))


def test_pools_are_pruned_where_little_work_can_overlap():
    cpus = list(range(4))
    # a recommender-like graph: 8 lookups side by side, tiny next to the MLP after them
    lookups = _analysis([[10] * 8, [10_000], [10_000]])
    assert lookups.parallel_flops_fraction == pytest.approx(70 / 20_080)
    assert {c.inter_op_threads for c in candidate_grid(lookups, 8, cpus)} == {1}
    assert {c.inter_op_threads for c in candidate_grid(lookups, 8, cpus, prune=False)} == {1, 2, 4}
    # an inception-like graph: four equal branches
    branches = _analysis([[100], [100] * 4, [100]])
    assert branches.parallel_flops_fraction == pytest.approx(300 / 600)
    assert {c.inter_op_threads for c in candidate_grid(branches, 8, cpus)} == {1, 2, 4}


def test_candidates_come_most_promising_first():
    cpus = [0, 1, 2, 3]
    chain = _analysis([[100], [100], [100]])
    search, base = _candidates(chain, True, 8, cpus, "throughput")
    assert [b.label for b in base] == list(BASELINES)
    assert all(c.key() not in {b.key() for b in base} for c in search)
    assert (search[0].instances, search[0].intra_op_threads) == (4, 1)  # throughput: instances first
    search, _ = _candidates(chain, True, 8, cpus, "latency")
    # latency: one instance, most threads (1 x 4 is the width guideline, a baseline)
    assert (search[0].instances, search[0].intra_op_threads) == (1, 2)
    wide = _analysis([[100], [100] * 4, [100] * 4, [100]])
    assert prior_speed(ParallelConfig(1, 2, 1, 8), wide, "latency") > prior_speed(ParallelConfig(1, 1, 1, 8), wide,
                                                                                   "latency")


def test_head_to_head_measures_each_configuration_in_order():
    from batchcraft.parallel import head_to_head

    a = ParallelConfig(instances=1, inter_op_threads=1, intra_op_threads=1, batch_size=4, label="a")
    b = ParallelConfig(instances=1, inter_op_threads=1, intra_op_threads=1, batch_size=16, label="b")
    res = head_to_head("mlp_fc512", [a, b], rounds=2, duration_s=0.05, warmup_s=0.05)
    assert [r.config["label"] for r in res] == ["a", "b"]
    assert [r.batch_size for r in res] == [4, 16]
    assert all(r.throughput_items_per_s > 0 and r.calls >= 5 for r in res)


@pytest.mark.parametrize("configs, rounds", [([], 3), ([ParallelConfig(label="x")], 0)])
def test_head_to_head_rejects_bad_arguments(configs, rounds):
    from batchcraft.parallel import head_to_head

    with pytest.raises(ConfigurationError):
        head_to_head("mlp_fc512", configs, rounds=rounds)
