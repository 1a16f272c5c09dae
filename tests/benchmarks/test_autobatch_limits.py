"""benchmarks/autobatch_limits.py and treelstm.py run end to end at a tiny size (smoke)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import autobatch_limits  # noqa: E402
import treelstm as treelstm_bench  # noqa: E402


def test_limits_table_and_bounds(capsys):
    threads = torch.get_num_threads()
    try:
        assert autobatch_limits.main(["--sentences", "12", "--hidden", "16", "--batch-size", "4",
                                      "--threads", "1", "--repeats", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "hand-batched (no recording)" in out and "Bounds at this size" in out


def test_treelstm_bench_reports_the_hand_batched_reference(capsys):
    threads = torch.get_num_threads()
    try:
        assert treelstm_bench.main(["--sentences", "8", "--batch-sizes", "4", "--hidden", "16",
                                    "--schedulers", "depth", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "hand-batched ms/batch" in out
