"""benchmarks/suite.py renders its docs section from a saved run (the load-average line included)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import suite as suite_bench  # noqa: E402


def _payload(load):
    return {"args": {"sentences": 4, "max_words": 10, "batch_sizes": "8", "sizes": "small", "schedulers": "depth",
                     "threads": 2},
            "machine": {"cpu": "test cpu", "usable_cpus": 2, "torch": "x"},
            "load_before": load, "load_after": "0.1 0.1 0.1", "elapsed_s": 1.0}


def test_docs_text_reads_the_load_average_string():
    # a load string ("1.61 1.34 1.35") once crashed the docs writer after a 3-minute run
    busy = suite_bench.docs_text(_payload("1.61 1.34 1.35"), ["a"], [[1]])
    quiet = suite_bench.docs_text(_payload("0.20 0.30 0.40"), ["a"], [[1]])
    assert "shared with other runs" in busy and "nothing else ran" in quiet
    assert "nothing else ran" in suite_bench.docs_text(_payload("unknown"), ["a"], [[1]])
