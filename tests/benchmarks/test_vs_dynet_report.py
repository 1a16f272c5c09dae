"""The vs-DyNet report's headline (benchmarks/_vs_dynet_report.py)."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _vs_dynet_report import headline  # noqa: E402


def _row(ratio, batch=64, mode="inference"):
    return {"batch_size": batch, "mode": mode, "batchcraft_vs_dynet_best": ratio}


def test_headline_without_dynet_says_so():
    # new-user find (stop 35): "geometric mean - over 1 rows (0 faster than DyNet)"
    assert "no DyNet figures" in headline([_row(None), _row(None, mode="train")])


def test_headline_counts_only_rows_with_dynet():
    text = headline([_row(2.0), _row(0.5), _row(None), _row(3.0, batch=8)])
    assert "geometric mean 1.00x over 2 rows (1 faster than DyNet)" in text
