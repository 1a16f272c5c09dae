"""The budgeted search on a fake clock with fake measurements: budget, final round, choice."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchcraft.errors import ConfigurationError
from batchcraft.parallel import BASELINES, ParallelConfig
from batchcraft.parallel.analysis import GraphAnalysis, HeavyOp
from batchcraft.parallel.budget import Budget
from batchcraft.parallel.halving import CostModel, HalvingSearch
from batchcraft.parallel.objective import Objective
from batchcraft.parallel.search import run_search
from batchcraft.parallel.trial import TrialResult


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class FakeGroups:
    """Instances that take fake time: start-up, warm-up, whole calls, a per-trial overhead.

    ``speed(cfg)`` gives items/s; ``noise`` scales each trial by a random factor in
    [1 - noise, 1 + noise] (seeded), so repeats of one configuration disagree like real ones.
    """

    def __init__(self, clock, speed, *, call_s=0.01, start_s=3.0, overhead_s=0.02, noise=0.0, seed=0,
                 speed_at=None, process_factor=None):
        self.clock, self.speed, self.call_s = clock, speed, call_s
        self.start_s, self.overhead_s, self.noise = start_s, overhead_s, noise
        self.rng = random.Random(seed)
        self.warm, self.calls, self.closed = set(), [], False
        self.speed_at = speed_at  # speed(cfg, trial length): a trial-length bias
        # process_factor(cfg, p): a variant's speed factor in set of processes p (0: the search's
        # own, 1, 2, ...: fresh sets), as memory placement gives one backend an edge in one process
        self.process_factor = process_factor or (lambda cfg, p: 1.0)
        self.fresh_sets = 0

    def start_all(self, configs, timeout_s):
        self.clock.t += min(self.start_s, timeout_s)
        return [] if self.start_s <= timeout_s else list(configs)

    def measure(self, cfg, duration_s, warmup_s):
        call = self.call_s * cfg.batch_size ** 0.5  # per-item time falls with the batch size
        first = (cfg.key(), cfg.batch_size) not in self.warm
        self.warm.add((cfg.key(), cfg.batch_size))
        n = max(1, math.ceil(duration_s / call))
        self.clock.t += (max(warmup_s, call) if first else 0.0) + n * call + self.overhead_s
        speed = self.speed_at(cfg, duration_s) if self.speed_at else self.speed(cfg)
        thr = speed * (1 + self.rng.uniform(-self.noise, self.noise))
        self.calls.append(cfg)
        return TrialResult(cfg.to_dict(), cfg.batch_size, thr, call * 1e3, call * 1e3, call * 1e3, n, duration_s)

    def close(self):
        self.closed = True

    def drop(self, cfg):
        pass

    def race_variants(self, cfgs, duration_s, warmup_s, block_s, *, fresh=False):
        """Backend variants taking turns in blocks, on the fake clock (see WorkerGroup.race_variants);
        ``fresh``: in a new set of processes (its start-up takes a third of ``start_s``)."""
        from batchcraft.parallel.groups import variant_race_result

        p = 0
        if fresh:
            self.fresh_sets += 1
            p = self.fresh_sets
            self.clock.t += self.start_s / 3
        b = cfgs[0].batch_size
        call = self.call_s * b ** 0.5  # the default variant's call, as in measure(); others scale by speed
        ref = self.speed(cfgs[0])
        n = max(1, math.ceil(block_s / call))
        rounds = max(7, math.ceil(duration_s / (n * call * len(cfgs))))
        blocks = [[(r, j, n, n * call * ref / (self.speed(c) * self.process_factor(c, p))
                    * (1 + self.rng.uniform(-self.noise, self.noise)))
                   for r in range(rounds) for j, c in enumerate(cfgs)] for _ in range(cfgs[0].instances)]
        self.clock.t += sum(max(warmup_s, call) for c in cfgs) + rounds * len(cfgs) * n * call + self.overhead_s
        self.variant_races = getattr(self, "variant_races", 0) + 1
        return variant_race_result(cfgs, blocks, duration_s)

    def spawn_all(self, configs):  # the knob race's new processes: start-up takes fake time
        self.clock.t += self.start_s / 3

    def is_ready(self, cfg):
        return True


WIDE = GraphAnalysis(heavy_ops=[HeavyOp("a", "conv", "a", 100, 1), HeavyOp("b", "conv", "b", 100, 1),
                                HeavyOp("c", "conv", "c", 100, 2)],
                     depth=2, average_width=1.5, max_width=2, width_per_level=[2, 1], total_flops=300)


def by_label(table, default=100.0):
    return lambda cfg: table.get(cfg.label, default) * (cfg.instances if cfg.label == "grid" else 1)


def run_tune(groups, clock, budget_s, *, cpus=(0, 1), batch_sizes=(1, 8, 64), objective="throughput", limit=None,
             knobs=(), **kw):
    # knobs=(): no knob race (tests of it pass knobs explicitly)
    return run_search(groups, Budget(budget_s, clock), "fake", list(batch_sizes), Objective(objective, limit), WIDE,
                      True, list(cpus), eta=3, repeats=3, k_final=2, progress=False, knobs=knobs, **kw)


def ranked_by_trial_length(long_from_s):
    """Speeds under which trials shorter than ``long_from_s`` rank pytorch-default first and
    longer ones intel-recommended (1000/950 items/s short, 800/880 long; others 300)."""
    def speed(cfg, length):
        short = length < long_from_s
        if cfg.label == "pytorch-default":
            return 1000.0 if short else 800.0
        if cfg.label == "intel-recommended":
            return 950.0 if short else 880.0
        return 300.0
    return speed



@pytest.mark.parametrize("n_cpus", [2, 16])
@pytest.mark.parametrize("call_s", [1e-4, 0.03, 0.3])
@pytest.mark.parametrize("budget_s", [8.0, 20.0, 120.0])
def test_total_time_stays_within_the_budget(n_cpus, call_s, budget_s):
    clock = FakeClock()
    groups = FakeGroups(clock, by_label({}), call_s=call_s)
    t0 = clock()
    res = run_tune(groups, clock, budget_s, cpus=range(n_cpus))
    # the first call at the first batch size is unknown before it runs: at most two calls over
    assert clock() - t0 <= budget_s + 2 * call_s
    assert res.elapsed_s == pytest.approx(clock() - t0)
    assert res.per_batch
    if budget_s >= 20 and call_s < 0.3:
        assert len(res.per_batch) == 3
    if len(res.per_batch) < 3:
        assert any("budget" in n for n in res.notes)


def test_a_large_budget_ends_early_and_a_large_grid_is_halved():
    clock = FakeClock()
    groups = FakeGroups(clock, by_label({}), call_s=1e-3)
    res = run_tune(groups, clock, 600.0, cpus=range(16))
    assert res.elapsed_s < 300  # trials are capped (max_trial_s): no point in spending 10 minutes
    roles = {t["role"] for t in res.trials}
    assert roles >= {"probe", "search", "final"} and roles <= {"probe", "search", "final", "playoff"}
    for pb in res.per_batch:
        final = [t for t in res.rounds if t["role"] == "final" and t["batch_size"] == pb["batch_size"]]
        search0 = [t for t in res.rounds if t["role"] == "search" and t["batch_size"] == pb["batch_size"]
                   and t["round"] == 0]
        assert len(search0) >= 9  # the whole (pruned) grid of 16 cores, in short trials
        assert len([t for t in final if t["config"]["label"] == "grid"]) <= len(search0) / 3
        assert {t["config"]["label"] for t in final} >= set(BASELINES)


@pytest.mark.parametrize("budget_s", [10.0, 30.0])
@pytest.mark.parametrize("n_cpus", [2, 16])
def test_every_baseline_is_measured_in_every_final_round(budget_s, n_cpus):
    clock = FakeClock()
    groups = FakeGroups(clock, by_label({}), call_s=0.01, noise=0.05)
    res = run_tune(groups, clock, budget_s, cpus=range(n_cpus))
    for pb in res.per_batch:
        assert sorted(pb["baselines"]) == sorted(BASELINES)
        final = [t for t in res.trials if t["role"] == "final" and t["batch_size"] == pb["batch_size"]]
        for label in BASELINES:  # all repeats, interleaved with the candidates
            assert [t["repeat"] for t in final if t["config"]["label"] == label] == [0, 1, 2]


@settings(max_examples=40, deadline=None)
@given(speeds=st.lists(st.floats(10.0, 1000.0), min_size=5, max_size=5), seed=st.integers(0, 2**16),
       noise=st.sampled_from([0.0, 0.1, 0.4]), n_cpus=st.sampled_from([2, 4, 16]))
def test_the_choice_is_never_a_configuration_measured_slower(speeds, seed, noise, n_cpus):
    table = dict(zip(["grid", *BASELINES], speeds))
    clock = FakeClock()
    groups = FakeGroups(clock, lambda c: table[c.label] * (1 + 0.1 * c.instances + 0.01 * c.inter_op_threads),
                        call_s=0.005, noise=noise, seed=seed)
    res = run_tune(groups, clock, 20.0, cpus=range(n_cpus))
    for pb in res.per_batch:
        best = pb["best"]["throughput_items_per_s"]
        if pb["playoff"]:  # decided by the longer trials of the final round's best two
            winner = max(pb["playoff"], key=lambda p: p["throughput_items_per_s"])
            assert pb["best"]["config"] == winner["config"]
            finals = sorted(f["throughput_items_per_s"] for f in pb["final"])
            mine = next(f for f in pb["final"] if f["config"] == pb["best"]["config"])
            assert mine["throughput_items_per_s"] >= finals[-2]  # it was one of the best two
        else:
            assert all(best >= f["throughput_items_per_s"] for f in pb["final"])
        assert min(pb["ratios"].values()) >= 1.0  # never below a baseline measured beside it
    overall = res.best_result.throughput_items_per_s
    assert all(overall >= pb["best"]["throughput_items_per_s"] for pb in res.per_batch)


def test_a_fastest_baseline_is_chosen_over_the_grid():
    clock = FakeClock()
    groups = FakeGroups(clock, by_label({"grid": 10.0, "intel-recommended": 500.0}), call_s=0.01)
    res = run_tune(groups, clock, 15.0)
    assert all(pb["best"]["config"]["label"] == "intel-recommended" for pb in res.per_batch)
    assert res.best.label == "intel-recommended"


def test_too_short_a_budget_skips_trials_but_keeps_the_deadline():
    clock = FakeClock()
    groups = FakeGroups(clock, by_label({}), call_s=0.2, start_s=2.0)
    t0 = clock()
    res = run_tune(groups, clock, 5.0)
    assert clock() - t0 <= 5.0 + 2 * 0.2
    assert any("budget" in n for n in res.notes)


def test_instances_that_do_not_start_in_time_are_an_error():
    clock = FakeClock()
    groups = FakeGroups(clock, by_label({}), start_s=30.0)
    t0 = clock()
    with pytest.raises(ConfigurationError, match="no instance .* was ready"):
        run_tune(groups, clock, 10.0)
    assert clock() - t0 <= 10.0


def test_halving_keeps_the_fastest_and_spares_hopeless_candidates():
    clock = FakeClock()
    speeds = {"a": 100.0, "b": 90.0, "c": 1.0, "d": 80.0, "e": 70.0, "f": 60.0, "base": 50.0}
    groups = FakeGroups(clock, lambda c: speeds[c.label], call_s=1e-3)
    search = [ParallelConfig(1, 1, i + 1, 8, label=k) for i, k in enumerate("abcdef")]
    base = [ParallelConfig(2, 1, 1, 8, label="base")]
    trials = []
    engine = HalvingSearch(groups.measure, clock, eta=3, repeats=3, k_final=2, max_trial_s=0.2, trials=trials)
    out = engine.run(search, base, clock() + 60, clock() + 60)
    assert out.best.label == "a" and set(out.baselines) == {"base"}
    search0 = [t["config"]["label"] for t in trials if t["role"] == "search" and t["round"] == 0]
    assert search0.count("c") == 1 and search0.count("a") == 3  # 100x slower: pruned after one repeat
    final = {t["config"]["label"] for t in trials if t["role"] == "final"}
    assert final == {"a", "b", "base"}
    lengths = {t["role"]: t["duration_s"] for t in trials}
    assert lengths["final"] > lengths["search"]  # trials grow from round to round


def test_cost_model_scales_call_times_to_new_batch_sizes():
    cost = CostModel(warmup_s=0.05)
    ref, other = ParallelConfig(1, 1, 2, 1, label="r"), ParallelConfig(2, 1, 1, 1, label="o")

    def learn(cfg, b, call_s):
        c = ParallelConfig(cfg.instances, 1, cfg.intra_op_threads, b, label=cfg.label)
        cost.learn(c, 0.1, 0.2, TrialResult({}, b, 1.0, call_s * 1e3, call_s * 1e3, call_s * 1e3, 5, 0.1))

    assert cost.call_time(other) == 0.0 and cost.warmup(other) == 0.05
    learn(ref, 1, 0.010)
    learn(other, 1, 0.020)
    assert cost.call_time(ParallelConfig(2, 1, 1, 8)) == pytest.approx(0.160)  # batch ratio, nothing else known
    learn(ref, 8, 0.030)  # the reference slowed down 3x from batch 1 to 8
    assert cost.call_time(ParallelConfig(2, 1, 1, 8)) == pytest.approx(0.060)
    assert cost.floor(ParallelConfig(2, 1, 1, 8), 2, 0.02) == pytest.approx(0.120)


def test_a_disturbed_final_round_gets_more_passes_and_keeps_the_right_choice():
    clock = FakeClock()
    speeds = {"fast": 100.0, "base": 90.0}
    disturbed = {("fast", 0), ("fast", 1)}  # another process took the cores during two repeats
    seen = {}

    def speed(cfg):
        n = seen.get(cfg.label, 0)
        seen[cfg.label] = n + 1
        return speeds[cfg.label] / (3.0 if (cfg.label, n) in disturbed else 1.0)

    groups = FakeGroups(clock, speed, call_s=1e-3)
    search, base = [ParallelConfig(2, 1, 1, 8, label="fast")], [ParallelConfig(1, 1, 2, 8, label="base")]
    trials = []
    out = HalvingSearch(groups.measure, clock, repeats=3, trials=trials).run(search, base, clock() + 30, clock() + 30)
    assert [t["repeat"] for t in trials if t["config"]["label"] == "fast"] == [0, 1, 2, 3, 4, 5]
    assert out.best.label == "fast"  # median of 6 passes: 100, not the disturbed 33


def test_time_left_goes_to_a_playoff_with_longer_trials_that_decides_a_close_call():
    # "pytorch-default" looks 5% faster in short trials, "intel-recommended" is 10% faster in
    # long ones (a fast first burst): the playoff's longer trials must pick the latter
    clock = FakeClock()
    groups = FakeGroups(clock, None, call_s=0.002, speed_at=ranked_by_trial_length(0.75))
    res = run_tune(groups, clock, 60.0, batch_sizes=(8,))
    pb = res.per_batch[0]
    assert [f["config"]["label"] for f in pb["final"][:2]] == ["pytorch-default", "intel-recommended"]
    assert pb["playoff"] and pb["playoff_trial_s"] >= 2 * pb["final_trial_s"]
    assert pb["best"]["config"]["label"] == "intel-recommended"
    assert pb["ratios"]["pytorch-default"] == pytest.approx(880 / 800)
    assert any("playoff" in n for n in res.notes)
    assert clock() - 1000.0 <= 60.0 + 0.01


def test_no_playoff_when_the_final_round_is_clear_or_no_time_is_left():
    clock = FakeClock()
    groups = FakeGroups(clock, by_label({"pytorch-default": 500.0}), call_s=0.002)
    res = run_tune(groups, clock, 60.0, batch_sizes=(8,))
    assert not res.per_batch[0]["playoff"]  # 2 x 1 x 1 (200) vs default (500): far apart
    clock = FakeClock()
    groups = FakeGroups(clock, by_label({}), call_s=0.3)  # ties, but the budget is all used
    res = run_tune(groups, clock, 8.0)
    assert clock() - 1000.0 <= 8.0 + 2 * 0.3 * 8 ** 0.5


def test_a_playoff_runs_only_with_trials_of_at_least_five_calls():
    from batchcraft.parallel.halving import BatchOutcome

    a = ParallelConfig(instances=2, inter_op_threads=1, intra_op_threads=1, batch_size=64, label="grid")
    b = ParallelConfig(instances=1, intra_op_threads=None, pin=False, batch_size=64, label="pytorch-default")
    for end_s, expect in [(4.0, False), (15.0, True)]:
        clock = FakeClock()
        groups = FakeGroups(clock, by_label({"pytorch-default": 190.0}), call_s=0.3 / 8)  # 0.3 s a call
        engine = HalvingSearch(groups.measure, clock)
        for cfg in (a, b):
            engine.cost.learn(cfg, 0.0, 0.0, groups.measure(cfg, 1e-3, 0.0))
        out = BatchOutcome(a, _result_of(a, 200.0), final=[(a, _result_of(a, 200.0)), (b, _result_of(b, 195.0))],
                           final_trial_s=0.1)
        # 0.25-s trials would fit in 4 s (3 x 2 x 0.58 s), but they would be single calls
        assert engine.playoff(out, clock() + end_s, rnd=5) is expect
        assert clock() <= 1000.0 + 2 * 0.3 + end_s + 0.1
        if expect:
            assert all(r.calls >= 5 for _, r in out.playoff)
            assert out.best.label == "grid"


def _result_of(cfg, thr):
    return TrialResult(cfg.to_dict(), cfg.batch_size, thr, 1.0, 1.0, 1.0, 10, 0.1)


def test_a_tight_budget_still_plays_off_close_calls_from_the_time_set_aside():
    clock = FakeClock()
    groups = FakeGroups(clock, None, call_s=0.004, speed_at=ranked_by_trial_length(0.2))
    res = run_tune(groups, clock, 20.0)
    played = [pb for pb in res.per_batch if pb["playoff"]]
    assert len(played) == 3 and all(pb["final_trial_s"] < 0.2 <= pb["playoff_trial_s"] for pb in played)
    assert all(pb["best"]["config"]["label"] == "intel-recommended" for pb in played)
    assert clock() - 1000.0 <= 20.0 + 2 * 0.004 * 64 ** 0.5


# -- review findings ----------------------------------------------------------------------------------

def test_a_playoff_at_the_first_batch_size_does_not_starve_the_later_ones(monkeypatch):
    # 16 cores, 8 s: without playoffs every batch size gets a final round with all four baselines.
    # The batch-1 playoff is bounded by `slack` (here the hard end), not by its reserve, and takes
    # ~3.2 s of the 4.4 s left: batch 8 loses three baselines and batch 64 is dropped.
    import batchcraft.parallel.halving as halving

    speeds = {"grid": 100.0, "pytorch-default": 105.0, "intel-recommended": 95.0}

    def run():
        clock = FakeClock()
        groups = FakeGroups(clock, lambda c: speeds.get(c.label, 90.0), call_s=0.004)
        res = run_tune(groups, clock, 8.0, cpus=range(16))
        return [(pb["batch_size"], sorted(pb["baselines"])) for pb in res.per_batch]

    with_playoffs = run()
    monkeypatch.setattr(halving, "PLAYOFF_SHARE", 0.0)  # no time set aside, no per-batch playoff
    without = run()
    assert without == [(b, sorted(BASELINES)) for b in (1, 8, 64)]
    assert with_playoffs == without


def test_reported_numbers_agree_with_the_ratios_after_a_playoff():
    # (review finding) "best" and "baselines" are final-round medians; a ratio decided by the
    # playoff is the playoff medians' ratio, and says so in "decided_by"
    clock = FakeClock()
    groups = FakeGroups(clock, None, call_s=0.002, speed_at=ranked_by_trial_length(0.75))
    res = run_tune(groups, clock, 60.0, batch_sizes=(8,))
    pb = res.per_batch[0]
    assert pb["playoff"] and pb["best"]["config"]["label"] == "intel-recommended"
    assert pb["best"]["throughput_items_per_s"] == pytest.approx(950.0)  # its final-round median
    thr = {p["config"]["label"]: p["throughput_items_per_s"] for p in pb["playoff"]}
    for label, base in pb["baselines"].items():
        if pb["decided_by"][label] == "playoff":
            assert pb["ratios"][label] == pytest.approx(thr["intel-recommended"] / thr[label])
        else:
            shown = pb["best"]["throughput_items_per_s"] / base["throughput_items_per_s"]
            assert shown == pytest.approx(pb["ratios"][label]), label
    assert pb["decided_by"]["pytorch-default"] == "playoff"
    from batchcraft.parallel.tables import comparison_table

    assert "playoff" in comparison_table(res.to_dict())


def test_ratios_with_a_latency_limit_are_never_below_one():
    # objective "latency" with a p90 limit ranks by throughput among the configurations within the
    # limit, but _ratio compares p50 latencies: a baseline with a lower p50 gets a ratio < 1
    # (search.py _ratio; predates the playoff change, also used for playoff ratios).
    class LatencyGroups(FakeGroups):
        table = {"intel-recommended": (200.0, 8.0, 9.0), "pytorch-default": (150.0, 5.0, 9.5)}

        def measure(self, cfg, duration_s, warmup_s):
            r = super().measure(cfg, duration_s, warmup_s)
            thr, p50, p90 = self.table.get(cfg.label, (100.0, 9.0, 9.9))
            return TrialResult(r.config, r.batch_size, thr, p50, p90, p90, r.calls, r.duration_s)

    clock = FakeClock()
    groups = LatencyGroups(clock, lambda c: 100.0, call_s=0.002)
    res = run_tune(groups, clock, 30.0, batch_sizes=[8], objective="latency", limit=10.0)
    pb = res.per_batch[0]
    assert pb["best"]["config"]["label"] == "intel-recommended"
    assert min(pb["ratios"].values()) >= 1.0, pb["ratios"]


def test_a_failed_playoff_is_not_played_again():
    # (review finding) a playoff that measured but did not complete is not repeated with the time left
    class NoCalls(FakeGroups):
        def measure(self, cfg, duration_s, warmup_s):
            r = super().measure(cfg, duration_s, warmup_s)
            if cfg.label == "intel-recommended" and duration_s >= 0.6:  # playoff trials only (final <= 0.5 s)
                return TrialResult(r.config, r.batch_size, 0.0, 1.0, 1.0, 1.0, 0, duration_s)
            return r

    clock = FakeClock()
    groups = NoCalls(clock, by_label({"pytorch-default": 105.0, "intel-recommended": 100.0}, default=20.0),
                     call_s=0.002)
    res = run_tune(groups, clock, 120.0)
    for pb in res.per_batch:
        rounds = {t["round"] for t in res.trials if t["role"] == "playoff" and t["batch_size"] == pb["batch_size"]}
        assert len(rounds) <= 1
        assert not pb["playoff"]


# -- the knob race ------------------------------------------------------------------------------

from batchcraft.parallel.knobs import KNOB_EXTRA_ROUNDS  # noqa: E402

def knob_speed(factors, team_gain=0.9):
    """items/s from the configuration itself: 50 per thread, times ``team_gain`` for a team of
    several intra-op threads in one pool, times a factor per knob value."""
    def speed(cfg):
        intra = cfg.intra_op_threads or 2
        s = 50.0 * cfg.instances * intra * (team_gain if intra > 1 else 1.0) / cfg.inter_op_threads ** 0.5
        for knob in ("matmul", "conv", "allocator", "omp_wait_policy"):
            s *= factors.get((knob, getattr(cfg, knob)), 1.0)
        return s
    return speed


@pytest.fixture
def with_jemalloc(monkeypatch):
    import batchcraft.parallel.knobs as knobs

    monkeypatch.setattr(knobs, "available_allocators", lambda: ("default", "jemalloc"))


VARIANTS = [("default", "default"), ("onednn", "default")]
ALL_KNOBS = ("matmul", "conv", "allocator", "omp_wait_policy")


def test_the_knob_race_measures_every_one_knob_change_beside_the_choice(with_jemalloc):
    clock = FakeClock()
    groups = FakeGroups(clock, knob_speed({("matmul", "onednn"): 1.3}), call_s=0.002)
    res = run_tune(groups, clock, 60.0, batch_sizes=(8,), knobs=ALL_KNOBS, variants=VARIANTS)
    assert (res.best.instances, res.best.matmul) == (2, "onednn")  # the backend race chose it
    rows = {r["label"]: r for r in res.knobs["rows"]}
    assert set(rows) >= {"choice", "allocator jemalloc"}
    assert not any("omp_wait_policy" in label for label in rows)  # one thread per pool: nothing waits
    assert any(r["role"] == "baseline" for r in rows.values())
    assert res.knobs["adopted"] is None and res.best_round == "final"  # nothing adopted: final-round median
    assert clock() - 1000.0 <= 60.0 + 0.05


def test_backends_are_raced_per_process_configuration_and_the_faster_kept():
    clock = FakeClock()
    groups = FakeGroups(clock, knob_speed({("matmul", "onednn"): 1.3}), call_s=0.002, noise=0.05)
    res = run_tune(groups, clock, 60.0, batch_sizes=(1, 8), variants=VARIANTS)
    assert groups.variant_races >= 2 and not any("no time to race" in n for n in res.notes)
    by = {(v["batch_size"], v["process"]): v for v in res.variants}
    for v in by.values():
        onednn = next(r for r in v["variants"] if r["matmul"] == "onednn")
        assert onednn["ratio_to_default"]["low"] > 1.2  # 1.3 +- 5% noise, paired blocks
        assert v["chosen"] == {"matmul": "onednn", "conv": "default"} and v["rounds"] >= 7
    grid_finals = [t for t in res.rounds if t["role"] == "final" and t["config"]["label"] == "grid"]
    assert grid_finals and all(t["config"]["matmul"] == "onednn" for t in grid_finals)  # one variant each
    assert all(b["config"]["matmul"] == "default" for pb in res.per_batch for b in pb["baselines"].values())


def test_a_backend_that_is_not_faster_leaves_the_default():
    clock = FakeClock()
    groups = FakeGroups(clock, knob_speed({("matmul", "onednn"): 0.97}), call_s=0.002, noise=0.05)
    res = run_tune(groups, clock, 30.0, batch_sizes=(8,), variants=VARIANTS)
    assert res.variants and all(v["chosen"]["matmul"] == "default" for v in res.variants)
    assert res.best.matmul == "default"


def test_a_knob_change_faster_in_every_round_is_adopted(with_jemalloc):
    clock = FakeClock()
    # a team of 2 threads in one process wins here, and spinning between regions helps it
    groups = FakeGroups(clock, knob_speed({("omp_wait_policy", "active"): 1.2}, team_gain=1.1), call_s=0.002,
                        noise=0.02)
    res = run_tune(groups, clock, 60.0, batch_sizes=(8,), knobs=ALL_KNOBS, final_repeats=5)
    assert res.knobs["adopted"] == "omp_wait_policy active"
    assert res.best.omp_wait_policy == "active" and res.best.intra_op_threads == 2
    assert res.best_result.throughput_items_per_s == pytest.approx(110.0 * 1.2, rel=0.05)


def test_a_change_that_does_not_matter_is_rarely_adopted_whatever_the_noise():
    adopted = 0
    for seed in range(40):
        clock = FakeClock()
        groups = FakeGroups(clock, knob_speed({}, team_gain=1.1), call_s=0.002, noise=0.1, seed=seed)
        res = run_tune(groups, clock, 40.0, batch_sizes=(8,), knobs=("omp_wait_policy",), final_repeats=5)
        assert res.knobs["rounds"] in (5, 5 + KNOB_EXTRA_ROUNDS)  # undecided after 5: the extra rounds
        adopted += res.knobs["adopted"] is not None
    # two equal alternatives, 5 rounds: P(one has every paired ratio > 1) = 1 - (31/32)^2, about 6%;
    # the second look after the extra rounds raises it to about 1 - 0.92^2, 15% (simulated: 8 of 100
    # null races adopted one alternative); a rate twice that fails here
    assert adopted <= 12


def test_three_rounds_are_too_few_to_adopt_anything_so_the_undecided_get_extra_rounds():
    clock = FakeClock()
    groups = FakeGroups(clock, knob_speed({("omp_wait_policy", "active"): 1.2}, team_gain=1.1), call_s=0.002)
    res = run_tune(groups, clock, 60.0, batch_sizes=(8,), knobs=("omp_wait_policy",), final_repeats=3)
    # 3 rounds cannot reach a 90% interval: both alternatives race on, and the faster one is adopted
    assert res.knobs["rounds"] == 3 + KNOB_EXTRA_ROUNDS and res.knobs["adopted"] == "omp_wait_policy active"
    assert any("3 rounds with every contender, then" in n for n in res.notes)
    rows = {r["label"]: r for r in res.knobs["rows"]}
    assert rows["omp_wait_policy active"]["ratio"]["units"] == 3 + KNOB_EXTRA_ROUNDS


def test_extra_rounds_race_only_the_undecided_alternatives_and_raise_the_power():
    # a 1.1x gain under 10% noise: 5 rounds resolve it in about 60% of races, the extra rounds of the
    # undecided ones in about 85% (simulated); an alternative clearly slower gets no extra round
    adopted, extended_slow = 0, 0
    for seed in range(20):
        clock = FakeClock()
        groups = FakeGroups(clock, knob_speed({("omp_wait_policy", "active"): 1.1,
                                               ("omp_wait_policy", "passive"): 0.5}, team_gain=1.1),
                            call_s=0.002, noise=0.1, seed=seed)
        res = run_tune(groups, clock, 40.0, batch_sizes=(8,), knobs=("omp_wait_policy",), final_repeats=5)
        rows = {r["label"]: r for r in res.knobs["rows"]}
        adopted += res.knobs["adopted"] == "omp_wait_policy active"
        extended_slow += rows["omp_wait_policy passive"]["ratio"]["units"] > 5
        assert clock() - 1000.0 <= 40.0 + 0.05
    assert adopted >= 14 and extended_slow == 0


def test_an_alternative_that_fails_is_left_out_with_a_note(with_jemalloc):
    from batchcraft.errors import WorkerError

    class Failing(FakeGroups):
        def measure(self, cfg, duration_s, warmup_s):
            if cfg.allocator == "jemalloc":
                raise WorkerError("instance 0 died with exit code -11")
            return super().measure(cfg, duration_s, warmup_s)

    clock = FakeClock()
    res = run_tune(Failing(clock, knob_speed({}), call_s=0.002), clock, 60.0, batch_sizes=(8,), knobs=ALL_KNOBS)
    assert "allocator jemalloc" not in {r["label"] for r in res.knobs["rows"]}
    assert any("allocator jemalloc (batch 8) left out" in n for n in res.notes)


def test_the_knob_race_covers_each_batch_size_and_adopts_per_batch_size(with_jemalloc):
    # the allocator pays only with large activations (batch 64), as with Inception here
    base = knob_speed({})

    def speed(cfg):
        return base(cfg) * (1.5 if cfg.allocator == "jemalloc" and cfg.batch_size == 64 else 1.0)

    clock = FakeClock()
    res = run_tune(FakeGroups(clock, speed, call_s=0.002, noise=0.02), clock, 90.0, batch_sizes=(1, 8, 64),
                   knobs=ALL_KNOBS, final_repeats=5)
    by = {pb["batch_size"]: pb for pb in res.per_batch}
    assert set(res.knobs["by_batch"]) == {"1", "8", "64"}
    assert by[64]["knobs"]["adopted"] == "allocator jemalloc"
    assert by[64]["knobs"]["choice"]["allocator"] == "jemalloc" and by[64]["knobs"]["ratio"]["low"] > 1.0
    assert by[8]["knobs"]["adopted"] is None and by[1]["knobs"]["adopted"] is None
    # equal speeds elsewhere: the adopted change makes batch 64 the overall choice, from the knob race
    assert (res.best.batch_size, res.best.allocator, res.best_round) == (64, "jemalloc", "knobs")
    from batchcraft.parallel.tables import comparison_table

    assert "tuned + allocator jemalloc" in comparison_table(res.to_dict())
    # each contender is compared with its own batch size's choice
    for r in res.knobs["rows"]:
        if r["ratio"]:
            expect = 1.5 if r["config"]["batch_size"] == 64 and r["config"]["allocator"] == "jemalloc" else 1.0
            if r["role"] == "alternative" and r["config"]["matmul"] == "default":
                assert r["ratio"]["estimate"] == pytest.approx(expect, rel=0.08)
    assert clock() - 1000.0 <= 90.0 + 0.05


def test_a_batch_size_whose_choice_runs_in_other_processes_races_the_leads_processes(with_jemalloc):
    base = knob_speed({})

    def speed(cfg):
        # batch 8 (twice the items/s) leads with two 1-thread instances; at batch 64 one process
        # with a team of two wins the search by 8%, but two instances with jemalloc are 1.5x
        # faster: the allocator's gain depends on the process configuration
        team = cfg.instances == 1 and (cfg.intra_op_threads or 2) == 2
        s = base(cfg) * (2.0 if cfg.batch_size == 8 else 1.0)
        if cfg.batch_size == 8 and cfg.allocator == "jemalloc":
            s *= 0.95  # a little slower where activations are small
        if cfg.batch_size == 64:
            s *= 1.2 if team else (1.5 if cfg.allocator == "jemalloc" and cfg.instances == 2 else 1.0)
        return s

    clock = FakeClock()
    groups = FakeGroups(clock, speed, call_s=0.002, noise=0.02)
    spawned = []
    groups.spawn_all = lambda configs: spawned.extend(configs)
    res = run_tune(groups, clock, 90.0, batch_sizes=(8, 64), knobs=("allocator",), final_repeats=5)
    by = {pb["batch_size"]: pb for pb in res.per_batch}
    assert res.knobs["choice"]["batch_size"] == 8 and by[8]["best"]["config"]["instances"] == 2
    assert by[64]["best"]["config"]["instances"] == 1  # the search's choice at 64
    assert by[64]["knobs"]["adopted"] == "batch 8's allocator jemalloc"
    assert (by[64]["knobs"]["choice"]["instances"], by[64]["knobs"]["choice"]["allocator"]) == (2, "jemalloc")
    assert by[64]["knobs"]["ratio"]["estimate"] == pytest.approx(150 / 108, rel=0.06)  # 2x50x1.5 / (50x2x0.9x1.2)
    assert by[8]["knobs"]["adopted"] is None
    # no process beyond the lead's: the batch-64 choice's own jemalloc variant was not started
    assert not any(c.instances == 1 and c.allocator == "jemalloc" for c in spawned)
    assert any("batch 64: its choice" in n and "other processes" in n for n in res.notes)


def test_a_batch_size_whose_knob_rounds_do_not_fit_is_left_out_with_a_note(with_jemalloc):
    from batchcraft.parallel.knobs import KnobEntry, fit_entries

    cost = CostModel(1.0)
    cheap, dear = ParallelConfig(batch_size=1), ParallelConfig(batch_size=64)
    cost.call_s[cost._key(cheap)] = 0.01
    cost.call_s[cost._key(dear)] = 2.0  # 3 calls a trial: 6 s, 2 contenders, 5 rounds: 60+ s
    # a slow configuration at batch 1 must not be taken for the unmeasured jemalloc alternative's cost
    cost.call_s[cost._key(cheap.replace(instances=1, inter_op_threads=2))] = 5.0
    engine = type("E", (), {"cost": cost})()
    lead = KnobEntry(ParallelConfig(batch_size=8), None, [ParallelConfig(batch_size=8, allocator="jemalloc")])
    entries = [lead, KnobEntry(dear, None, [dear.replace(allocator="jemalloc")]),
               KnobEntry(cheap, None, [cheap.replace(allocator="jemalloc")])]
    kept, notes = fit_entries(entries, engine, 20.0)
    assert [e.choice.batch_size for e in kept] == [8, 1]  # the lead always, order kept
    assert len(notes) == 1 and notes[0].startswith("batch 64 left out of the knob race")


def test_no_knob_race_below_its_budget():
    clock = FakeClock()
    res = run_tune(FakeGroups(clock, knob_speed({}), call_s=0.002), clock, 20.0, batch_sizes=(8,), knobs=ALL_KNOBS)
    assert res.knobs is None and res.best_round == "final"


def test_alternatives_join_the_knob_race_when_their_processes_are_ready():
    class Slow(FakeGroups):
        delay = {"passive": 1.0, "active": 1e6}  # passive starts in 1 s, active never

        def spawn_all(self, configs):
            self.ready_at = {c.key(): self.clock.t + self.delay.get(c.omp_wait_policy, 0.0) for c in configs}

        def is_ready(self, cfg):
            return self.clock.t >= self.ready_at.get(cfg.key(), 0.0)

    clock = FakeClock()
    res = run_tune(Slow(clock, knob_speed({}, team_gain=1.1), call_s=0.002), clock, 60.0, batch_sizes=(8,),
                   knobs=("omp_wait_policy",), final_repeats=5)
    rows = {r["label"]: r for r in res.knobs["rows"]}
    assert "omp_wait_policy passive" in rows and "omp_wait_policy active" not in rows
    assert rows["omp_wait_policy passive"]["ratio"]["units"] >= 5  # paired rounds after it joined
    assert rows["choice"]["result"]["calls"] > 0
    assert any("not started in time, left out: omp_wait_policy active (batch 8)" in n for n in res.notes)
    assert clock() - 1000.0 <= 60.0 + 0.05


def test_compile_is_raced_on_the_choice_when_asked_for():
    clock = FakeClock()
    groups = FakeGroups(clock, knob_speed({}), call_s=0.002)
    res = run_tune(groups, clock, 200.0, batch_sizes=(8,), knobs=("compile",), final_repeats=5)
    rows = {r["label"]: r for r in res.knobs["rows"]}
    assert rows["compile"]["config"]["compile"] is True and rows["compile"]["config"]["matmul"] == "default"
    clock = FakeClock()
    res = run_tune(FakeGroups(clock, knob_speed({}), call_s=0.002), clock, 60.0, batch_sizes=(8,),
                   knobs=("compile",), final_repeats=5)
    assert any("no time left to compile" in n for n in res.notes)  # 18 s of knob race < 30 s to compile
    clock = FakeClock()
    res = run_tune(FakeGroups(clock, knob_speed({}), call_s=0.002), clock, 60.0, batch_sizes=(8,),
                   knobs=("allocator",), final_repeats=5)
    assert res.knobs is None or "compile" not in {r["label"] for r in res.knobs["rows"]}  # opt-in only
