"""Work-based sharding: balanced, deterministic, every instance once."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchcraft.distributed import EpochPlan, batch_by_work, plan_epoch, shard, shard_by_work


def test_doctests():
    assert doctest.testmod(shard).failed == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=40), st.integers(1, 5))
def test_shards_partition_and_lpt_bound(works, world):
    shards = shard_by_work(works, world, work=float)
    assert len(shards) == world
    assert sorted(i for s in shards for i in s) == list(range(len(works)))
    assert all(s == sorted(s) for s in shards)
    loads = [sum(works[i] for i in s) for s in shards]
    # LPT: max load <= mean load + heaviest instance (and <= 4/3 of optimal)
    assert max(loads) <= sum(works) / world + max(works, default=0) + 1e-9


def test_shards_by_work_not_count(ud_sentences):
    sents = ud_sentences[:40]
    shards = shard_by_work(sents, 2)
    loads = [sum(len(sents[i]) for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= max(len(s) for s in sents)
    # a count split of the same sentences is much less balanced here
    half = len(sents) // 2
    count_loads = [sum(len(s) for s in sents[:half]), sum(len(s) for s in sents[half:])]
    assert abs(loads[0] - loads[1]) < abs(count_loads[0] - count_loads[1])


def test_same_plan_on_every_call(ud_sentences):
    assert plan_epoch(ud_sentences, 3, 100) == plan_epoch(list(ud_sentences), 3, 100)


def test_batch_by_work_budget():
    works = [3, 3, 3, 10, 1, 1]
    assert batch_by_work(range(6), works, 6) == [[0, 1], [2], [3], [4, 5]]  # 10 > 6 goes alone
    with pytest.raises(ValueError, match="max_work"):
        batch_by_work([0], works, 0)


def test_epoch_plan_union_and_global_work():
    plan = EpochPlan([[[0, 1], [4]], [[2, 3]]], [1.0, 2.0, 3.0, 4.0, 5.0])
    assert plan.steps == 2 and plan.world_size == 2
    assert plan.union(0) == [0, 1, 2, 3] and plan.global_work(0) == 10.0
    assert plan.union(1) == [4] and plan.global_work(1) == 5.0   # rank 1 has finished
    assert plan.rank_work(1) == 7.0


def test_plan_epoch_covers_every_instance(ud_sentences):
    plan = plan_epoch(ud_sentences, 2, max_batch_work=80)
    seen = sorted(i for r in range(2) for b in plan.rank_batches(r) for i in b)
    assert seen == list(range(len(ud_sentences)))
    for r in range(2):
        for b in plan.rank_batches(r):
            assert len(b) == 1 or sum(len(ud_sentences[i]) for i in b) <= 80


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="world_size"):
        shard_by_work([1], 0, work=float)
    with pytest.raises(ValueError, match="instance 1"):
        shard_by_work([1, -2], 2, work=float)
    with pytest.raises(TypeError, match="work="):
        shard_by_work([object()], 2)
