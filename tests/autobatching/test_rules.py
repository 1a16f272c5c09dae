"""Batching rules: each common operation batched equals the per-instance result (hypothesis)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from batchcraft import autobatch, static_block

from equivalence import CORES, assert_matches_eager

torch.manual_seed(0)
W = torch.randn(6, 6, requires_grad=True)
V = torch.randn(6, requires_grad=True)
EMB = nn.Embedding(20, 6)
LN = nn.LayerNorm(6)
LSTM = nn.LSTMCell(6, 6)

# per-instance programs over x of shape (k, 6); each exercises one rule family
PROGRAMS = {
    "elementwise": lambda x: torch.sigmoid(x) * torch.tanh(x) - x.abs() + 1.5,
    "broadcast_shared": lambda x: x * V + V,
    "broadcast_rank": lambda x: x + x.sum(0),
    "matmul_shared_right": lambda x: x @ W,
    "matmul_shared_left": lambda x: W @ x[0],
    "matmul_both": lambda x: x @ x.t(),
    "linear": lambda x: F.linear(x, W, V),
    "layer_norm": lambda x: LN(x),
    "sum_dim0": lambda x: x.sum(0),
    "sum_all": lambda x: x.sum(),
    "mean_neg": lambda x: x.mean(-1),
    "softmax": lambda x: torch.softmax(x, dim=0) + F.log_softmax(x, dim=-1),
    "max_dim": lambda x: x.max(0).values + x.max(dim=1)[0].sum(),
    "cat0": lambda x: torch.cat([x, x * 2], 0),
    "cat_shared": lambda x: torch.cat([x, W[: x.shape[0]]], dim=1),
    "stack": lambda x: torch.stack([x, -x], dim=1),
    "split_chunk": lambda x: torch.cat(list(x.chunk(3, dim=-1))[::-1], -1) + x.split(2, dim=1)[0].sum(),
    "view_reshape": lambda x: x.reshape(-1).view(2, -1).sum(0),
    "permute_t": lambda x: x.unsqueeze(0).permute(2, 0, 1).sum(-1).t(),
    "transpose": lambda x: x.transpose(0, 1) @ x,
    "squeeze": lambda x: x[:1].squeeze() + x.unsqueeze(1).squeeze(1)[0],
    "getitem": lambda x: x[0, 1:4] + x[-1][::2].sum() + x[..., None][0, 0],
    "index_select": lambda x: x.index_select(1, torch.tensor([0, 2])),
    "flatten": lambda x: x.flatten() * 2,
    "where": lambda x: torch.where(x > 0, x, x * 0.1),
    "masked_fill": lambda x: x.masked_fill(x < 0, 0.0),
    "lstm_cell": lambda x: LSTM(x)[0] + LSTM(x)[1],
    "new_zeros": lambda x: x.new_zeros(x.shape[1]) + x[0],
    "vmap_rule": lambda x: torch.cumsum(x.flip(0), dim=0),  # flip has no hand rule
    "gather": lambda x: x.gather(1, torch.zeros(x.shape[0], 2, dtype=torch.long)),
    "embedding": lambda x: EMB((x[:, 0].abs() * 3).long().clamp(max=19)).sum(0),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@settings(max_examples=6, deadline=None)
@given(ks=st.lists(st.integers(1, 4), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_rule_matches_per_instance(name, ks, seed):
    prog = PROGRAMS[name]
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(k, 6, generator=g, requires_grad=True) for k in ks]
    f = autobatch(prog)
    out = f(xs)
    ref = [prog(x) for x in xs]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
    # gradients w.r.t. every per-instance input and the shared tensors
    params = [W, V] + xs
    gb = torch.autograd.grad(sum((o * (i + 1)).sum() for i, o in enumerate(out) if o.is_floating_point()),
                             params, allow_unused=True)
    ge = torch.autograd.grad(sum((r * (i + 1)).sum() for i, r in enumerate(ref) if r.is_floating_point()),
                             params, allow_unused=True)
    for a, b in zip(gb, ge):
        if a is None or b is None:
            assert (a is None or not a.any()) and (b is None or not b.any())
        else:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert f.stats.fallbacks == 0, f.stats.groups_by_rule


def test_unary_maths_of_a_batched_chunk_runs_on_a_contiguous_copy(monkeypatch):
    # per instance each chunk is contiguous; the batch's chunk is a row-strided view, on which
    # torch's tanh / exp are several times slower (benchmarks/strided_unary.py): the lowering
    # copies it first, with the same values and gradients as eager
    from batchcraft import static_block
    from batchcraft.autobatching import rules

    seen = []
    original = rules.dense_on_cpu

    def counting(x):
        seen.append(x.is_contiguous())
        return original(x)

    monkeypatch.setattr(rules, "dense_on_cpu", counting)

    w = torch.randn(6, 9, requires_grad=True)

    @static_block
    def cell(x):
        i, o, u = (x @ w).chunk(3, dim=-1)
        return torch.sigmoid(i) * torch.tanh(u) + o.exp() + torch.sqrt(u * u + 1)

    xs = [torch.randn(6) for _ in range(5)]
    out = autobatch(cell)(xs)
    ref = [cell(x) for x in xs]
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b)
    g = torch.autograd.grad(sum(o.sum() for o in out), w)[0]
    g_ref = torch.autograd.grad(sum(r.sum() for r in ref), w)[0]
    torch.testing.assert_close(g, g_ref)
    assert seen.count(False) >= 2  # tanh(u) and o.exp() got strided views; sqrt's input is dense


@pytest.fixture
def no_vmap(monkeypatch):
    """Fail the test if an operation goes through the general vmap rule."""
    from batchcraft.autobatching import rules

    def refuse(*a, **k):
        raise AssertionError("vmap used")

    monkeypatch.setattr(rules, "rule_vmap", refuse)
    monkeypatch.setattr(rules.VMAP, "fn", refuse)


@pytest.mark.parametrize("core", CORES)
def test_attention_shaped_ops_are_written_out_without_vmap(core, no_vmap):
    # permute / unbind / transpose / batched and shared matmul / max() and min() over all
    # elements are lowered to one batched call each (vmap costs ~200 µs a call: Berxit's layer)
    torch.manual_seed(0)
    qkv = torch.nn.Linear(8, 24)
    w = torch.nn.Parameter(torch.randn(4, 3))

    @static_block
    def layer(x):
        L = x.shape[0]
        q, k, v = qkv(x).view(L, 3, 2, 4).permute(1, 2, 0, 3)   # 3 x (2, L, 4)
        a = torch.softmax((q @ k.transpose(-1, -2)) / 2.0, dim=-1)
        ctx = (a @ v).transpose(0, 1).reshape(L, -1)              # (L, 8)
        s = ctx[:, :4] @ w                                        # (L, 3), shared right operand
        first, *rest = s.unbind(1)
        return s.sum() + first.sum() + torch.unbind(ctx)[0].sum() * 0.5

    insts = [torch.randn(5, 8, requires_grad=True) for _ in range(6)]
    f = assert_matches_eager(layer, insts, list(qkv.parameters()) + [w] + insts, core=core)
    assert f.stats.fallbacks == 0
    # max() / min() over all elements: a row amax / amin where no gradient flows (grad mode off)
    extrema = static_block(lambda x: x.max() + x.min() * 0.5 + x[0].max())
    with torch.no_grad():
        g = assert_matches_eager(extrema, [x.detach() for x in insts], [], core=core)
        h = assert_matches_eager(lambda x: x.min(), [x.detach() for x in insts], [], core=core)
    assert g.stats.fallbacks == 0 and h.stats.fallbacks == 0


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("n", [2, 3])
def test_matmul_of_two_instance_operands_of_different_ranks(core, n):
    # (2, 4, 5) @ (5, 3) per instance: batched, the ranks are aligned after the batch dim; matmul
    # broadcast b's instances against a's leading dim (wrong values when n == 2; a fallback else)
    torch.manual_seed(n)
    blk = static_block(lambda a, b: a @ b)
    insts = [(torch.randn(2, 4, 5, requires_grad=True), torch.randn(5, 3, requires_grad=True)) for _ in range(n)]
    leaves = [t for p in insts for t in p]
    for fn in (lambda p: p[0] @ p[1], lambda p: blk(*p), lambda p: torch.matmul(p[1].t(), p[0].transpose(-1, -2))):
        f = assert_matches_eager(fn, insts, leaves, core=core)
        assert f.stats.fallbacks == 0


@pytest.mark.parametrize("core", CORES)
def test_max_over_all_elements_sends_the_gradient_to_a_nan_as_eager(core):
    blk = static_block(lambda x: x.max() + x.min())
    xs = [torch.tensor([1.0, float("nan"), 3.0, 3.0], requires_grad=True) for _ in range(4)]
    for fn in (lambda x: x.max() - x.min(), blk):
        ref = torch.autograd.grad(sum(fn(x) for x in xs), xs)
        got = torch.autograd.grad(sum(autobatch(fn, core=core)(xs)), xs)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("core", CORES)
def test_argmax_over_all_elements_is_one_batched_call_without_vmap(core, no_vmap):
    # int(torch.argmax(logits)) is how a decoder picks its label (DRNN): vmap cost ~100 us a group.
    # The batched call flattens each instance; ties keep the first index, as eager does
    def prog(x):
        return (torch.argmax(x), x.argmin(), torch.argmax(x * 2, keepdim=False), torch.argmax(x, dim=None, keepdim=True),
                x.argmin(None, True), x[0].argmax())

    def decide(x):  # a value wait on the index, as a decoder's label choice
        return x[int(torch.argmax(x[0])) % 3].sum()

    g = torch.Generator().manual_seed(3)
    insts = [torch.randn(3, 4, generator=g) for _ in range(4)] + [torch.zeros(3, 4), torch.ones(3, 4).tril()]
    scalars = [torch.randn((), generator=g) for _ in range(3)]
    for fn, xs in ((prog, insts), (static_block(prog), insts), (decide, insts), (lambda x: (x.argmax(), x.argmin(keepdim=True)), scalars)):
        with torch.no_grad():
            f = autobatch(fn, core=core)
            out = f(xs)
        for o, x in zip(out, xs):
            r = fn(x)
            for a, b in zip(o, r) if isinstance(r, tuple) else [(o, r)]:
                a, b = torch.as_tensor(a), torch.as_tensor(b)
                assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        assert f.stats.fallbacks == 0, f.stats.fallback_reasons


@pytest.mark.parametrize("core", CORES)
def test_expand_to_more_dims_puts_the_new_dims_after_the_batch_dim(core):
    # hostile pass, stop 39: x.expand(k, H) of a per-instance (H,) ran one instance at a time
    blk = static_block(lambda x: (x.expand(3, 5) + 1, x[0].expand(2, 2), x.expand(2, 1, -1)))

    def fn(x):
        return x.expand(3, x.shape[0]) * 2, x.sum().expand(4), x.expand(2, 1, -1).sum(0), x.expand(x.shape[0])

    insts = [torch.randn(5, requires_grad=True) for _ in range(6)]
    for prog in (fn, blk):
        f = assert_matches_eager(prog, insts, insts, core=core)
        assert f.stats.fallbacks == 0, f.stats.fallback_reasons


@pytest.mark.parametrize("core", CORES)
def test_a_sum_of_two_products_adds_the_second_into_the_first(core, monkeypatch):
    # MV-RNN's P^T = A^T W1^T + B^T W2^T: the second product is added into the first's fresh result
    # by one GEMM with beta 1 (lower.matmul_accumulate); with autograd, the sum as written
    from batchcraft.autobatching import lower

    calls = []
    original = lower.matmul_accumulate

    def counting(acc, y, w):
        out = original(acc, y, w)
        calls.append(out is acc)
        return out

    monkeypatch.setattr(lower, "matmul_accumulate", counting)
    torch.manual_seed(7)
    w1, w2 = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    blk = static_block(lambda a, b: (a @ w1 + b @ w2, (a @ w1) * 2 + b.sum()))
    insts = [(torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)) for _ in range(5)]
    leaves = [t for p in insts for t in p]
    with torch.no_grad():
        for _ in range(2):  # (the first call runs the checked program, the second the fast one)
            assert_matches_eager(lambda p: blk(*p), insts, [], core=core)
    assert calls and all(calls)  # in place
    calls.clear()
    for _ in range(2):
        assert_matches_eager(lambda p: blk(*p), insts, [w1, w2] + leaves, core=core)
    assert calls and not any(calls)  # autograd: the plain sum


@pytest.mark.parametrize("core", CORES)
def test_an_accumulated_sum_under_an_elementwise_tail_is_not_fused_away(core):
    # a new user's trial, stop 54: tanh((a @ B) @ W1 + (b @ A) @ W2) in inference: the fused
    # kernel took the sum, which reads the folded first product, never made (NameError), and the
    # whole group ran one instance at a time
    torch.manual_seed(3)
    w1, w2 = torch.randn(6, 6) / 3, torch.randn(6, 6) / 3
    blk = static_block(lambda a, A, b, B: torch.tanh((a @ B) @ w1 + (b @ A) @ w2) * 0.5 + 0.1)
    insts = [tuple(torch.randn(*s) for s in ((6,), (6, 6), (6,), (6, 6))) for _ in range(5)]
    with torch.no_grad():
        for _ in range(2):  # (the checked program, then the fast one)
            f = assert_matches_eager(lambda p: blk(*p), insts, [], core=core)
            assert f.stats.fallbacks == 0, f.stats.fallback_reasons
            assert f.stats.batched_calls == 1


def test_a_failing_rewrite_costs_the_rewrite_not_the_batching(monkeypatch):
    from batchcraft.autobatching import lower

    def broken(*a):
        raise TypeError("broken on purpose")

    monkeypatch.setattr(lower, "_accumulate_products", broken)
    w1, w2 = torch.randn(4, 5), torch.randn(4, 5)
    blk = static_block(lambda a, b: a @ w1 + b @ w2 + 0.5)
    insts = [(torch.randn(3, 4), torch.randn(3, 4)) for _ in range(4)]
    with torch.no_grad():
        for _ in range(2):
            f = assert_matches_eager(lambda p: blk(*p), insts, [])
    assert f.stats.fallbacks == 0 and f.stats.batched_calls == 1
    assert any("products not accumulated (TypeError: broken on purpose)" in r for r in f.stats.fallback_reasons)
