"""Signatures: FIELD-FAULTS from DyNet and peers, each as a test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchcraft import autobatch

from equivalence import CORES, assert_matches_eager


def test_scalar_arguments_are_part_of_the_signature():
    # DyNet #555: ops differing only in a scalar were batched with the first instance's scalar
    def fn(inst):
        x, k = inst
        return F.leaky_relu(x + k, negative_slope=0.01 * k) * k + x[k:].sum()

    insts = [(torch.randn(6), k) for k in (1, 2, 3, 1, 2)]
    f = autobatch(fn)
    out = f(insts)
    for o, i in zip(out, insts):
        torch.testing.assert_close(o, fn(i))


def test_int_and_float_scalars_do_not_share_a_signature():
    def fn(inst):
        x, c = inst
        return x + c

    insts = [(torch.arange(3), 1), (torch.arange(3), 1.5)]
    out = autobatch(fn)(insts)
    assert out[0].dtype == torch.int64 and out[1].dtype == torch.float32
    torch.testing.assert_close(out[1], torch.arange(3) + 1.5)


def test_inputs_of_different_shapes_with_equal_output_shapes_are_not_batched():
    # DyNet #622/#573: keyed on output shape, inputs of different sizes were batched together
    def fn(x):
        return x.sum(0)  # (k, 4) -> (4,) for any k

    xs = [torch.randn(k, 4, requires_grad=True) for k in (1, 2, 3, 2, 1)]
    f = autobatch(fn)
    out = f(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, x.sum(0))
    torch.stack(out).sum().backward()
    for x in xs:
        assert torch.isfinite(x.grad).all()
        torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_every_instance_gets_its_own_gradient():
    # DyNet #1490: a saved value kept only for the last batch element
    lin = nn.Linear(5, 5)

    def fn(x):
        return (torch.tanh(lin(x)) * x).sum()

    xs = [torch.randn(5, requires_grad=True) for _ in range(6)]
    out = autobatch(fn)(xs)
    torch.stack(out).sum().backward()
    got = [x.grad.clone() for x in xs]
    for x in xs:
        x.grad = None
    torch.stack([fn(x) for x in xs]).sum().backward()
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, x.grad)


def test_random_draws_are_per_instance_and_reproducible():
    # DyNet PR #812/#1053: one dropout mask shared by all sentences
    def fn(x):
        return F.dropout(x, p=0.5, training=True)

    xs = [torch.ones(200) for _ in range(8)]
    f = autobatch(fn)
    torch.manual_seed(3)
    a = f(xs)
    masks = [(o != 0) for o in a]
    assert all(not torch.equal(masks[0], m) for m in masks[1:])
    torch.manual_seed(3)
    b = f(xs)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
    f16 = autobatch(fn)  # a different batch size still works
    assert len(f16([torch.ones(200)] * 16)) == 16


def test_shared_parameters_are_not_gathered_and_grads_match():
    lin = nn.Linear(4, 4)
    f = assert_matches_eager(lambda x: lin(lin(x)), [torch.randn(4) for _ in range(5)],
                             list(lin.parameters()))
    assert f.stats.batched_calls == 2


def test_tensors_captured_from_outside_are_shared():
    w = torch.randn(4, 4, requires_grad=True)
    assert_matches_eager(lambda x: torch.tanh(x @ w) + w[0], [torch.randn(4) for _ in range(5)], [w])


def test_no_grad_inside_instance_code_is_respected():
    lin = nn.Linear(3, 3)

    def fn(x):
        with torch.no_grad():
            a = lin(x)
        return a + lin(x)

    out = autobatch(fn)([torch.randn(3) for _ in range(3)])
    out[0].sum().backward()
    # only the second lin call contributes: d/dW = x once
    assert lin.weight.grad is not None


def test_views_of_a_shared_tensor_made_per_call_batch():
    # ``W.t()`` is a new tensor object at every call; keyed by identity, every instance's matmul
    # was a signature of its own and ran alone (48 calls for 16 instances x 3 steps)
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        for _ in range(3):
            x = torch.tanh(x @ w.t())
        return x

    f = assert_matches_eager(fn, [torch.randn(8) for _ in range(16)], [w])
    assert f.stats.groups_by_rule.get("matmul") == 3 and f.stats.fallbacks == 0


def test_different_views_of_one_base_do_not_share_a_signature():
    w = torch.randn(4, 6, requires_grad=True)
    # rows of w by instance: same base, shape and strides, different offsets
    f = assert_matches_eager(lambda ix: ix[0] * w[ix[1]], [(torch.randn(6), i % 4) for i in range(8)], [w])
    assert f.stats.batched_calls >= 4
    # a transposed view and a contiguous one of equal shape differ in strides
    sq = torch.randn(5, 5, requires_grad=True)
    assert_matches_eager(lambda ix: ix[0] @ (sq.t() if ix[1] else sq[:, :]), [(torch.randn(5), i % 2) for i in range(6)],
                         [sq])
    # conj/neg views of a complex base
    z = torch.randn(3, dtype=torch.complex64)
    xs = [torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    out = autobatch(lambda ix: ix[0] * (z.conj() if ix[1] else z[:]))([(x, i % 2) for i, x in enumerate(xs)])
    for i, (o, x) in enumerate(zip(out, xs)):
        torch.testing.assert_close(o, x * (z.conj() if i % 2 else z))


def test_cells_with_a_shared_input_or_state_batch():
    torch.manual_seed(0)
    gru, lstm = nn.GRUCell(6, 6), nn.LSTMCell(6, 6)
    x0 = torch.randn(6)  # the same input for every instance (a start token's embedding)

    def fn(h):
        c = torch.zeros(6)
        for _ in range(3):
            h = gru(x0, h)
            h, c = lstm(x0, (h, c))
        return h

    params = list(gru.parameters()) + list(lstm.parameters())
    f = assert_matches_eager(fn, [torch.randn(6) for _ in range(8)], params)
    assert f.stats.fallbacks == 0 and f.stats.groups_by_rule.get("rnn_cell") == 6


_W = torch.randn(8, 8, requires_grad=True)
_LIN = nn.Linear(8, 8)
_EMB = nn.Embedding(20, 8)
_MASK = torch.ones(10, requires_grad=True)


@pytest.mark.parametrize("name, fn, calls", [
    ("F.linear(x, W.t())", lambda x: F.linear(x, _W.t(), _LIN.bias), 1),
    ("x @ W.T", lambda x: x @ _W.T, 1),
    ("x @ W.mT", lambda x: x @ _W.mT, 1),
    ("x * mask[:8]", lambda x: x * _MASK[:8], 1),
    ("x * emb.weight[3]", lambda x: x * _EMB.weight[3], 1),
    ("x[:4] @ W[:4, :4]", lambda x: x[:4] @ _W[:4, :4], 2),
    ("x * bias.view(-1)", lambda x: x * _LIN.bias.view(-1), 1),
])
def test_common_views_of_parameters_batch(name, fn, calls):
    # each of these ran one instance at a time while shared tensors were keyed by identity
    f = assert_matches_eager(fn, [torch.randn(8) for _ in range(16)], [_W, *_LIN.parameters(), _EMB.weight, _MASK])
    assert f.stats.batched_calls == calls, (name, f.stats.groups_by_rule)


@pytest.mark.parametrize("core", CORES)
def test_a_view_of_a_parameter_after_its_storage_changed_reads_the_new_storage(core):
    # the signature of call 1 keeps call 1's view of W's old storage; W.data = ... (a manual SGD
    # step, vector_to_parameters) gives W new storage under the same id: call 2 must not reuse it
    w = nn.Parameter(torch.randn(4, 4))
    fn = lambda x: x @ w.t()  # noqa: E731
    xs = [torch.randn(4) for _ in range(3)]
    f = autobatch(fn, core=core)
    f(xs)
    w.data = torch.randn(4, 4)
    for o, x in zip(f(xs), xs):
        torch.testing.assert_close(o, x @ w.t())
    torch.nn.utils.vector_to_parameters(torch.randn(16), [w])
    for o, x in zip(f(xs), xs):
        torch.testing.assert_close(o, x @ w.t())


@pytest.mark.parametrize("core", CORES)
def test_views_made_outside_the_call_keep_their_identity(core):
    # the caller differentiates with respect to (or hooks) the very view object it captured
    e = nn.Parameter(torch.randn(5, 4))
    xs = [torch.randn(4) for _ in range(3)]
    for _ in range(2):
        h0 = e[0]  # a new view object each step, same base, offset, shape and strides
        hooked = []
        h0.register_hook(lambda g: hooked.append(g))
        outs = autobatch(lambda x: torch.tanh(x * h0), core=core)(xs)
        g = torch.autograd.grad(sum(o.sum() for o in outs), h0, retain_graph=True)[0]
        ref = torch.autograd.grad(sum(torch.tanh(x * h0).sum() for x in xs), h0)[0]
        torch.testing.assert_close(g, ref)
        sum(o.sum() for o in outs).backward()
        assert len(hooked) == 3  # both grad calls and the backward reach this step's h0
