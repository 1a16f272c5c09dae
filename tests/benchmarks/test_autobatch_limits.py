"""benchmarks/autobatch_limits.py and treelstm.py run end to end at a tiny size (smoke)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import autobatch_limits  # noqa: E402
import treelstm as treelstm_bench  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_thread_count():
    threads = torch.get_num_threads()  # the scripts set their own
    yield
    torch.set_num_threads(threads)


def test_limits_table_and_bounds(capsys):
    assert autobatch_limits.main(["--sentences", "12", "--hidden", "16", "--batch-size", "4",
                                  "--threads", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "hand-batched (no recording)" in out and "Bounds at this size" in out


def test_treelstm_bench_reports_the_hand_batched_reference(capsys):
    assert treelstm_bench.main(["--sentences", "8", "--batch-sizes", "4", "--hidden", "16",
                                "--schedulers", "depth", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "hand-batched ms/batch" in out
