"""The measurement race: rotation, pairing, intervals (coverage checked by simulation), verdicts."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchcraft.measure.race import Race, RatioInterval, median_interval, race, summarize, timed


def test_rounds_rotate_which_variant_starts():
    calls = []
    variants = [lambda i=i: calls.append(i) or 1.0 for i in range(3)]
    race(variants, rounds=4)
    assert calls == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]


def test_an_active_subset_rotates_among_itself_and_others_get_no_sample():
    calls = []
    r = Race([lambda i=i: calls.append(i) or float(i + 1) for i in range(3)])
    r.run_round([0, 2])
    r.run_round([0, 2])
    assert calls == [0, 2, 2, 0]
    assert r.samples[1] == [None, None] and r.values(0) == [1.0, 1.0]
    assert r.ranking() == [2, 0]  # speeds: 3 before 1; variant 1 has no sample


def test_warmup_calls_are_not_samples():
    n = [0]

    def f():
        n[0] += 1
        return float(n[0])

    r = race([f], rounds=2, warmup=3)
    assert r.values(0) == [4.0, 5.0]


@pytest.mark.parametrize("n,coverage", [(1, 0.0), (2, 0.5), (5, 0.9375), (6, 0.96875), (10, 1 - 2 * 11 / 1024)])
def test_median_interval_uses_the_largest_order_statistic_that_reaches_the_confidence(n, coverage):
    vals = list(range(1, n + 1))
    lo, hi, cov = median_interval(vals, 0.95)
    assert cov == pytest.approx(coverage)
    k = 2 if n == 10 else 1
    assert (lo, hi) == (vals[k - 1], vals[n - k])


def test_paired_ratio_follows_the_rounds_and_ignores_unpaired_samples():
    a = iter([10.0, 20.0, 40.0, None, 10.0])
    b = iter([5.0, 10.0, 10.0, 7.0, None])
    r = race([lambda: next(a), lambda: next(b)], rounds=5)
    # rounds 0-2 measured both: ratios 2, 2, 4 (speeds: higher is better)
    assert [x for _, x in r.paired(0, 1)] == [2.0, 2.0, 4.0]
    iv = r.ratio(0, 1)
    assert (iv.estimate, iv.low, iv.high, iv.units) == (2.0, 2.0, 4.0, 3)
    assert iv.confidence == pytest.approx(0.75)


def test_times_are_inverted_so_a_ratio_above_one_means_faster():
    ta, tb = iter([1.0, 1.0, 1.0]), iter([2.0, 3.0, 2.5])
    r = race([lambda: next(ta), lambda: next(tb)], rounds=3, higher_is_better=False)
    assert r.ratio(0, 1).estimate == 2.5 and r.ratio(0, 1).low == 2.0
    assert r.ranking() == [0, 1]


def test_clusters_make_each_cluster_one_unit():
    a = iter([2.0, 2.0, 2.0, 1.0, 1.0, 1.0])
    r = Race([lambda: next(a), lambda: 1.0])
    for c in ("start0", "start0", "start0", "start1", "start1", "start1"):
        r.run_round(cluster=c)
    iv = r.ratio(0, 1)
    assert iv.units == 2 and (iv.low, iv.high) == (1.0, 2.0)
    assert iv.confidence == pytest.approx(0.5)  # two units: the range covers the median half the time


def test_no_common_round_gives_an_empty_interval():
    r = Race([lambda: 1.0, lambda: 1.0])
    r.run_round([0])
    r.run_round([1])
    iv = r.ratio(0, 1)
    assert iv.units == 0 and math.isnan(iv.estimate) and iv.describe() == "unresolved"
    assert iv.at_least(0.95) == "undecided"


@pytest.mark.parametrize("low,high,word,within,at_least", [
    (1.02, 1.04, "faster", True, "yes"),
    (0.97, 1.03, "equal", True, "yes"),
    (0.90, 1.10, "unresolved", False, "undecided"),
    (0.80, 0.90, "slower", False, "no"),
])
def test_verdict_words(low, high, word, within, at_least):
    iv = RatioInterval((low + high) / 2, low, high, 0.95, 7)
    assert iv.describe() == word and iv.within(0.05) is within and iv.at_least(0.95) == at_least
    assert iv.text().endswith("95%")


def test_the_interval_covers_the_true_ratio_as_often_as_it_says():
    # 400 simulated races of 7 rounds: lognormal noise per sample plus a drift per round that
    # hits both variants (what interleaving is for). True speed ratio 1.2.
    rng = random.Random(1)
    covered, stated = 0, []
    for _ in range(400):
        drift = {}

        def sample(speed, rnd):
            return speed * drift[rnd] * math.exp(rng.gauss(0, 0.05))

        r = Race([lambda: sample(1.2, r.rounds), lambda: sample(1.0, r.rounds)])
        for k in range(7):
            drift[k] = math.exp(rng.gauss(0, 0.3))
            r.run_round()
        iv = r.ratio(0, 1)
        covered += iv.low <= 1.2 <= iv.high
        stated.append(iv.confidence)
    assert min(stated) == max(stated) == pytest.approx(1 - 2 / 2 ** 7)  # 7 rounds: the range, 98.4%
    assert covered / 400 >= 0.96


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=12), st.floats(0.5, 4.0))
def test_scaling_one_variant_scales_the_interval(base, factor):
    a, b = iter([x * factor for x in base]), iter(base)
    r = race([lambda: next(a), lambda: next(b)], rounds=len(base))
    iv = r.ratio(0, 1)
    assert iv.low <= iv.estimate <= iv.high
    assert iv.estimate == pytest.approx(factor, rel=1e-9)
    assert iv.low == pytest.approx(factor, rel=1e-9) and iv.high == pytest.approx(factor, rel=1e-9)


def test_summary_and_median_sample():
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert (s.n, s.median) == (4, 2.5) and s.q1 <= s.median <= s.q3 and s.iqr == s.q3 - s.q1
    r = Race([lambda: {"v": 3.0}], value=lambda d: d["v"])
    r.run_round()
    assert r.median_sample(0) == {"v": 3.0} and r.summary(0).median == 3.0
    assert summarize([5.0]).iqr == 0.0


def test_timed_measures_seconds_per_call_on_the_given_clock():
    t = [0.0]

    def clock():
        return t[0]

    def work():
        t[0] += 0.25

    assert timed(work, calls=4, clock=clock)() == pytest.approx(0.25)


@pytest.mark.parametrize("bad", [
    lambda: Race([]),
    lambda: Race([lambda: 1.0], labels=["a", "b"]),
    lambda: race([lambda: 1.0], rounds=0),
    lambda: timed(lambda: None, calls=0),
    lambda: median_interval([], 0.95),
    lambda: median_interval([1.0], 1.5),
])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError):
        bad()


def test_to_dict_reports_every_variant_against_the_best():
    a, b = iter([2.0, 2.0, 2.0]), iter([1.0, 1.0, 1.0])
    d = race([lambda: next(a), lambda: next(b)], rounds=3, labels=["fast", "slow"]).to_dict()
    assert d["rounds"] == 3 and "ratio_to_best" not in d["variants"]["fast"]
    assert d["variants"]["slow"]["ratio_to_best"]["estimate"] == 0.5


def test_a_race_from_samples_run_elsewhere():
    r = Race.from_samples([[2.0, 2.2, None, 2.1], [1.0, 1.0, 1.0, 1.05]], labels=["a", "b"])
    assert r.rounds == 4 and r.values(0) == [2.0, 2.2, 2.1]
    assert r.ratio(0, 1).units == 3 and r.ranking() == [0, 1]
    with pytest.raises(ValueError, match="same number of rounds"):
        Race.from_samples([[1.0], [1.0, 2.0]])
