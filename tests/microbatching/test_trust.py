"""A cache and a report users can trust: noisy measurements re-timed, refresh, verification vs cached times."""

import pytest
import torch
from torch import nn

from batchcraft.microbatching import MeasurementCache, microbatch
from batchcraft.microbatching import verify as verify_mod
from batchcraft.microbatching.algorithms import ConvGeometry
from batchcraft.microbatching.cache import MeasurementRecord
from batchcraft.microbatching.measure import SPREAD_LIMIT, Measurer
from batchcraft.microbatching.probe import find_convolutions
from batchcraft.microbatching.verify import Verification, disagreement

GEOM = ConvGeometry(4, 4, (3, 3), (1, 1), (1, 1), (1, 1), 1, 8, 8)


class FakeClock:
    """perf_counter stand-in: each timed call lasts the next duration (ms) of ``durations``."""

    def __init__(self, durations_ms):
        self.durations, self.t, self.start = list(durations_ms), 0.0, True

    def __call__(self):
        if not self.start:
            self.t += self.durations.pop(0) / 1e3
        self.start = not self.start
        return self.t


def test_a_noisy_round_is_timed_again_and_the_minimum_kept():
    # first round 10, 30, 40 ms (spread 2.0: busy machine), second round steady at 9-10 ms
    clock = FakeClock([10, 30, 40, 9, 9.5, 10])
    m = Measurer(MeasurementCache(":memory:"), repeats=3, clock=clock)
    rec = m.measure(GEOM, "forward", "im2col", 4, divided=False)
    assert rec.time_ms == pytest.approx(9.0) and rec.time_samples == 6
    assert rec.spread == pytest.approx(0.5 / 9) and not m.noisy


def test_a_round_that_stays_noisy_is_flagged_and_re_measured_when_read_back(tmp_path):
    clock = FakeClock([10, 30, 40] * 3)
    cache = MeasurementCache(tmp_path / "c.sqlite")
    m = Measurer(cache, repeats=3, clock=clock, retries=2)
    rec = m.measure(GEOM, "forward", "im2col", 4, divided=False)
    assert rec.spread > SPREAD_LIMIT and rec.time_samples == 9 and len(m.noisy) == 1
    assert cache.get(m.key(GEOM, "forward", "im2col", 4, False)).spread == rec.spread  # stored with its spread
    # another planning reads it back: not trusted, measured again (steady now)
    m2 = Measurer(cache, repeats=3, clock=FakeClock([5, 5, 5]))
    again = m2.measure(GEOM, "forward", "im2col", 4, divided=False)
    assert m2.remeasured_noisy == 1 and m2.measured == 1 and again.time_ms == pytest.approx(5.0)
    assert again.spread == pytest.approx(0.0, abs=1e-9)
    m3 = Measurer(cache, repeats=3, clock=FakeClock([]))
    assert m3.measure(GEOM, "forward", "im2col", 4, divided=False) == again and m3.measured == 0


def test_refresh_measures_cached_configurations_again_once(tmp_path):
    cache = MeasurementCache(tmp_path / "c.sqlite")
    Measurer(cache, repeats=1, clock=FakeClock([50])).measure(GEOM, "forward", "fft", 4, divided=True)
    m = Measurer(cache, repeats=1, clock=FakeClock([7]), refresh=True)
    assert m.measure(GEOM, "forward", "fft", 4, divided=True).time_ms == pytest.approx(7.0)
    assert m.measure(GEOM, "forward", "fft", 4, divided=True).time_ms == pytest.approx(7.0)  # once per Measurer
    assert m.measured == 1
    assert cache.get(m.key(GEOM, "forward", "fft", 4, True)).time_ms == pytest.approx(7.0)


def _verification(times, iqr=0.2, repeats=7):
    return Verification("planned", dict(times), {k: iqr for k in times}, repeats, "training")


def test_disagreement_compares_measured_and_predicted_differences():
    # whole model = convolutions + 5 ms of other layers; predictions right: agree
    predicted = {"default": 20.0, "undivided": 15.0, "planned": 10.0}
    measured = {k: v + 5.0 for k, v in predicted.items()}
    assert disagreement(_verification(measured), predicted) is None
    # the case: a stale 63 ms default (busy machine) predicted a 5x gain the model does not show
    stale = {"default": 63.0, "planned": 12.0}
    msg = disagreement(_verification({"default": 17.0, "planned": 19.0}), stale)
    assert msg and "default minus planned was predicted +51.0 ms, measured -2.0 ms" in msg
    # within noise: wide IQRs allow the miss
    assert disagreement(_verification({"default": 17.0, "planned": 19.0}, iqr=60.0), stale) is None
    # identical variants (timed once) are not compared with themselves
    v = _verification({"default": 17.0, "planned": 17.0})
    v.identical = {"planned": "default"}
    assert disagreement(v, {"default": 63.0, "planned": 12.0}) is None


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, 3, padding=1))


def test_verification_that_contradicts_stale_cached_times_says_so_and_re_measures(tmp_path, monkeypatch):
    x = torch.randn(4, 3, 10, 10)
    cache = MeasurementCache(tmp_path / "c.sqlite")
    algos = ("default", "im2col")
    microbatch(_net(), x, "1MiB", cache=cache, algorithms=algos, repeats=1, progress=False, verify=False)
    # the default's records were "measured while the machine was busy": 200 ms each, steady (low spread)
    m = Measurer(cache)
    stale = {}
    for call in find_convolutions(_net(), x)[0]:
        for p in ("forward", "backward_data", "backward_filter"):
            key = m.key(call.geometry, p, "default", 4, False)
            stale[key] = cache.get(key)
            cache.put(key, MeasurementRecord(200.0, 3, stale[key].workspace_bytes, 0.0))
    # the whole model runs alike with every variant (fake clock): the stale records predict ~1 s more
    # for the default. 1000 ms allows a ±250 ms miss (verify.DISAGREEMENT_TOLERANCE, 25%), so the second verification
    # agrees however a loaded machine inflates the re-measured per-layer times (~0.1 ms each when quiet)
    monkeypatch.setattr(verify_mod, "wall_clock_ms", lambda variant, fn: (fn(), 1000.0)[1])
    with pytest.warns(RuntimeWarning, match="disagrees with the cached per-layer times"):
        planned = microbatch(_net(), x, "1MiB", cache=cache, algorithms=algos, repeats=1, progress=False,
                             verify_repeats=3)
    entry = planned.plan.primary
    assert "disagrees with the cached per-layer times" in entry.notes[0] and "measured again" in entry.notes[0]
    assert "note: the whole-model check disagrees" in planned.plan.table()
    for key in stale:  # re-measured: the stale 200 ms are gone from the cache and from the plan
        assert cache.get(key).time_ms < 200.0
    assert all(pp.default_ms < 200.0 for _, _, pp in entry.pass_plans())
    assert len(entry.notes) == 1  # the second verification agreed
