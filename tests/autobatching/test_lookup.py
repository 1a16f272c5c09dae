"""Embedding lookups read in place (``lookup.py``): nodes placed at their ids' rows of the tables."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchcraft import autobatch, static_block
from batchcraft.autobatching import lookup

from equivalence import CORES, assert_matches_eager

H = 32  # a word matrix row: H * H floats = 4 KiB, the size from which lookups read in place


def _mvrnn_like(max_norm=None, hidden=H):
    torch.manual_seed(0)

    @static_block
    class Leaf(nn.Module):
        def __init__(self):
            super().__init__()
            self.vector = nn.Embedding(50, hidden)
            self.matrix = nn.Embedding(50, hidden * hidden, max_norm=max_norm)

        def forward(self, i):
            return self.vector(i), self.matrix(i).view(hidden, hidden)

    leaf = Leaf()
    w = torch.randn(hidden, hidden) / hidden

    def fn(ids):
        v, m = leaf(torch.tensor(ids[0]))
        for j in ids[1:]:
            cv, cm = leaf(torch.tensor(j))
            v, m = torch.tanh(v @ cm + cv), m @ w + cm @ w
        return v, m

    return leaf, fn


def _instances(k=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
            for _ in range(k)]


@pytest.mark.parametrize("core", CORES)
def test_leaf_lookups_are_rows_of_the_tables_and_match_eager(core):
    leaf, fn = _mvrnn_like()
    insts = _instances()
    with torch.no_grad():
        f = assert_matches_eager(fn, insts, [], core=core)
        assert f.stats.groups_looked_up >= 1 and f.stats.groups_by_rule.get("lookup")
        # a value handed out is a copy: writing into it reaches neither the table nor other instances
        table = leaf.matrix.weight.clone()
        out = f([[3], [3], [7, 3]])
        out[0][1].add_(1.0)
        assert torch.equal(leaf.matrix.weight, table)
        assert torch.equal(out[1][1], leaf.matrix.weight[3].view(H, H))
        # the table changed in place between calls (an optimizer step): the next call reads it
        leaf.matrix.weight.mul_(2.0)
        again = f([[3]])
        assert torch.equal(again[0][1], leaf.matrix.weight[3].view(H, H))


@pytest.mark.parametrize("core", CORES)
def test_lookups_stay_batched_where_they_cannot_be_in_place(core):
    # autograd: the looked-up rows need their history
    leaf, fn = _mvrnn_like()
    insts = _instances(seed=2)
    f = assert_matches_eager(fn, insts, list(leaf.parameters()), core=core)
    assert f.stats.groups_looked_up == 0
    # max_norm renormalises the table in place as it looks up: the group runs as usual
    leaf, fn = _mvrnn_like(max_norm=1.0)
    with torch.no_grad():
        ref_leaf, ref_fn = _mvrnn_like(max_norm=1.0)
        out = autobatch(fn, core=core)(insts)
        ref = [ref_fn(x) for x in insts]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o[0], r[0])
    # small rows: a group buffer of its own is read by views, the table would need gathers
    leaf, fn = _mvrnn_like(hidden=8)
    with torch.no_grad():
        f = assert_matches_eager(fn, insts, [], core=core)
    assert f.stats.groups_looked_up == 0


@pytest.mark.parametrize("core", CORES)
def test_an_id_out_of_range_raises_the_embeddings_error(core):
    from batchcraft.errors import InstanceError

    leaf, fn = _mvrnn_like()
    with torch.no_grad(), pytest.raises(InstanceError, match="instance 1.*index out of range"):
        autobatch(fn, core=core)([[1, 2], [60]])


def test_form_reads_the_program():
    leaf, fn = _mvrnn_like()
    with torch.no_grad():
        f = autobatch(fn)
        f(_instances(seed=3))
    prog = next(p for p in reversed(_programs()) if p.name == "Leaf")
    tables = lookup.form(prog, [((), torch.int64, torch.device("cpu"))])
    assert [t is w for (t, _), w in zip(tables, (leaf.vector.weight, leaf.matrix.weight))] == [True, True]
    assert [s for _, s in tables] == [(H,), (H, H)]
    assert lookup.form(prog, [((), torch.float32, torch.device("cpu"))]) is None  # ids must be integers
    assert lookup.form(prog, [((2,), torch.int64, torch.device("cpu"))]) is None  # one id per instance


def _programs():
    from batchcraft.autobatching.signature import SIGNATURES

    return [i.program for i in SIGNATURES.by_sid[1:] if getattr(i, "program", None) is not None]


def test_embedding_calls_are_recognised_in_both_spellings():
    w = torch.randn(10, 4096)
    for f in (lambda i: F.embedding(i, w), lambda i: torch.embedding(w, i)):
        blk = static_block(f)
        with torch.no_grad():
            g = assert_matches_eager(lambda i: blk(torch.tensor(i)), [1, 2, 9, 2], [])
        assert g.stats.groups_looked_up == 1
