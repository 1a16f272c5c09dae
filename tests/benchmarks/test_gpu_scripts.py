"""The GPU scripts run on a lent GPU once per task at most: a dry run here keeps them working.

``benchmarks/gpu_autobatch.py --device cpu`` runs the same code path (models built and called
under ``with torch.device(...)``, eager vs batchcraft vs hand-batched, values compared) on the
CPU; ``gpu_microbatch.py`` says why it skips.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_autobatch  # noqa: E402
import gpu_microbatch  # noqa: E402


def test_gpu_autobatch_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "ga.json"
    rc = gpu_autobatch.main(["--device", "cpu", "--models", "treelstm,birnn", "--sentences", "4",
                             "--batch-sizes", "2", "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["treelstm", "birnn"]
    for r in rows:
        assert "error" not in r, r
        assert r["max_abs_diff"] < 1e-5 and r["fallbacks"] == 0
        assert r["batched_calls"] < r["ops_recorded"]
    for r in rows:  # both have a hand-batched reference
        assert r["hand_max_abs_diff"] < 1e-5 and r["hand_batched_ms"] > 0
    table = gpu_autobatch.render(out)
    assert table.count("\n| ") == 3 and "birnn" in table


def test_gpu_microbatch_says_why_it_skips(capsys):
    assert gpu_microbatch.main(["--out", "/nonexistent/never-written.json"]) == 0
    assert "skipped" in capsys.readouterr().out
