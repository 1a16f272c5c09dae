"""Objective (scoring, pruning, ratios, prior) and Budget (every deadline) on a fake clock."""

import pytest

from batchcraft.errors import ConfigurationError
from batchcraft.parallel import Budget, Objective, ParallelConfig
from batchcraft.parallel.analysis import GraphAnalysis
from batchcraft.parallel.budget import SHUTDOWN_RESERVE_S, START_SHARE
from batchcraft.parallel.trial import TrialResult, aggregate


def r(thr, p50=1.0, p90=1.0):
    return TrialResult({}, 1, thr, p50, p90, p90, 10, 1.0)


def test_throughput_objective():
    o = Objective()
    assert o.score(r(200)) > o.score(r(100))
    assert o.ratio(r(200), r(100)) == 2.0 and o.value(r(7)) == 7
    assert o.hopeless(r(10), r(50)) and not o.hopeless(r(20), r(50))
    assert o.median([r(1), r(9), r(5)]).throughput_items_per_s == 5


def test_latency_objectives():
    fast_calls, slow_calls = r(100, p50=1.0, p90=2.0), r(300, p50=3.0, p90=9.0)
    plain = Objective("latency")
    assert plain.score(fast_calls) > plain.score(slow_calls) and plain.ratio(fast_calls, slow_calls) == 3.0
    limited = Objective("latency", 5.0)
    assert limited.score(fast_calls) > limited.score(slow_calls)  # only one meets the limit
    assert limited.ratio(fast_calls, slow_calls) >= 1.0 and limited.value(slow_calls) == 0.0
    both = Objective("latency", 10.0)  # both meet it: throughput decides
    assert both.score(slow_calls) > both.score(fast_calls) and both.ratio(slow_calls, fast_calls) == 3.0


def test_prior_orders_instances_first_for_throughput():
    chain = GraphAnalysis(depth=3, average_width=1.0, max_width=1)
    t, lat = Objective("throughput"), Objective("latency")
    assert t.prior(ParallelConfig(2, 1, 1), chain) > t.prior(ParallelConfig(1, 1, 2), chain)
    assert lat.prior(ParallelConfig(1, 1, 2), chain) > lat.prior(ParallelConfig(2, 1, 1), chain)


@pytest.mark.parametrize("kind,limit,match", [("speed", None, "objective must be one of"),
                                              ("throughput", 5.0, "needs objective='latency'"),
                                              ("latency", 0.0, "needs objective='latency' and a value > 0")])
def test_bad_objectives(kind, limit, match):
    with pytest.raises(ConfigurationError, match=match):
        Objective(kind, limit)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_budget_stages_on_a_fake_clock():
    c = Clock()
    b = Budget(50.0, c)
    assert b.hard_end == 150.0 - SHUTDOWN_RESERVE_S and b.start_timeout() == START_SHARE * 50.0
    c.t += 10
    assert b.elapsed() == 10 and b.start_timeout() == pytest.approx(START_SHARE * 50.0 - 10)
    b.set_aside(15.0)
    assert b.search_end == b.hard_end - 15.0 and b.left() == pytest.approx(b.search_end - c.t)
    # every batch size's shortest plan fits: this one gets its floor and an equal part of the rest
    w = b.batch_window([2.0, 3.0, 5.0], lambda share: 0.3 * share)
    left = b.search_end - c.t
    share = 2.0 + (left - 10.0) / 3
    assert w.deadline == pytest.approx(c.t + share) and w.reserve == pytest.approx(0.3 * share)
    assert w.slack <= b.search_end
    # they do not fit: this batch size keeps its own floor (at most what is left), no playoff reserve
    w = b.batch_window([30.0, 30.0], lambda share: 0.3 * share)
    assert w.reserve == 0.0 and w.deadline == pytest.approx(c.t + min(30.0, b.left()))
    w = b.batch_window([5.0, 30.0], lambda share: 0.3 * share)
    assert w.reserve == 0.0 and w.deadline == pytest.approx(c.t + 5.0)
    b.release()
    assert b.search_end == b.hard_end
    c.t = 1e9
    assert b.left() == 0.0 and b.start_timeout() == 0.0


@pytest.mark.parametrize("bad", [0, -1, "10", True])
def test_bad_budgets(bad):
    with pytest.raises(ConfigurationError, match="budget_s must be > 0"):
        Budget(bad, Clock())


def test_aggregate_sums_throughput_and_pools_latencies():
    res = aggregate({"x": 1}, 4, [([0.01, 0.03], 8, 0.04), ([0.02], 4, 0.02), ([], 0, 0.0)], 0.05)
    assert res.throughput_items_per_s == pytest.approx(8 / 0.04 + 4 / 0.02)
    assert res.calls == 3 and res.latency_p50_ms == pytest.approx(20.0)
    assert aggregate({}, 1, [([], 0, 0.0)], 0.1).throughput_items_per_s == 0.0


def test_held_time_ends_earlier_stages_sooner_and_goes_to_the_last():
    t = [100.0]
    b = Budget(60.0, clock=lambda: t[0])
    end = b.hard_end
    b.hold(10.0)
    assert b.hard_end == end - 10.0 and b.left(b.hard_end) == pytest.approx(60.0 - SHUTDOWN_RESERVE_S - 10.0)
    b.hold(5.0)  # a new hold replaces the old one
    assert b.hard_end == end - 5.0
    t[0] = end - 2.0
    b.hold(5.0)  # never more than is left
    assert b.hard_end == t[0]
    b.unhold()
    assert b.hard_end == end
