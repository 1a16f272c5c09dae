"""benchmarks/microbatch_deepbench.py runs end to end at a tiny size (smoke); its table has every pass."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import microbatch_deepbench  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_single_layer_table(capsys, tmp_path):
    out = tmp_path / "db.json"
    assert microbatch_deepbench.main(["--layers", "deepbench_5x5_14x14x512_style", "--batch-size", "2",
                                      "--budgets", "8MiB,64MiB", "--repeats", "1", "--rounds", "1",
                                      "--cache", str(tmp_path / "c.sqlite"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "μ-cuDNN P100" in text and "5x5: best vs undivided" in text or "5x5: no undivided" in text
    rows = json.loads(out.read_text())["rows"]
    assert {(r["budget"], r["pass"]) for r in rows if "pass" in r} == {
        (b, p) for b in ("8MiB", "64MiB") for p in ("forward", "backward_data", "backward_filter")}
    for r in rows:
        assert r["workspace_bytes"] <= {"8MiB": 2 ** 23, "64MiB": 2 ** 26}[r["budget"]]
        if r["division"] == r["undivided_division"]:
            assert r["speedup_vs_undivided"] == 1.0  # the same division is raced once
