"""benchmarks/wait_costs.py runs end to end at a tiny size (smoke)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import wait_costs  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_thread_count():
    threads = torch.get_num_threads()  # the script sets its own
    yield
    torch.set_num_threads(threads)


def test_wait_costs_table(capsys):
    assert wait_costs.main(["--steps", "2", "--instances", "3", "--hidden", "8"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [(k, w) for k in ("mul", "lin", "cell") for w in ("False", "True")]
    assert all(int(r[4]) == (2 if r[1] == "True" else 0) for r in rows)  # one sync round per step with waits
