"""compare_eager: eager loop vs autobatch, with an optional hand-batched reference."""

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
