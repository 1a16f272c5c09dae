"""Near-tied backends decided across fresh sets of processes (fake clock, fake measurements)."""

from test_halving import FakeClock, FakeGroups, knob_speed, run_tune

from batchcraft.measure.race import Race
from batchcraft.parallel.ties import FRESH_MIN_ROUNDS, near_tie

VARIANTS = [("default", "default"), ("onednn", "default"), ("mkl-packed", "default")]


def _row(matmul, estimate=None, low=None, confidence=0.95):
    iv = None if estimate is None else {"estimate": estimate, "low": low, "high": estimate * 1.05,
                                        "confidence": confidence, "units": 9}
    return {"matmul": matmul, "conv": "default", "ratio_to_default": iv}


RACE = Race.from_samples([[100.0, 101.0, 99.0], [111.0, 112.0, 110.0], [106.0, 105.0, 107.0]])


def test_two_decided_backends_within_twelve_percent_are_a_near_tie():
    rows = [_row("default"), _row("onednn", 1.11, 1.07), _row("mkl-packed", 1.05, 1.01)]
    tie = near_tie(rows, 1, RACE)
    assert tie["matmul"] == "mkl-packed" and tie["index"] == 2
    assert 0.94 < tie["unit"] < 0.96  # mkl-packed over onednn in this set of processes


def test_no_near_tie_when_apart_undecided_or_the_default_stands():
    assert near_tie([_row("default"), _row("onednn", 1.30, 1.2), _row("mkl-packed", 1.05, 1.01)], 1, RACE) is None
    assert near_tie([_row("default"), _row("onednn", 1.18, 1.1), _row("mkl-packed", 1.05, 1.01)], 1, RACE) is None
    # the default chosen (no backend decided faster): no tie, the in-process rule stands
    assert near_tie([_row("default"), _row("onednn", 1.03, 0.97), _row("mkl-packed", 1.02, 0.99)], 0, RACE) is None
    # only one backend besides the default: nothing to tie with
    assert near_tie([_row("default"), _row("onednn", 1.03, 1.01)], 1, RACE) is None


def test_a_runner_up_not_decided_against_the_default_still_ties():
    # stop 25's repeat: oneDNN 1.11 [1.07, 1.13] chosen, MKL-packed 1.05 [1.00, 1.12]; fresh
    # processes then found MKL-packed 1.11x faster
    tie = near_tie([_row("default"), _row("onednn", 1.11, 1.07), _row("mkl-packed", 1.05, 1.0)], 1, RACE)
    assert tie is not None and tie["matmul"] == "mkl-packed"
    tie = near_tie([_row("default"), _row("mkl-packed", 1.08, 1.05), _row("onednn", 0.992, 0.969)], 1, RACE)
    assert tie is not None and tie["matmul"] == "onednn"


def placement(search_edge):
    """Process factors: in the search's set of processes mkl-packed runs ``search_edge`` slower
    than in a typical (fresh) set."""
    return lambda cfg, p: search_edge if (p == 0 and cfg.matmul == "mkl-packed") else 1.0


def test_a_near_tie_is_decided_by_fresh_sets_of_processes():
    # typical process: mkl-packed 1.26x, onednn 1.20x the default; the search's own set of
    # processes slows mkl-packed to 1.16x, so its race picks onednn (within 10%: a near tie)
    clock = FakeClock()
    groups = FakeGroups(clock, knob_speed({("matmul", "onednn"): 1.20, ("matmul", "mkl-packed"): 1.26}),
                        call_s=0.002, noise=0.02, process_factor=placement(0.92))
    res = run_tune(groups, clock, 60.0, batch_sizes=(8,), variants=VARIANTS)
    tied = [v for v in res.variants if v["near_tie"]]
    assert tied and all(v["chosen"]["matmul"] == "onednn" for v in tied)
    assert len(res.ties) == 1, res.notes
    t = res.ties[0]
    assert t["fresh_rounds"] >= FRESH_MIN_ROUNDS and groups.fresh_sets == t["fresh_rounds"]
    assert len(t["units"]) == t["fresh_rounds"] + 1 and t["units"][0] < 1.0  # the search's own set first
    assert t["adopted"] and t["ratio"]["estimate"] > 1.0
    assert res.best.matmul == "mkl-packed" and res.best_round == "tie-break"
    pb = res.per_batch[0]
    assert pb["choice"]["matmul"] == "mkl-packed" and pb["tie_break"] is t
    assert res.best_result.config["matmul"] == "mkl-packed"
    assert any(tr["role"] == "tie-break" for tr in res.trials)
    assert clock() - 1000.0 <= 60.0 + 0.05  # within the budget


def test_a_near_tie_that_fresh_processes_confirm_keeps_the_choice():
    clock = FakeClock()
    groups = FakeGroups(clock, knob_speed({("matmul", "onednn"): 1.20, ("matmul", "mkl-packed"): 1.14}),
                        call_s=0.002, noise=0.02)
    res = run_tune(groups, clock, 60.0, batch_sizes=(8,), variants=VARIANTS)
    assert len(res.ties) == 1 and not res.ties[0]["adopted"]
    assert res.best.matmul == "onednn" and res.best_round == "final"
    assert res.per_batch[0]["choice"]["matmul"] == "onednn"


def test_no_fresh_processes_without_a_near_tie():
    clock = FakeClock()
    groups = FakeGroups(clock, knob_speed({("matmul", "onednn"): 1.40, ("matmul", "mkl-packed"): 1.10}),
                        call_s=0.002, noise=0.02)
    res = run_tune(groups, clock, 60.0, batch_sizes=(8,), variants=VARIANTS)
    assert not res.ties and groups.fresh_sets == 0 and res.best.matmul == "onednn"


def test_without_time_for_fresh_processes_the_search_race_stands():
    # a start-up of 60 s per set of processes: three fresh sets never fit the budget that is left
    clock = FakeClock()
    groups = FakeGroups(clock, knob_speed({("matmul", "onednn"): 1.20, ("matmul", "mkl-packed"): 1.26}),
                        call_s=0.002, noise=0.02, process_factor=placement(0.92), start_s=12.0)
    res = run_tune(groups, clock, 40.0, batch_sizes=(8,), variants=VARIANTS)
    assert groups.fresh_sets == 0 and not res.ties
    assert any("no time to decide the near tie" in n for n in res.notes), res.notes
    assert res.best.matmul == "onednn"
    assert clock() - 1000.0 <= 40.0 + 0.05


def test_the_knob_race_leaves_the_tie_break_its_rounds(monkeypatch):
    import batchcraft.parallel.knobs as knobs

    monkeypatch.setattr(knobs, "available_allocators", lambda: ("default", "jemalloc"))
    clock = FakeClock()
    groups = FakeGroups(clock, knob_speed({("matmul", "onednn"): 1.20, ("matmul", "mkl-packed"): 1.26}),
                        call_s=0.002, noise=0.02, process_factor=placement(0.92))
    res = run_tune(groups, clock, 90.0, batch_sizes=(1, 8), variants=VARIANTS,
                   knobs=("matmul", "conv", "allocator", "omp_wait_policy"))
    assert res.knobs is not None and res.knobs["rows"]  # the knob race ran...
    assert res.ties and all(t["fresh_rounds"] >= FRESH_MIN_ROUNDS for t in res.ties), res.notes  # ...and so did this
    assert clock() - 1000.0 <= 90.0 + 0.05
