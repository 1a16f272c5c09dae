"""Row order: consumer order lays a one-group signature's rows out in its readers' order."""

from __future__ import annotations

import pytest
import torch

from batchcraft import autobatch
from batchcraft.autobatching import execute
from batchcraft.models.treelstm import TreeLSTM

from equivalence import CORES, assert_matches_eager, flat_tensors, random_tree


def _plans_seen(monkeypatch):
    """Record every gather plan the executor takes (kind, source buffer's rows)."""
    seen = []
    take_all = execute.take_all

    def spy(bufs, plans, defer=(), refs=(), skip=()):
        for p in plans:
            if p[0] in ("view", "index"):
                seen.append((p[0], tuple(bufs[p[1]].shape)))
        return take_all(bufs, plans, defer, refs, skip)

    monkeypatch.setattr(execute, "take_all", spy)
    return seen


@pytest.mark.parametrize("core", CORES)
def test_input_projections_are_read_as_views_by_the_cells_of_every_depth(core, monkeypatch):
    # TreeLSTM: the per-node input block is one group of every node; the cell groups of each
    # depth read its two outputs. In consumer order every one of those reads is a view.
    torch.manual_seed(0)
    model = TreeLSTM(vocab_size=50, hidden=16)
    trees = [random_tree(n, seed=n) for n in (3, 9, 14, 6, 11, 1, 8)]
    seen = _plans_seen(monkeypatch)
    with torch.no_grad():
        f = assert_matches_eager(model, trees, [], core=core)
    assert f.stats.groups_consumer_ordered >= 1
    n_nodes = sum(len(t.word_ids) for t in trees)
    # (the cells' arena has n_nodes rows too, but it is read through list arguments, not seen here)
    from_inputs = [k for k, shape in seen if shape in ((n_nodes, 48), (n_nodes, 16))]
    assert len(from_inputs) >= 2 * 4 and all(k == "view" for k in from_inputs)
    monkeypatch.undo()
    seen = _plans_seen(monkeypatch)
    with torch.no_grad():
        g = autobatch(model, core=core, consumer_order=False)
        out = g(trees)
    assert g.stats.groups_consumer_ordered == 0
    assert any(k == "index" for k, shape in seen if shape == (n_nodes, 48))
    for a, b in zip(out, f(trees)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("core", CORES)
def test_consumer_order_keeps_values_gradients_and_unread_rows(core):
    # a one-group signature read by two later groups (out of order) and partly not read at all:
    # read rows come first in the readers' order, unread ones after; eager's values and grads
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 4)
    w = torch.nn.Parameter(torch.randn(4))

    def fn(inst):
        x, k = inst
        a, b, c = torch.tanh(lin(x)).unbind(0)       # one group: 3 rows per instance
        if k == 0:
            return c                                  # read by no later group
        return (b * w).sum() + torch.sigmoid(a * k).sum()

    insts = [(torch.randn(3, 4), k % 3) for k in range(12)]
    f = assert_matches_eager(fn, insts, list(lin.parameters()) + [w], core=core)
    with torch.no_grad():
        g = assert_matches_eager(fn, insts, [], core=core)
    assert g.stats.groups_consumer_ordered >= 1
    ref = [flat_tensors(o) for o in autobatch(fn, core=core, consumer_order=False)(insts)]
    with torch.no_grad():
        for o, r in zip(g(insts), ref):
            for a, b in zip(flat_tensors(o), r):
                torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=0)
    assert f.stats.fallbacks == 0


def test_python_and_c_cores_order_a_flush_alike(monkeypatch):
    if "c" not in CORES:
        pytest.skip("C core not built")
    from batchcraft.autobatching import order

    orders = {}
    real = order.consumer_order

    def spy(rec, groups, *rest):
        n = real(rec, groups, *rest)
        orders.setdefault(rec.core, []).append([list(nodes) for _, nodes in groups])
        return n

    from batchcraft.autobatching import schedule
    monkeypatch.setattr(schedule, "consumer_order", spy)
    torch.manual_seed(0)
    model = TreeLSTM(vocab_size=50, hidden=8)
    trees = [random_tree(n, seed=100 + n) for n in (5, 12, 2, 9, 7, 16)]
    with torch.no_grad():
        for core in ("c", "python"):
            autobatch(model, core=core)(trees)
    assert orders["c"] == orders["python"]


@pytest.mark.parametrize("core", CORES)
def test_left_and_right_children_are_each_a_contiguous_run(core, monkeypatch):
    # MV-RNN: every word's leaf block is one group; a composition reads a left and a right child.
    # Requested slot by slot, the leaf rows of each slot form one run: no index_select reads them.
    from batchcraft.models.mvrnn import MVRNN

    torch.manual_seed(0)
    model = MVRNN(vocab_size=50, hidden=4)
    trees = [random_tree(n, seed=200 + n) for n in (4, 9, 2, 7, 12, 5)]
    n_nodes = sum(len(t.word_ids) for t in trees)
    seen = _plans_seen(monkeypatch)
    with torch.no_grad():
        f = assert_matches_eager(model, trees, [], core=core)
    assert f.stats.groups_consumer_ordered >= 1
    leaf_reads = [k for k, shape in seen if shape in ((n_nodes, 4), (n_nodes, 4, 4))]
    assert leaf_reads and "index" not in leaf_reads
    seen.clear()
    with torch.no_grad():
        autobatch(model, core=core, consumer_order=False)(trees)
    assert "index" in [k for k, shape in seen if shape in ((n_nodes, 4), (n_nodes, 4, 4))]


def test_a_deduplicated_group_is_not_ordered_by_its_readers(monkeypatch):
    # once its program deduplicates, the input group's nodes are placed at their distinct inputs'
    # rows whatever their order: ordering them by their readers would be wasted work
    from batchcraft.autobatching import dedup

    monkeypatch.setattr(dedup, "MIN_NODES", 4)
    torch.manual_seed(0)
    model = TreeLSTM(vocab_size=4, n_tags=2, hidden=8)
    sents = [random_tree(n, seed=n) for n in (5, 9, 7, 12, 6)]
    for s in sents:  # few distinct (word, tag) pairs: the input group deduplicates
        s.word_ids = [w % 4 for w in s.word_ids]
        s.upos_ids = [t % 2 for t in s.upos_ids]
    f = autobatch(model)
    with torch.no_grad():
        f(sents)
        first = f.stats.groups_consumer_ordered, f.stats.groups_deduplicated
        out = f(sents)
        ref = [model(s) for s in sents]
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert first == (1, 1)  # the first call: not known yet to deduplicate
    assert (f.stats.groups_consumer_ordered, f.stats.groups_deduplicated) == (0, 1)
