"""compare_eager: eager loop vs autobatch, with an optional hand-batched reference."""

import pytest
import torch

from batchcraft.measure.compare import compare_eager


def _fn(x):
    return torch.tanh(x * 2.0) + 1.0


def test_figures_and_a_reference_checked_against_eager():
    xs = [torch.randn(5) for _ in range(10)]
    good = compare_eager(_fn, xs, batch_size=4, reference=lambda b: list(torch.tanh(torch.stack(b) * 2.0) + 1.0))
    assert good["batches"] == 3 and good["max_abs_diff"] < 1e-6
    assert good["reference_ms"] > 0 and good["reference_max_abs_diff"] < 1e-6
    bad = compare_eager(_fn, xs, batch_size=4, reference=lambda b: [torch.tanh(x) for x in b])
    assert bad["reference_max_abs_diff"] > 0.1  # a wrong reference shows, it is not trusted
    plain = compare_eager(_fn, xs, batch_size=4)
    assert "reference_ms" not in plain


def test_throughput_counts_the_instances_a_batch_holds():
    # new-user find (stop 35): a short batch (32 of batch_size 64) reported 2x the real rate
    res = compare_eager(lambda x: torch.tanh(x * 2), [torch.randn(4) for _ in range(5)], batch_size=64)
    assert res["batches"] == 1 and res["instances"] == 5
    assert res["instances_per_s_eager"] == pytest.approx(5 / (res["eager_ms"] / 1e3))
    assert res["instances_per_s_batchcraft"] == pytest.approx(5 / (res["batchcraft_ms"] / 1e3))


def test_split_passes_give_a_steady_time_split_beside_the_timed_pass():
    xs = [torch.randn(5) for _ in range(12)]
    calls = []

    def fn(x):
        calls.append(1)
        return torch.tanh(x * 2.0)

    res = compare_eager(fn, xs, batch_size=4, split_passes=3)
    assert res["split_passes"] == 3
    # warm-up (4 eager + 4 recorded) + timed pass (12 eager + 12 recorded) + 3 passes of 12 recorded
    assert len(calls) == 8 + 24 + 36
    assert res["steady_record_ms"] > 0 and res["steady_kernel_ms"] >= 0
    assert res["steady_record_us_per_unit"] == pytest.approx(res["steady_record_ms"] * 1e3 / res["work_units"])
    assert "steady_record_ms" not in compare_eager(fn, xs, batch_size=4)
