"""BatchPolicy: pure decisions over waiting requests' work and the oldest one's wait."""

from __future__ import annotations

import math

import pytest

from batchcraft.serving import BatchPolicy


def test_waits_until_the_oldest_request_waited_max_wait():
    p = BatchPolicy(max_batch_size=4, max_wait_s=0.010)
    assert p.decide([1.0], oldest_wait_s=0.0) == (0, 0.010)
    n, wait = p.decide([1.0, 1.0], oldest_wait_s=0.004)
    assert n == 0 and math.isclose(wait, 0.006)
    assert p.decide([1.0, 1.0], oldest_wait_s=0.010) == (2, 0.0)


def test_full_batch_runs_at_once_and_takes_at_most_max_batch_size():
    p = BatchPolicy(max_batch_size=3, max_wait_s=1.0)
    assert p.decide([1.0] * 2, 0.0) == (0, 1.0)
    assert p.decide([1.0] * 3, 0.0) == (3, 0.0)
    assert p.decide([1.0] * 7, 0.0) == (3, 0.0)


def test_work_budget():
    p = BatchPolicy(max_batch_size=10, max_batch_work=20, max_wait_s=1.0)
    assert p.decide([8.0, 8.0], 0.0) == (0, 1.0)          # 16 < 20: wait for more
    assert p.decide([8.0, 8.0, 8.0], 0.0) == (2, 0.0)     # full: 2 fit, the third waits
    assert p.decide([50.0, 1.0], 0.0) == (1, 0.0)         # too heavy alone: runs by itself
    assert p.take([5.0, 5.0, 5.0, 5.0, 5.0]) == 4


def test_nothing_waiting_and_closing():
    p = BatchPolicy(max_wait_s=1.0)
    assert p.decide([], 5.0) == (0, math.inf)
    assert p.decide([1.0], 0.0, closing=True) == (1, 0.0)


def test_zero_wait_serves_what_is_there():
    assert BatchPolicy(max_wait_s=0.0).decide([1.0, 1.0], 0.0) == (2, 0.0)


@pytest.mark.parametrize("kw, match", [({"max_batch_size": 0}, "max_batch_size"),
                                       ({"max_batch_work": 0}, "max_batch_work"),
                                       ({"max_wait_s": -1}, "max_wait_s")])
def test_bad_policy(kw, match):
    with pytest.raises(ValueError, match=match):
        BatchPolicy(**kw)
