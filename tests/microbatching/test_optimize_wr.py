"""WR dynamic programme: optimum on hand-checked tables and against brute force."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchcraft.microbatching.optimize_wr import candidate_sizes, optimize_wr
from batchcraft.microbatching.types import Config


def _table(rows):
    t = {}
    for algo, n, ms, ws in rows:
        t.setdefault(n, []).append(Config(algo, n, ms, ws))
    return t


# B = 8. Fast algorithm "fast" needs 10 bytes per sample; "slow" needs none.
HAND = _table([
    ("slow", 8, 80.0, 0), ("fast", 8, 16.0, 80),
    ("slow", 4, 40.0, 0), ("fast", 4, 8.0, 40),
    ("slow", 2, 20.0, 0), ("fast", 2, 5.0, 20),
    ("slow", 1, 10.0, 0), ("fast", 1, 3.0, 10),
])


@pytest.mark.parametrize("limit, expected_ms, expected_sizes", [
    (1000, 16.0, (8,)),          # everything fits: undivided fast
    (79, 16.0, (4, 4)),          # fast at 8 does not fit; 2 x fast@4 = 16
    (39, 20.0, (2, 2, 2, 2)),    # 4 x fast@2 = 20
    (19, 24.0, (1,) * 8),        # 8 x fast@1 = 24, better than slow@8 = 80
    (9, 80.0, None),             # only "slow" fits: any division costs 80
])
def test_hand_checked_table(limit, expected_ms, expected_sizes):
    choice = optimize_wr(HAND, 8, limit)
    assert choice.time_ms == pytest.approx(expected_ms)
    assert choice.workspace_bytes <= limit
    assert sum(choice.micro_batches) == 8
    if expected_sizes is not None:
        assert choice.micro_batches == expected_sizes


def test_mixed_sizes_beat_uniform():
    # B = 6 from {4, 2}: fast@4 + fast@2 (8 + 5 = 13) beats 3 x fast@2 (15)
    t = _table([("fast", 4, 8.0, 40), ("fast", 2, 5.0, 20), ("slow", 6, 60.0, 0)])
    choice = optimize_wr(t, 6, 40)
    assert choice.time_ms == pytest.approx(13.0) and choice.micro_batches == (4, 2)


def test_infeasible_returns_none():
    assert optimize_wr(_table([("fast", 8, 1.0, 100), ("fast", 4, 1.0, 50)]), 8, 49) is None


def test_candidate_sizes():
    assert candidate_sizes(64, "powerOfTwo") == [1, 2, 4, 8, 16, 32, 64]
    assert candidate_sizes(6, "powerOfTwo") == [1, 2, 4, 6]
    assert candidate_sizes(5, "undivided") == [5]
    assert candidate_sizes(3, "all") == [1, 2, 3]
    with pytest.raises(ValueError, match="powerOfTwo"):
        candidate_sizes(8, "some")


def _brute_force(table, batch, limit):
    best = float("inf")
    sizes = sorted(table)
    usable = {s: [c for c in table[s] if c.workspace_bytes <= limit] for s in sizes}
    for k in range(1, batch + 1):
        for combo in itertools.combinations_with_replacement(sizes, k):
            if sum(combo) != batch or any(not usable[s] for s in combo):
                continue
            best = min(best, sum(min(c.time_ms for c in usable[s]) for s in combo))
    return best


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 9), st.data())
def test_dp_equals_brute_force(batch, data):
    sizes = sorted(set(data.draw(st.lists(st.integers(1, batch - 1), max_size=3))) | {batch})
    table = {s: [Config(f"a{i}", s, data.draw(st.floats(0.1, 100)), data.draw(st.integers(0, 100)))
                 for i in range(data.draw(st.integers(1, 3)))] for s in sizes}
    limit = data.draw(st.integers(0, 100))
    choice = optimize_wr(table, batch, limit)
    expected = _brute_force(table, batch, limit)
    if expected == float("inf"):
        assert choice is None
    else:
        assert choice.time_ms == pytest.approx(expected)
        assert choice.workspace_bytes <= limit and sum(choice.micro_batches) == batch
