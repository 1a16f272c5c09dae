"""Memory of a call: retention (memory.py) reuses the previous call's pages; nothing outlives a call."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from batchcraft import autobatch
from batchcraft.autobatching import memory
from batchcraft.models.treelstm import TreeLSTM

from equivalence import CORES, random_tree


@pytest.fixture
def treelstm_trees():
    torch.manual_seed(0)
    return TreeLSTM(vocab_size=400, hidden=16, word_dim=8, tag_dim=4), [random_tree(n, seed=n) for n in (1, 4, 9, 17)]

glibc = pytest.mark.skipif(not memory.available(), reason="memory retention needs glibc")

N, D = 160, 256  # a group result of (160, 256, 256) float32 = 40 MiB: above glibc's mmap threshold
PAGES = N * D * D * 4 // 4096


def _big(x):
    return (x * 2.0).tanh() + 1.0  # (D, D) per instance: every group is > 32 MiB


def _instances():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(D, D, generator=g) for _ in range(N)]


def _steady_faults(f, xs, calls=14):
    """Fewest page faults of a call over the last 4 of ``calls`` (the heap's layout settles first)."""
    seen = []
    with torch.no_grad():
        for _ in range(calls):
            out = f(xs)  # kept during the next call, as a caller's results are
            seen.append(f.stats.page_faults)
    del out
    return min(seen[-4:])


@glibc
def test_later_calls_touch_no_fresh_pages_with_retention_and_a_whole_working_set_without():
    xs = _instances()
    kept = autobatch(_big)
    plain = autobatch(_big, retain_memory=False)
    # without retention each call maps its > 32 MiB groups afresh: at least one result's pages fault
    assert _steady_faults(plain, xs) > PAGES
    assert not plain.stats.memory_retained
    assert "page faults (memory retention off" in plain.stats.summary()
    assert _steady_faults(kept, xs) < PAGES // 4
    assert kept.stats.memory_retained


@pytest.mark.parametrize("retain", [True, False])
def test_values_equal_eager_either_way(retain):
    xs = _instances()[:20]
    with torch.no_grad():
        got = autobatch(_big, retain_memory=retain)(xs)
        want = [_big(x) for x in xs]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@glibc
def test_the_setting_is_undone_when_an_instance_raises_and_counts_concurrent_calls():
    def bad(x):
        if x.shape[0] == 3:
            raise ValueError("instance 1 fails")
        return x * 2

    f = autobatch(bad)
    with pytest.raises(Exception):
        f([torch.ones(2), torch.ones(3)])
    assert memory.active_calls() == 0

    inside, go = threading.Event(), threading.Event()
    seen = []

    def slow(x):
        inside.set()
        go.wait(10)
        return x + 1

    t = threading.Thread(target=lambda: seen.append(autobatch(slow, fibers=False)([torch.ones(2)])))
    t.start()
    assert inside.wait(10)
    assert memory.active_calls() == 1  # the other thread's call is inside
    autobatch(lambda x: x * 3)([torch.ones(2)])  # a concurrent call enters and leaves
    assert memory.active_calls() == 1  # ... without ending the other's retention
    go.set()
    t.join(10)
    assert memory.active_calls() == 0
    torch.testing.assert_close(seen[0][0], torch.full((2,), 2.0))


def test_without_glibc_nothing_is_changed_and_the_call_still_runs(monkeypatch):
    monkeypatch.setattr(memory, "_libc", None)
    assert not memory.available()
    assert memory.release() is False
    f = autobatch(lambda x: x.sin())
    xs = [torch.randn(3) for _ in range(4)]
    got = f(xs)
    assert not f.stats.memory_retained
    assert memory.active_calls() == 0
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, x.sin())


def test_option_is_validated():
    with pytest.raises(ValueError, match="retain_memory must be a bool"):
        autobatch(lambda x: x, retain_memory="yes")


@pytest.mark.parametrize("core", CORES)
def test_a_finished_call_leaves_no_reference_cycle_so_its_buffers_free_at_once(core, treelstm_trees):
    """The recorder, its runtime and its mode referred to each other: every call's batched results
    stayed alive until a cyclic collection found them, and cost one (a full one every ~20 calls)."""
    model, trees = treelstm_trees
    f = autobatch(model, core=core)
    with torch.no_grad():
        f(trees)  # first call: traces, signature caches (kept on purpose, not garbage)
        gc.collect()
        was = gc.isenabled()
        gc.disable()
        try:
            gc.set_debug(gc.DEBUG_SAVEALL)
            outs = f(trees)
            found = gc.collect()
            kinds = sorted({type(o).__name__ for o in gc.garbage})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            if was:
                gc.enable()
    assert len(outs) == len(trees)
    assert found == 0, f"cyclic garbage after a call: {kinds}"


@glibc
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_call_starts_with_no_call_inside():
    """DataLoader workers fork while another thread may be inside a call: the child must not keep
    ``M_MMAP_MAX = 0`` (its large frees would stay resident) nor a count that never drops to 0."""
    with memory.retain(True) as r:
        assert r.retained and memory.active_calls() == 1
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            ok = memory.active_calls() == 0
            with memory.retain(True):  # the lock is usable and the count works in the child
                ok = ok and memory.active_calls() == 1
            os._exit(0 if ok and memory.active_calls() == 0 else 1)
        _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert memory.active_calls() == 0
