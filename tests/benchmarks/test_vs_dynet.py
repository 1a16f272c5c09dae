"""benchmarks/vs_dynet.py helpers: FLOP counts against torch's FLOP counter, table rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _flops  # noqa: E402
import _vs_dynet_report as report  # noqa: E402
from batchcraft.data import load_sentences  # noqa: E402
from batchcraft.models import suite  # noqa: E402


def _matmul_flops(fn) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


@pytest.mark.parametrize("model", ["treelstm", "birnn", "mvrnn", "nestedrnn"])
@pytest.mark.parametrize("hidden", [8, 24])
def test_gemm_flops_equal_torch_flop_counter(model, hidden):
    # Real UD trees of all shapes (single words, long chains, wide heads): the analytic count per
    # node must equal what torch counts when the per-instance model runs eagerly.
    task = suite.build(model, load_sentences(limit=30), hidden=hidden, seed=1)
    counted = _matmul_flops(lambda: [task.fn(s) for s in task.instances])
    mine = sum(_flops.instance_flops(model, task, s)[0] for s in task.instances)
    assert mine == counted


def test_treelstm_flops_equal_hand_batched_reference():
    from batchcraft.models import handbatched

    task = suite.build("treelstm", load_sentences(limit=40), hidden=16)
    counted = _matmul_flops(lambda: handbatched.treelstm_levels(task.model, task.instances))
    assert sum(_flops.instance_flops("treelstm", task, s)[0] for s in task.instances) == counted


def test_per_batch_flops_average_over_batches():
    task = suite.build("treelstm", load_sentences(limit=20), hidden=8)
    total = sum(sum(_flops.instance_flops("treelstm", task, s)) for s in task.instances)
    f = _flops.per_batch("treelstm", task, 8)  # 20 sentences -> 3 batches
    assert f["forward_flops"] == pytest.approx(total / 3)
    assert f["train_flops"] == pytest.approx(3 * f["forward_flops"])
    with pytest.raises(KeyError, match="no FLOP count"):
        _flops.per_batch("nosuchmodel", task, 8)


def _payload(times: dict, modes="inference,train"):
    results = [{"system": s, "model": "treelstm", "hidden": 8, "batch_size": 4, "inference_ms": t,
                "train_ms": 2 * t, "rss_setup_bytes": 1, "rss_peak_inference_bytes": 2,
                "rss_peak_train_bytes": 3} for s, t in times.items()]
    return {"gemm": {"rate_flop_per_s": 1e9, "rates_flop_per_s": {"a": 1e9}, "best_shape": "a"},
            "flops": [{"model": "treelstm", "hidden": 8, "batch_size": 4, "forward_flops": 2e6,
                       "train_flops": 6e6}],
            "args": {"modes": modes, "batch_sizes": "4"}, "results": results, "notes": []}


def test_rows_pick_best_modes_and_ratios():
    times = {"dynet-0": 50.0, "dynet-1": 20.0, "dynet-2": 15.0, "dynet-3": 30.0, "eager": 80.0,
             "handbatched": 9.0, "batchcraft-depth": 12.0, "batchcraft-agenda": 10.0}
    rows = report.rows(_payload(times))
    inf = next(r for r in rows if r["mode"] == "inference")
    tr = next(r for r in rows if r["mode"] == "train")
    assert inf["dynet_best_ms"] == min(times[f"dynet-{i}"] for i in (1, 2, 3))  # off is not a mode
    assert inf["dynet_best_mode"] == "depth" and inf["batchcraft_scheduler"] == "agenda"
    assert inf["batchcraft_vs_dynet_best"] == pytest.approx(inf["dynet_best_ms"] / inf["batchcraft_ms"])
    assert inf["batchcraft_vs_handbatched"] == pytest.approx(inf["batchcraft_ms"] / inf["handbatched_ms"])
    assert inf["flop_bound_ms"] == pytest.approx(2e6 / 1e9 * 1e3)
    assert tr["flop_bound_ms"] == pytest.approx(3 * inf["flop_bound_ms"])
    assert inf["batchcraft_flop_fraction"] == pytest.approx(inf["flop_bound_ms"] / inf["batchcraft_ms"])


def test_rows_and_tables_without_dynet_or_handbatched():
    payload = _payload({"eager": 80.0, "batchcraft-depth": 12.0})
    payload["notes"] = ["DyNet is not installed"]
    payload["rows"] = rows = report.rows(payload)
    assert all(r["dynet_best_ms"] is None and r["batchcraft_vs_dynet_best"] is None for r in rows)
    text = report.text_tables(payload)
    assert "DyNet is not installed" in text and "batchcraft" in text
