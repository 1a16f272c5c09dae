"""workers.py: idle OpenMP workers put to sleep before a long recording."""

from __future__ import annotations

import sys

import pytest
import torch

from batchcraft import autobatch
from batchcraft.autobatching import workers


def test_quiet_asks_the_runtime_only_for_long_recordings_with_a_team(monkeypatch):
    calls = []
    monkeypatch.setattr(workers, "_pause", lambda kind: calls.append(kind) or 0)
    monkeypatch.setattr(workers, "_looked", True)
    assert workers.quiet(0.5e-3, 2) is False  # short: the team's restart would cost more
    assert workers.quiet(5e-3, 1) is False  # one thread: no team
    assert workers.quiet(5e-3, 2) is True
    assert calls == [workers.OMP_PAUSE_SOFT]
    monkeypatch.setattr(workers, "_pause", lambda kind: -1)  # refused (inside a parallel region)
    assert workers.quiet(5e-3, 2) is False
    monkeypatch.setattr(workers, "_pause", None)  # no runtime with the entry point
    assert workers.quiet(5e-3, 2) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_loaded_runtime_pauses_and_torch_still_computes():
    fn = workers._loaded_runtime()
    if fn is None:
        pytest.skip("no OpenMP runtime with omp_pause_resource_all is loaded")
    a, b = torch.randn(300, 300), torch.randn(300, 300)
    threads = torch.get_num_threads()
    ref = a @ b
    assert fn(workers.OMP_PAUSE_SOFT) == 0
    assert torch.equal(a @ b, ref) and torch.get_num_threads() == threads


def test_a_call_after_a_long_recording_quiets_the_workers(monkeypatch):
    seen = []
    monkeypatch.setattr(workers, "quiet", lambda expected, threads: seen.append(expected) or False)
    f = autobatch(lambda x: torch.tanh(x) * 2)
    xs = [torch.randn(3) for _ in range(4)]
    f(xs)
    assert seen == [0.0]  # the first call has nothing to go by
    f.stats.record_s = 0.25  # as if the previous call had recorded for 250 ms
    out = f(xs)
    assert seen[-1] == 0.25
    assert all(torch.equal(o, torch.tanh(x) * 2) for o, x in zip(out, xs))
    seen.clear()
    g = autobatch(lambda x: x + 1, quiet_workers=False)
    g(xs)
    g(xs)
    assert seen == []
