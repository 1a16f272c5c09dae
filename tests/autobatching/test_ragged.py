"""Ragged groups (ragged.py): segment reductions over a list argument's members."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchcraft import autobatch, static_block
from batchcraft.autobatching import ragged

from equivalence import CORES


def _tie_split_reference(x, seg, n, largest):
    """Eager's gradient of ``amax``/``amin`` over each segment's rows, summed: split among ties."""
    g = torch.zeros_like(x)
    for s in range(n):
        m = seg == s
        rows = x[m]
        best = rows.amax(0) if largest else rows.amin(0)
        hit = (rows == best).to(x.dtype)
        g[m] = hit / hit.sum(0)
    return g


@pytest.mark.parametrize("kind", ["amax", "amin"])
def test_segment_max_gradient_ignores_what_fresh_memory_held(kind, monkeypatch):
    # reliability #27: the output began as new_empty; scatter_reduce's backward counts elements
    # of that self equal to the result as ties even with include_self=False, so memory that held
    # the previous batch's rows (the allocator often hands them back) halved the gradient
    x0 = torch.tensor([[1.0, -2.0], [3.0, 0.5], [0.0, 4.0], [2.0, 2.0], [-1.0, 5.0]])
    seg = torch.tensor([0, 0, 1, 2, 2])
    red = torch.amax if kind == "amax" else torch.amin
    result = torch.stack([red(x0[seg == s], 0) for s in range(3)])
    real_new_empty = torch.Tensor.new_empty

    def recycled(self, size, *a, **k):  # memory that happens to hold the result already
        out = real_new_empty(self, size, *a, **k)
        return out.copy_(result) if tuple(out.shape) == tuple(result.shape) else out

    monkeypatch.setattr(torch.Tensor, "new_empty", recycled)
    x = x0.clone().requires_grad_()
    out = (ragged.seg_amax if kind == "amax" else ragged.seg_amin)(x, seg, 3)
    torch.testing.assert_close(out, result)
    (g,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(g, _tie_split_reference(x0, seg, 3, kind == "amax"))


@pytest.mark.parametrize("core", CORES)
def test_ragged_amax_block_gradient_is_stable_across_calls(core):
    # the fuzzer's case of #27: two parents with one child each, the same leaf word, 1 in 7 runs
    # off by up to 0.6 in the embedding's gradient before the fix
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(11, 5), torch.nn.Linear(5, 5)

    @static_block
    def cell(x, kids):
        if kids:
            k = torch.stack(kids, dim=-2)
            att = torch.softmax((k * x.unsqueeze(-2)).sum(-1), dim=-1)
            x = x + (att.unsqueeze(-1) * torch.tanh(lin(k))).sum(-2) + k.amax(-2)
        return torch.tanh(lin(x))

    def encode(tree):
        wid, kids = tree
        return cell(emb(torch.tensor(wid)), [encode(c) for c in kids])

    trees = [(0, ()), (3, ((2, ()),)), (7, ((2, ()),)), (9, ((4, ()), (2, ()), (4, ())))]
    weights = [torch.randn(5) for _ in trees]
    ref = [encode(t) for t in trees]
    (want,) = torch.autograd.grad(sum((r * w).sum() for r, w in zip(ref, weights)), emb.weight)
    f = autobatch(encode, core=core, scheduler="agenda")
    for _ in range(12):
        out = f(trees)
        (got,) = torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)), emb.weight)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("n", [1, 3, 4])
def test_a_constant_named_first_is_not_shadowed_by_the_segment_counts(core, n):
    # hostile find (stop 35): the ragged program's parameter C0 (the children counts) shadowed the
    # first constant the program names, also "C0": the children were multiplied by their count
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)

    @static_block
    def cell(x, kids):
        if kids:
            return x + (torch.stack(kids) * w).sum(0)
        return x * 1

    def fn(x):
        return cell(x, [x * 1, x * 2, x * 3])

    xs = [torch.randn(4) for _ in range(n)]
    f = autobatch(fn, core=core)
    for _ in range(3):
        out = f(xs)
        for o, x in zip(out, xs):
            torch.testing.assert_close(o, fn(x))
    assert not f.stats.fallback_reasons
    (g,) = torch.autograd.grad(sum(o.sum() for o in out), w)
    (ge,) = torch.autograd.grad(sum(fn(x).sum() for x in xs), w)
    torch.testing.assert_close(g, ge)


@pytest.mark.parametrize("core", CORES)
def test_a_child_sum_module_whose_first_operation_reads_a_weight_batches(core):
    # the same clash made F.linear receive the counts as its weight: every ragged group then ran
    # one instance at a time (correct values, counted in fallback_reasons)
    class ChildSum(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W = torch.nn.Linear(4, 4)

        def forward(self, x, kids):
            h = self.W(x)
            if kids:
                h = h + torch.stack(kids, dim=0).sum(0)
            return torch.tanh(h)

    torch.manual_seed(0)
    cell = static_block(ChildSum())

    def encode(tree):
        x, kids = tree
        return cell(x, [encode(k) for k in kids])

    def leaf():
        return (torch.randn(4), ())

    trees = [(torch.randn(4), (leaf(), leaf(), leaf())), (torch.randn(4), (leaf(),)),
             (torch.randn(4), (leaf(), (torch.randn(4), (leaf(), leaf()))))]
    f = autobatch(encode, core=core)
    out = f(trees)
    for o, t in zip(out, trees):
        torch.testing.assert_close(o, encode(t))
    assert not f.stats.fallback_reasons
    assert f.stats.groups_by_rule.get("ragged_block")


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("reduction", ["bool_sum", "int32_sum", "sum_dtype", "softmax_dtype"])
def test_promoting_reductions_over_the_children_batch_without_fallback(core, reduction):
    # reliability #127: the segment kernels kept the input dtype; the runtime's dtype check caught
    # it (values right) but every such group then ran one instance at a time
    @static_block
    def cell(x, kids):
        if not kids:
            return x * 1, torch.zeros(3, dtype=torch.float64)
        k = torch.stack(kids)
        if reduction == "bool_sum":
            r = (k > 0).sum(0).to(torch.float64)
        elif reduction == "int32_sum":
            r = (k * 10).to(torch.int32).sum(0).to(torch.float64)
        elif reduction == "sum_dtype":
            r = k.sum(0, dtype=torch.float64)
        else:
            r = torch.softmax(k, 0, dtype=torch.float64).sum(0)
        return x + k.mean(0), r

    def encode(tree):
        x, kids = tree
        outs = [encode(k) for k in kids]
        return cell(x, [o[0] for o in outs])

    torch.manual_seed(0)

    def leaf():
        return (torch.randn(3), ())

    trees = [(torch.randn(3), (leaf(), leaf())), (torch.randn(3), (leaf(), leaf(), leaf())), (torch.randn(3), (leaf(),))]
    f = autobatch(encode, core=core)
    out = f(trees)
    for (h, r), t in zip(out, trees):
        rh, rr = encode(t)
        torch.testing.assert_close(h, rh)
        assert r.dtype == rr.dtype
        torch.testing.assert_close(r, rr)
    assert not f.stats.fallback_reasons, f.stats.fallback_reasons


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_segment_sums_and_means_round_as_eager(dtype):
    # hostile find (stop 35): the segment mean of float16 children accumulated in float16 and
    # came out one unit of the last place off eager's (which accumulates in float32)
    torch.manual_seed(0)
    for _ in range(50):
        lens = torch.randint(1, 6, (4,)).tolist()
        xs = [torch.randn(n, 7).mul(3).to(dtype) for n in lens]
        x = torch.cat(xs)
        seg = torch.repeat_interleave(torch.arange(4), torch.tensor(lens))
        cnt = torch.tensor(lens)
        for kind in ("sum", "mean", "logsumexp"):
            want = torch.stack([getattr(torch, kind)(t, 0) for t in xs])
            assert torch.equal(ragged.seg_reduce(kind, x, seg, cnt, 4, False), want), kind
        want = torch.cat([torch.log_softmax(t, 0) for t in xs])
        assert torch.equal(ragged.seg_softmax("log_softmax", x, seg, 4), want)


def test_a_block_whose_list_use_has_no_ragged_form_says_why():
    # new-user pass, stop 36: such blocks silently ran one group per list length
    W = torch.randn(8, 8)

    @static_block
    def attend(q, keys):
        K = torch.stack(keys)
        w = torch.softmax(K @ q, dim=0)  # a product with the list's rows: no ragged form
        return (w.unsqueeze(1) * K).sum(0)

    def inst(n):
        ks = [torch.tanh(W @ torch.full((8,), float(i) / n)) for i in range(n)]
        return attend(ks[-1], ks)

    f = autobatch(inst)
    lens = [1, 2, 3, 2, 5]
    for o, n in zip(f(lens), lens):
        torch.testing.assert_close(o, inst(n))
    assert any("attend: __matmul__ on the list's rows" in k for k in f.stats.ragged_declined), f.stats.summary()
    assert "not ragged" in f.stats.summary()


@pytest.mark.parametrize("core", CORES)
def test_a_decorated_method_runs_as_one_ragged_group(core):
    # a new user's find (stop 37): the method's ``self`` argument kept its calls off the ragged path,
    # silently (nodes grouped by child count, 2.3x slower)
    torch.manual_seed(0)

    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.U = nn.Linear(6, 6)

        @static_block
        def node(self, x, hs):
            return torch.tanh(x + self.U(torch.stack(hs, -2).sum(-2)))

    cell = Cell()

    def rec(t):
        x, kids = t
        return cell.node(x, [rec(k) for k in kids]) if kids else torch.tanh(x)

    def tree(depth, g):
        x = torch.randn(6, generator=g)
        n = int(torch.randint(0, 4, (1,), generator=g)) if depth < 3 else 0
        return (x, [tree(depth + 1, g) for _ in range(n)])

    g = torch.Generator().manual_seed(1)
    trees = [tree(0, g) for _ in range(12)]
    f = autobatch(rec, core=core)
    with torch.no_grad():
        out = f(trees)
        ref = [rec(t) for t in trees]
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert f.stats.groups_by_rule.get("ragged_block", 0) >= 1 and "block" not in f.stats.groups_by_rule, \
        f.stats.groups_by_rule
