"""Measurer: what is measured, what the cache answers, over-budget configurations left untimed."""

import torch

from batchcraft.microbatching.algorithms import ConvGeometry
from batchcraft.microbatching.cache import MeasurementCache
from batchcraft.microbatching.measure import Measurer

GEOM = ConvGeometry(8, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1, 16, 16)
COLS = 8 * 9 * 16 * 16 * 4  # im2col columns per sample, bytes


def test_im2col_workspace_is_measured_and_grows_with_micro_batch():
    m = Measurer(MeasurementCache(":memory:"), repeats=1)
    small = m.measure(GEOM, "forward", "im2col", 2, divided=True)
    large = m.measure(GEOM, "forward", "im2col", 16, divided=False)
    assert small.time_ms > 0 and large.time_ms > 0
    assert large.workspace_bytes >= 16 * COLS * 0.9       # the columns buffer is seen
    assert small.workspace_bytes < large.workspace_bytes / 3


def test_divided_step_counts_its_temporary_output():
    m = Measurer(MeasurementCache(":memory:"), repeats=1)
    whole = m.measure(GEOM, "forward", "default", 4, divided=False)
    step = m.measure(GEOM, "forward", "default", 4, divided=True)
    out_bytes = 4 * 8 * 16 * 16 * 4
    assert step.workspace_bytes >= whole.workspace_bytes + out_bytes * 0.9


def test_cache_answers_and_over_budget_is_not_timed(tmp_path):
    cache = MeasurementCache(tmp_path / "c.sqlite")
    m = Measurer(cache, repeats=1)
    rec = m.measure(GEOM, "forward", "im2col", 16, divided=False, limit_bytes=1024)
    assert rec.time_ms is None and rec.workspace_bytes > 1024 and m.measured == 1
    again = m.measure(GEOM, "forward", "im2col", 16, divided=False, limit_bytes=1024)
    assert again == rec and m.measured == 1              # answered by the cache
    timed = m.measure(GEOM, "forward", "im2col", 16, divided=False, limit_bytes=None)
    assert timed.time_ms is not None and m.measured == 2  # a larger budget times it
    m2 = Measurer(MeasurementCache(tmp_path / "c.sqlite"), repeats=1)
    assert m2.measure(GEOM, "forward", "im2col", 16, divided=False).time_ms == timed.time_ms
    assert m2.measured == 0


def test_cache_key_includes_threads_and_dtype():
    m = Measurer(MeasurementCache(":memory:"), dtype=torch.float64)
    k = m.key(GEOM, "forward", "fft", 4, True)
    assert k.dtype == "float64" and k.threads == torch.get_num_threads() and k.device.startswith("cpu:")


def test_race_times_whole_divisions():
    m = Measurer(MeasurementCache(":memory:"))
    times = m.race(GEOM, "backward_filter", 8, [[("default", 8)], [("im2col", 4), ("im2col", 4)]], rounds=2)
    assert len(times) == 2 and all(0 < t < 10_000 for t in times)


def test_accumulating_backward_filter_needs_no_temporary_dw():
    # μ-cuDNN accumulates dW with beta = 1; unfold_matmul does the same (addmm_ into dW)
    geom = ConvGeometry(128, 128, (3, 3), (1, 1), (1, 1), (1, 1), 1, 2, 2)
    weight_bytes = 128 * 128 * 9 * 4
    m = Measurer(MeasurementCache(":memory:"), repeats=1)
    acc = m.measure(geom, "backward_filter", "unfold_matmul", 2, divided=True)
    tmp = m.measure(geom, "backward_filter", "default", 2, divided=True)
    assert acc.workspace_bytes < weight_bytes / 4
    assert tmp.workspace_bytes >= weight_bytes
