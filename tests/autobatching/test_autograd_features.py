"""Autograd inside instance code acts as in eager; module buffers update as in eager.

Issue 15 items 3 and 4 (functorch #488, PyTorch #158610; giotto-deep #75, yolov5 #1630): tensor
hooks apply per instance and see that instance's gradient summed over all uses; ``requires_grad``,
``detach``, ``requires_grad_()``, ``is_leaf`` read as in eager; ``torch.autograd.grad`` and double
backward through outputs work; BatchNorm running statistics end equal to eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchcraft import autobatch, static_block

from equivalence import assert_matches_eager, check_inputs_against_eager

from equivalence import CORES  # noqa: E402
torch.manual_seed(0)
LIN = nn.Linear(4, 4)
PARAMS = list(LIN.parameters())


@pytest.mark.parametrize("core", CORES)
def test_hooks_see_each_instances_gradient_summed_over_uses(core):
    seen = {}

    def fn(inst):
        i, x = inst
        h = LIN(x)
        a = h.tanh()                                  # a use recorded before the hook
        h.register_hook(lambda g, i=i: seen.setdefault(("b", i), g.clone()) * 0 + g * 2)
        return (a + h * 3).sum()

    xs = [(i, torch.randn(4)) for i in range(4)]
    out = autobatch(fn, core=core)(xs)
    torch.stack(out).sum().backward()
    g_b = LIN.weight.grad.clone()
    batched = {k: v for k, v in seen.items()}
    LIN.zero_grad()
    seen.clear()
    torch.stack([fn(x) for x in xs]).sum().backward()
    torch.testing.assert_close(g_b, LIN.weight.grad)
    for i in range(4):
        torch.testing.assert_close(batched[("b", i)], seen[("b", i)])  # the instance's own gradient
    LIN.zero_grad()


@pytest.mark.parametrize("core", CORES)
def test_hook_on_an_instance_input_and_handle_remove(core):
    calls = []

    def fn(x):
        x.register_hook(lambda g: calls.append(1))
        h2 = x.register_hook(lambda g: g * 100)
        h2.remove()
        return (LIN(x) ** 2).sum()

    xs = [torch.randn(4, requires_grad=True) for _ in range(3)]
    out = autobatch(fn, core=core)(xs)
    torch.stack(out).sum().backward()
    got = [x.grad.clone() for x in xs]
    assert len(calls) == 3
    for x in xs:
        x.grad = None
    torch.stack([fn(x) for x in xs]).sum().backward()
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, x.grad)


@pytest.mark.parametrize("core", CORES)
def test_requires_grad_reads_and_branches_match_eager(core):
    def fn(x):
        h = LIN(x)
        d = h.detach()
        flags = (h.requires_grad, d.requires_grad, h.is_leaf, d.is_leaf, (h.grad_fn is None), (d.grad_fn is None),
                 x.requires_grad, x.is_leaf, torch.argmax(h).requires_grad)
        y = h * 2 if d.requires_grad else h - d   # a branch on requires_grad
        z = d.clone().requires_grad_()
        return y, z, flags, z.requires_grad, z.is_leaf

    xs = [torch.randn(4, requires_grad=i % 2 == 0) for i in range(4)]
    out = autobatch(fn, core=core)(xs)
    for o, x in zip(out, xs):
        r = fn(x)
        assert o[2] == r[2] and o[3] == r[3] and o[4] == r[4]
        torch.testing.assert_close(o[0], r[0])
        assert o[0].requires_grad == r[0].requires_grad and o[1].requires_grad == r[1].requires_grad


@pytest.mark.parametrize("core", CORES)
def test_requires_grad_false_on_a_computed_value_fails_as_in_eager(core):
    def fn(x):
        h = LIN(x)
        h.requires_grad_(False)
        return h

    with pytest.raises(RuntimeError, match="leaf variables"):
        fn(torch.randn(4))
    with pytest.raises(Exception, match="leaf variables"):
        autobatch(fn, core=core)([torch.randn(4)])


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("case", ["data_then_off", "setter", "used_before", "off_then_on", "no_grad_write",
                                  "detach_write", "made_leaf", "copy_alias", "off_then_write"])
def test_requires_grad_false_on_a_written_leaf_matches_eager(core, case):
    # reliability #121 (found at stop 34, fixed at stop 35): ``x.requires_grad_(False)`` after
    # ``x.data.mul_(2)`` raised "you can only change requires_grad flags of leaf variables"; x is
    # still a leaf there and eager accepts it. The caller's tensor (eager's x itself) stops
    # requiring grad after the call, keeps the written values; gradients as eager's
    v = nn.Parameter(torch.randn(3))

    def fn(x):
        extra = v * 1.0
        if case == "data_then_off":
            x.data.mul_(2)
            x.requires_grad_(False)
        elif case == "setter":
            x.data.add_(1)
            x.requires_grad = False
        elif case == "used_before":
            x.data.mul_(2)
            extra = x * v  # recorded while x required grad: eager's backward then skips x (no grad)
            x.requires_grad_(False)
        elif case == "off_then_on":
            x.data.mul_(2)
            x.requires_grad_(False)
            x.requires_grad_(True)  # the same leaf again: its gradient reaches the caller's tensor
        elif case == "no_grad_write":
            with torch.no_grad():
                x.mul_(3)  # (#96)
            x.requires_grad_(False)
        elif case == "detach_write":
            x.detach().sub_(1)
            x.requires_grad_(False)
            x.requires_grad_(False)
        elif case == "made_leaf":
            y = x.detach() * 2
            y.requires_grad_()
            y.data.mul_(3)
            y.requires_grad_(False)
            return y * v + x, y.requires_grad, y.is_leaf, x.requires_grad
        elif case == "copy_alias":
            y = x * 2
            s = copy.copy(y)
            s.requires_grad_(False)
            with torch.no_grad():
                y.add_(1)  # s follows: it still shares y's values
            return s * v + y, s.requires_grad, s.is_leaf, y.requires_grad
        else:
            x.data.mul_(2)
            x.requires_grad_(False)
            x.add_(1)  # no longer a leaf that requires grad: an ordinary in-place update
        return x * v + extra, x.requires_grad, x.is_leaf, x.grad_fn is None

    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    check_inputs_against_eager(fn, xs, core, [v])


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("case", ["computed", "computed_after_data", "view_input", "enable_grad_view"])
def test_requires_grad_false_on_non_leaves_still_fails_as_in_eager(core, case):
    # the counterpart of #121's fix: eager refuses requires_grad_(False) on a value with history
    # (also after a write through .data, also an input that is a view of a leaf); batched too
    big = torch.randn(3, 3, requires_grad=True)

    def fn(x):
        if case == "computed":
            y = x * 2
            y.data.mul_(2)
            y.requires_grad_(False)
        elif case == "computed_after_data":
            x.data.mul_(2)
            (x + 1).requires_grad_(False)
        else:
            x.data.mul_(2)
            with torch.enable_grad():
                x.requires_grad_(False)  # x = big[i]: a view, not a leaf
        return x * 1

    def inputs():
        if case in ("view_input", "enable_grad_view"):
            return [big[i] for i in range(3)]
        return [torch.randn(3, requires_grad=True) for _ in range(3)]

    with pytest.raises(RuntimeError, match="leaf variables"):
        fn(inputs()[0])
    xs = inputs()
    with pytest.raises(Exception, match="leaf variables"):
        autobatch(fn, core=core)(xs)
    assert all(x.requires_grad for x in xs)


@pytest.mark.parametrize("core", CORES)
def test_autograd_grad_and_double_backward_through_outputs(core):
    def fn(x):
        return (torch.tanh(LIN(x)) ** 2).sum()

    xs = [torch.randn(4, requires_grad=True) for _ in range(3)]
    out = autobatch(fn, core=core)(xs)
    ref = [fn(x) for x in xs]
    gb = torch.autograd.grad(sum(out), xs, create_graph=True)
    ge = torch.autograd.grad(sum(ref), xs, create_graph=True)
    for a, b in zip(gb, ge):
        torch.testing.assert_close(a, b)
    hb = torch.autograd.grad(sum(g.sum() for g in gb), LIN.weight)[0]
    he = torch.autograd.grad(sum(g.sum() for g in ge), LIN.weight)[0]
    torch.testing.assert_close(hb, he)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("momentum", [0.1, 0.3])
def test_batchnorm_running_statistics_update_in_instance_order(core, momentum):
    torch.manual_seed(1)
    bn = nn.BatchNorm1d(3, momentum=momentum)
    bn2 = nn.BatchNorm1d(3, momentum=momentum)
    lin = nn.Linear(3, 3)

    def fn(x):
        h = bn(x)
        if x.sum() > 0:              # a wait between the two BatchNorm calls (BN outputs sum to ~0)
            h = h * 2
        return bn2(lin(h) + x)       # depth differs per instance -> several groups

    xs = [torch.randn(k, 3) * (i + 1) for i, k in enumerate((2, 5, 3, 4, 2))]
    ref_bn, ref_bn2, ref_lin = copy.deepcopy(bn), copy.deepcopy(bn2), lin
    out = autobatch(fn, core=core)(xs)

    def eager(x):
        h = ref_bn(x)
        if x.sum() > 0:
            h = h * 2
        return ref_bn2(ref_lin(h) + x)

    ref = [eager(x) for x in xs]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
    for a, b in ((bn, ref_bn), (bn2, ref_bn2)):
        torch.testing.assert_close(a.running_mean, b.running_mean)
        torch.testing.assert_close(a.running_var, b.running_var)
        assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == len(xs)
    gb = torch.autograd.grad(sum(o.sum() for o in out), [bn.weight, lin.weight])
    ge = torch.autograd.grad(sum(r.sum() for r in ref), [ref_bn.weight, lin.weight])
    for a, b in zip(gb, ge):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("rows", [(3,), (3, 4)])
def test_train_mode_batchnorm_under_bf16_autocast_keeps_eager_dtype_and_rounding(core, rows):
    # the long fuzz run (stop 33, reliability #85): the batched train-mode batch norm was a
    # decomposition in the input's dtype, so a bfloat16 input (a Linear under CPU autocast) gave
    # a float32 output and bf16 statistics: weight gradients 10% off eager's
    torch.manual_seed(0)
    lin, bn = nn.Linear(5, 5), nn.BatchNorm1d(5, momentum=0.3)
    bn_e = copy.deepcopy(bn)

    def make(norm):
        def fn(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = lin(x)
                s = torch.stack([h, h * 0.5 + 1.0, torch.tanh(h)])  # (3, *rows, 5)
                return norm(s.transpose(1, -1) if s.dim() == 3 else s)
        return fn

    xs = [torch.randn(*rows[1:], 5) for _ in range(6)] + [torch.randn(*rows[1:], 5)] * 2
    out = autobatch(make(bn), core=core)(xs)
    ref = [make(bn_e)(x) for x in xs]
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype == torch.bfloat16
        torch.testing.assert_close(o, r, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(bn.running_mean, bn_e.running_mean)
    torch.testing.assert_close(bn.running_var, bn_e.running_var)
    gb = torch.autograd.grad(sum(o.float().sum() for o in out), lin.weight)[0]
    ge = torch.autograd.grad(sum(r.float().sum() for r in ref), lin.weight)[0]
    torch.testing.assert_close(gb, ge, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("core", CORES)
def test_batchnorm_in_eval_mode_reads_running_statistics(core):
    bn = nn.BatchNorm1d(3)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    bn.eval()
    xs = [torch.randn(k, 3) for k in (1, 4, 2)]
    assert_matches_eager(bn, xs, list(bn.parameters()), core=core)


@pytest.mark.parametrize("core", CORES)
def test_positive_under_no_grad_returns_the_value_itself_as_in_eager(core):
    # the long fuzz run (stop 30, reliability #70): `with torch.no_grad(): h = +h` is h itself in
    # eager, autograd history included; batched it was a no_grad copy with part of the gradient
    torch.manual_seed(0)
    cell = torch.nn.GRUCell(1, 1)

    def fn(x):
        h = torch.tanh(x.sum(0))
        for t in range(x.shape[0]):
            h = cell(x[t], h)
        with torch.no_grad():
            h = +h
            h = torch.positive(h)
        return h

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 1, generator=g) for n in (1, 2, 3)]
    assert_matches_eager(fn, xs, list(cell.parameters()), core=core, fibers=False)
    assert_matches_eager(fn, xs, list(cell.parameters()), core=core)


@pytest.mark.parametrize("core", CORES)
def test_train_mode_batchnorm_keeps_each_instance_layout(core):
    # a hostile helper (stop 33): the batched batch norm returned contiguous rows for a
    # channels_last input, so `.view(-1)` worked where eager's raises; contiguous stays contiguous
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)

    def fn(x):
        return bn(x).view(-1).sum()

    cl = [torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last) for _ in range(3)]
    with pytest.raises(RuntimeError, match="view size"):
        fn(cl[0])
    with pytest.raises(Exception, match="view size"):
        autobatch(fn, core=core)(cl)
    xs = [x.contiguous() for x in cl]
    out = autobatch(fn, core=core)(xs)
    bn_e = copy.deepcopy(bn)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, bn_e(x).view(-1).sum(), atol=1e-4, rtol=1e-4)


# Found by a hostile helper at stop 33, present before it, fixed at stop 34 (docs/reliability.md #89-#92).
@pytest.mark.parametrize("core", CORES)
def test_batch_norm_updates_running_statistics_made_inside_the_instance(core):
    def fn(x):
        rm, rv = torch.zeros(3), torch.ones(3)
        y = F.batch_norm(x, rm, rv, None, None, True, 0.5)
        return y, rm, rv

    xs = [torch.randn(5, 3) for _ in range(2)]
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            out = autobatch(fn, core=core)(xs)
            ref = [fn(x) for x in xs]
        for o, r in zip(out, ref):
            for a, b in zip(o, r):
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("core", CORES)
def test_cumulative_batchnorm_statistics_with_a_value_wait_between_calls(core):
    torch.manual_seed(0)
    bn_e = nn.BatchNorm1d(3, momentum=None)
    bn_b = copy.deepcopy(bn_e)

    def make(bn):
        def fn(x):
            y = bn(x)
            if y.sum() > 0:  # a value wait: other instances' first calls run meanwhile
                pass
            return bn(y * 3)
        return fn

    xs = [torch.randn(4, 3) for _ in range(3)]
    [make(bn_e)(x) for x in xs]
    autobatch(make(bn_b), core=core)(xs)
    torch.testing.assert_close(bn_b.running_var, bn_e.running_var)


@pytest.mark.parametrize("core", CORES)
def test_static_block_batchnorm_updates_running_statistics_per_instance_in_order(core):
    torch.manual_seed(0)
    bn_e = nn.BatchNorm1d(1, momentum=0.5, affine=False)
    bn_b = static_block(copy.deepcopy(bn_e))
    xs = [torch.randn(n, 1) for n in (2, 4, 2)]
    [bn_e(x) for x in xs]
    autobatch(lambda x: bn_b(x), core=core)(xs)
    torch.testing.assert_close(bn_b.running_mean, bn_e.running_mean)
    assert int(bn_b.num_batches_tracked) == int(bn_e.num_batches_tracked)


@pytest.mark.parametrize("core", CORES)
def test_constant_momentum_is_not_reassigned_when_instances_interleave(core):
    # the cumulative-factor reordering (buffers._eager_factors) must leave constant and
    # per-instance momenta with their own call
    torch.manual_seed(1)
    rm_e, rm_b = torch.zeros(3), torch.zeros(3)

    def make(rm):
        def fn(x):
            m = 0.2 if x.shape[0] == 4 else 0.7  # a per-instance momentum
            y = F.batch_norm(x, rm, torch.ones(3), None, None, True, m)
            if y.sum() > 0:
                pass
            return F.batch_norm(y * 2, rm, torch.ones(3), None, None, True, m)
        return fn

    xs = [torch.randn(n, 3) for n in (4, 5, 4, 6)]
    [make(rm_e)(x) for x in xs]
    autobatch(make(rm_b), core=core)(xs)
    torch.testing.assert_close(rm_b, rm_e)


@pytest.mark.parametrize("core", CORES)
def test_batch_norm_with_momentum_none_raises_as_in_eager(core):
    with pytest.raises(TypeError):
        F.batch_norm(torch.randn(4, 2), torch.zeros(2), torch.ones(2), training=True, momentum=None)
    with pytest.raises(Exception, match="momentum.*must be float, not NoneType"):
        autobatch(lambda x: F.batch_norm(x, torch.zeros(2), torch.ones(2), training=True, momentum=None),
                  core=core)([torch.randn(4, 2), torch.randn(3, 2)])


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("momentum", [0.3, None])
def test_static_block_batchnorm_runs_unblocked_with_eager_statistics(core, momentum):
    # a train-mode BatchNorm marked static_block (also inside another block): outputs, running
    # statistics and num_batches_tracked as eager's; the fallback is counted with its reason
    torch.manual_seed(2)
    lin = nn.Linear(2, 2)
    bn_e = nn.BatchNorm1d(2, momentum=momentum)
    bn_b = static_block(copy.deepcopy(bn_e))
    outer = static_block(lambda x: torch.tanh(bn_b(lin(x))))
    xs = [torch.randn(n, 2) for n in (2, 4, 3, 4)]
    ref = [torch.tanh(bn_e(lin(x))) for x in xs]
    f = autobatch(lambda x: outer(x), core=core)
    out = f(xs)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    torch.testing.assert_close(bn_b.running_mean, bn_e.running_mean)
    torch.testing.assert_close(bn_b.running_var, bn_e.running_var)
    assert int(bn_b.num_batches_tracked) == int(bn_e.num_batches_tracked) == len(xs)
    assert any("runs unblocked" in k for k in f.stats.fallback_reasons)
    # in eval mode the same block is traced and batched again
    bn_b.eval()
    bn_e.eval()
    f = autobatch(lambda x: outer(x), core=core)
    out = f(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, torch.tanh(bn_e(lin(x))))
    assert not f.stats.fallback_reasons


@pytest.mark.parametrize("core", CORES)
def test_static_block_module_switched_to_train_inside_instance_code(core):
    torch.manual_seed(3)
    bn_e = nn.BatchNorm1d(2, momentum=0.3)
    bn_b = static_block(copy.deepcopy(bn_e))

    def make(bn):
        def fn(x):
            bn.eval()
            bn(x)  # an eval read (sees running statistics from before the call: buffers.py)
            bn.train()
            return bn(x * 2)
        return fn

    xs = [torch.randn(n, 2) for n in (3, 4, 3)]
    ref = [make(bn_e)(x) for x in xs]
    out = autobatch(make(bn_b), core=core)(xs)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    torch.testing.assert_close(bn_b.running_mean, bn_e.running_mean)
    assert int(bn_b.num_batches_tracked) == int(bn_e.num_batches_tracked)


# Found by the hostile helper on stop 34's own changes (docs/reliability.md #97-#99).
@pytest.mark.parametrize("core", CORES)
def test_per_instance_momenta_that_look_cumulative_stay_with_their_call(core):
    # #97: factors 1/1, 1/2 in recording order were taken for nn.BatchNorm's running count
    def make(rm, rv):
        def fn(x):
            if x.shape[0] == 4 and (x * 2).sum() > -100:  # a value wait in instance 0 only
                x = x + 0
            return F.batch_norm(x, rm, rv, None, None, True, 1.0 / (x.shape[0] - 2))
        return fn

    torch.manual_seed(0)
    xs = [torch.randn(4, 3), torch.randn(3, 3) + 5]
    rm_e, rv_e, rm_b, rv_b = torch.zeros(3), torch.ones(3), torch.zeros(3), torch.ones(3)
    [make(rm_e, rv_e)(x) for x in xs]
    autobatch(make(rm_b, rv_b), core=core)(xs)
    torch.testing.assert_close(rm_b, rm_e)
    torch.testing.assert_close(rv_b, rv_e)


@pytest.mark.parametrize("core", CORES)
def test_cumulative_batchnorm_at_counts_whose_reciprocal_is_inexact(core):
    # #97: 1 / (1 / 49) != 49 in floating point; the counts read are used as they are
    torch.manual_seed(4)
    bn_e = nn.BatchNorm1d(3, momentum=None)
    bn_e.num_batches_tracked.fill_(46)
    bn_b = copy.deepcopy(bn_e)

    def make(bn):
        def fn(x):
            y = bn(x)
            if y.sum() > 0:
                pass
            return bn(y * 3)
        return fn

    xs = [torch.randn(4, 3) for _ in range(3)]
    [make(bn_e)(x) for x in xs]
    autobatch(make(bn_b), core=core)(xs)
    torch.testing.assert_close(bn_b.running_mean, bn_e.running_mean)
    torch.testing.assert_close(bn_b.running_var, bn_e.running_var)


@pytest.mark.parametrize("core", CORES)
def test_running_statistics_of_another_dtype_raise_as_in_eager(core):
    # #98: float64 statistics with a float32 input
    def fn(x):
        rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        return F.batch_norm(x, rm, rv, None, None, True, 0.5)

    with pytest.raises(RuntimeError, match="mixed dtype"):
        fn(torch.randn(4, 3))
    with pytest.raises(Exception, match="mixed dtype"):
        autobatch(fn, core=core)([torch.randn(4, 3), torch.randn(5, 3)])


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("kind", ["1d", "2d", "1d_unbatched"])
def test_instance_norm_running_statistics_update_in_instance_order(core, block, kind):
    # reliability #102: the per-instance fallback updated them in group order
    torch.manual_seed(6)
    cls = nn.InstanceNorm2d if kind == "2d" else nn.InstanceNorm1d
    ine = cls(3, affine=True, track_running_stats=True, momentum=0.3)
    inb = copy.deepcopy(ine)
    fb = static_block(inb) if block else inb
    if kind == "2d":
        xs = [torch.randn(2, 3, 4, n) + 3 * i for i, n in enumerate((5, 4, 5))]
    elif kind == "1d":
        xs = [torch.randn(2, 3, n) + 3 * i for i, n in enumerate((5, 4, 5))]
    else:
        xs = [torch.randn(3, n) + 3 * i for i, n in enumerate((5, 4, 5))]
    assert_matches_eager(lambda x: torch.tanh(fb(x) * 2), xs, list(inb.parameters()), core=core)
    # (assert_matches_eager ran the batched call first, then eager on inb: compare with eager twice)
    [ine(x) for x in xs]
    [ine(x) for x in xs]
    torch.testing.assert_close(inb.running_mean, ine.running_mean)
    torch.testing.assert_close(inb.running_var, ine.running_var)


# -- saved_tensors_hooks (reliability #162) -------------------------------------------------------

def _pack(t):
    return t * 2


def _unpack(t):
    return t / 2 + 0.1  # changes what backward reads: a hook applied at other times shows


def _assert_same_gradients(out, ref, wrt):
    """Gradients of the summed batched outputs and of the summed eager ones w.r.t. ``wrt`` agree."""
    gb = torch.autograd.grad(sum(out), wrt)
    ge = torch.autograd.grad(sum(ref), wrt)
    for a, b in zip(gb, ge):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _top_saved_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@pytest.mark.parametrize("core", CORES)
def test_saved_tensors_hooks_inside_instance_code_is_a_clear_error(core):
    from batchcraft.errors import AutobatchError

    lin = nn.Linear(4, 4)

    def fn(x):
        h = torch.sigmoid(x)
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            return (torch.tanh(lin(h)) * h).sum()

    xs = [torch.randn(4, requires_grad=True) for _ in range(3)]
    with pytest.raises(AutobatchError, match="saved_tensors_hooks entered inside"):
        autobatch(fn, core=core)(xs)
    assert _top_saved_hooks() is None  # nothing left pushed
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):  # torch's class is torch's again
        y = (torch.randn(3, requires_grad=True) * 2).sum()
    assert y.requires_grad


@pytest.mark.parametrize("core", CORES)
def test_saved_tensors_hooks_around_the_call_match_eager(core):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    fn = lambda x: (torch.tanh(lin(torch.sigmoid(x))) * x).sum()  # noqa: E731
    xs = [torch.randn(4, requires_grad=True) for _ in range(5)]
    f = autobatch(fn, core=core)
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        ref = [fn(x) for x in xs]
        out = f(xs)
    _assert_same_gradients(out, ref, [lin.weight] + xs)


@pytest.mark.parametrize("core", CORES)
def test_torchs_own_saved_tensor_hooks_still_work_inside_instance_code(core):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def fn(x):
        y = checkpoint(lambda a: torch.tanh(lin(a)), x, use_reentrant=False)
        with torch.autograd.graph.save_on_cpu():
            return (y * torch.sigmoid(x)).sum()

    xs = [torch.randn(4, requires_grad=True) for _ in range(4)]
    out = autobatch(fn, core=core)(xs)
    ref = [fn(x) for x in xs]
    _assert_same_gradients(out, ref, [lin.weight] + xs)


@pytest.mark.parametrize("core", CORES)
def test_a_users_subclass_of_saved_tensors_hooks_is_refused_too(core):
    from batchcraft.errors import AutobatchError

    class Bf16Saved(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self):
            super().__init__(lambda t: t.to(torch.bfloat16), lambda t: t.float())

    def fn(x):
        with Bf16Saved():
            return (torch.tanh(x) * x).sum()

    with pytest.raises(AutobatchError, match="saved_tensors_hooks entered inside"):
        autobatch(fn, core=core)([torch.randn(4, requires_grad=True) for _ in range(3)])
    assert _top_saved_hooks() is None


@pytest.mark.parametrize("core", CORES)
def test_a_users_dispatch_mode_inside_instance_code_is_refused(core):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from batchcraft.errors import AutobatchError

    class PlusOne(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out + 1 if func is torch.ops.aten.tanh.default else out

    def fn(x):
        with PlusOne():
            return torch.tanh(x) * 2

    with pytest.raises(AutobatchError, match=r"TorchDispatchMode \(PlusOne\) entered inside"):
        autobatch(fn, core=core)([torch.randn(4) for _ in range(3)])
    assert torch._C._len_torch_dispatch_stack() == 0

    def counted(x):  # torch's own modes are let through (they see the batched work)
        with FlopCounterMode(display=False):
            return torch.tanh(x) * 2

    xs = [torch.randn(4) for _ in range(3)]
    for o, x in zip(autobatch(counted, core=core)(xs), xs):
        torch.testing.assert_close(o, torch.tanh(x) * 2)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("order", ["jvp_then_dual", "dual_then_jvp"])
def test_signatures_recorded_under_a_transform_do_not_leak_out_of_it(core, order):
    # reliability #190 (hostile helper, stop 39; present before): inside torch.func.jvp eager's
    # lin(x) does not require grad although the weight does; the signature recorded there said
    # so, and a later call under a dual level reused it: every tangent came back None
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(1)

    @static_block
    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    cell = Cell()

    def fn(x):
        return cell(cell(x))

    f = autobatch(fn, core=core)
    xs = [torch.randn(4) for _ in range(3)]
    ts = [torch.randn(4) for _ in range(3)]

    def jvp():
        _, got = torch.func.jvp(lambda *a: tuple(f(list(a))), tuple(xs), tuple(ts))
        _, ref = torch.func.jvp(lambda *a: tuple(fn(x) for x in a), tuple(xs), tuple(ts))
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r)

    def dual():
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in zip(xs, ts)]
            got, ref = f(duals), [fn(d) for d in duals]
            for g, r in zip(got, ref):
                (pg, tg), (pr, tr) = fwAD.unpack_dual(g), fwAD.unpack_dual(r)
                assert tg is not None
                torch.testing.assert_close(tg, tr)
                torch.testing.assert_close(pg, pr)
                assert g.requires_grad == r.requires_grad

    steps = [jvp, dual, jvp] if order == "jvp_then_dual" else [dual, jvp, dual]
    for step in steps:
        step()


@pytest.mark.parametrize("core", CORES)
def test_setting_a_shared_tensors_grad_to_a_per_instance_value_sets_it(core):
    # hostile helper, stop 40 (present before): ``W.grad = torch.zeros(3, 3)`` inside instance
    # code was recorded as an operation that nothing read, so it never ran: W.grad stayed None
    W = nn.Parameter(torch.randn(3, 3))

    def fn(x):
        W.grad = torch.ones(3, 3) * x[0]  # a per-instance value: eager keeps the last instance's
        return x @ W.T

    xs = [torch.randn(3) for _ in range(2)]
    out = autobatch(fn, core=core)(xs)
    got = W.grad
    W.grad = None
    ref = [fn(x) for x in xs]
    torch.testing.assert_close(got, W.grad)
    assert got._base is None  # a tensor of its own, not a row of a batched buffer
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("core", CORES)
def test_a_concurrent_plain_call_does_not_reuse_a_transformed_calls_signatures(core):
    # reliability #195 (hostile helper, stop 40): while one thread's autobatched call ran under
    # torch.func.jvp (its signatures: lin(x) does not require grad), another thread's plain call of
    # the same function reused them: outputs without grad_fn, no gradient for the weight
    import threading

    torch.manual_seed(2)
    lin = nn.Linear(4, 4)
    inside, resume = threading.Event(), threading.Event()
    worker: list = []

    def fn(x):
        y = torch.tanh(lin(x))
        if worker and threading.current_thread() is worker[0] and not inside.is_set():
            inside.set()  # the transformed call has recorded lin(x) and tanh: the other thread runs now
            assert resume.wait(30)
        return lin(y) * 2

    xs = [torch.randn(4) for _ in range(3)]
    ts = [torch.randn(4) for _ in range(3)]
    errors: list = []

    def transformed():
        try:
            _, got = torch.func.jvp(lambda *a: tuple(autobatch(fn, core=core)(list(a))), tuple(xs), tuple(ts))
            _, ref = torch.func.jvp(lambda *a: tuple(fn(x) for x in a), tuple(xs), tuple(ts))
            for g, r in zip(got, ref):
                torch.testing.assert_close(g, r)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)
        finally:
            inside.set()

    t = threading.Thread(target=transformed)
    worker.append(t)
    t.start()
    try:
        assert inside.wait(30)
        out = autobatch(fn, core=core)(xs)  # plain, while the transformed call waits
        ref = [fn(x) for x in xs]
    finally:
        resume.set()
        t.join(60)
    assert not errors, errors
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
        assert o.requires_grad and o.grad_fn is not None
    g = torch.autograd.grad(sum(o.sum() for o in out), lin.weight)[0]
    g_ref = torch.autograd.grad(sum(r.sum() for r in ref), lin.weight)[0]
    torch.testing.assert_close(g, g_ref)


def _leaf_made(x, w):
    t = (x * 2).detach().requires_grad_()  # (truncated backpropagation: a new leaf)
    return t, (t * w).sum()


def _leaf_written_under_no_grad(x, w):
    t = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    with torch.no_grad():
        t.add_(x)
    return t, (t * w).sum()


def _leaf_written_through_data(x, w):
    t = torch.ones(4, requires_grad=True)
    t.data.mul_(x)
    return t, (t * w).sum()


def _made_leaf_written(x, w):
    t = (x * 1).requires_grad_()
    with torch.no_grad():
        t.mul_(3)
    return t, (t * w).sum() + t.sum()


def _leaf_copied_from_an_input(x, w):
    # (reliability #294: the copy was a view of x, which kept x's history under no_grad)
    t = torch.zeros(4, requires_grad=True)
    with torch.no_grad():
        t.copy_(x)
    return t, (t * w).sum()


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("fn", [_leaf_made, _leaf_written_under_no_grad, _leaf_written_through_data,
                                _made_leaf_written, _leaf_copied_from_an_input],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_leaf_made_or_written_in_instance_code_comes_back_a_leaf_with_its_grad(core, fn):
    # reliability #260 and #273: the returned value was a row of a batched tensor, not a leaf,
    # and its .grad stayed None after backward (eager: a leaf with its gradient)
    w = torch.randn(4, requires_grad=True)
    xs = [torch.randn(4, requires_grad=fn is _leaf_copied_from_an_input) for _ in range(2)]

    def run(outs):
        sum(loss for _, loss in outs).backward()
        got = [(t.is_leaf, t.requires_grad, t.detach().clone(), t.grad) for t, _ in outs]
        wg, w.grad = w.grad, None
        return got, wg

    eager, eager_w = run([fn(x, w) for x in xs])
    batched, batched_w = run(autobatch(lambda x: fn(x, w), core=core)(xs))
    torch.testing.assert_close(batched_w, eager_w)
    for (leaf, rg, v, g), (eleaf, erg, ev, eg) in zip(batched, eager):
        assert (leaf, rg) == (eleaf, erg) == (True, True)
        torch.testing.assert_close(v, ev)
        torch.testing.assert_close(g, eg)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("when", ["before-the-flush", "after-a-wait"])
def test_a_hook_on_a_made_leaf_changes_its_grad_as_in_eager(core, when):
    # reliability #297: the hook was applied to the stacked rows, after the leaf's .grad had
    # accumulated (eager: hooks on a leaf run before it accumulates)
    def fn(x):
        t = x.detach().requires_grad_()
        loss = (t * t).sum()
        if when == "after-a-wait" and loss > -1:  # (a wait: the leaf exists when the hook comes)
            pass
        t.register_hook(lambda g: g * 10)
        return t, loss

    xs = [torch.randn(3), torch.randn(3)]
    eager = [fn(x) for x in xs]
    sum(loss for _, loss in eager).backward()
    out = autobatch(fn, core=core)(xs)
    sum(loss for _, loss in out).backward()
    for (t, _), (e, _) in zip(out, eager):
        torch.testing.assert_close(t.grad, e.grad)


class _ClipOld(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 1)


class _ClipNew(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.clamp(-1, 1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 1)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("fn_cls", [_ClipOld, _ClipNew])
def test_custom_functions_match_eager_and_say_why_they_run_per_instance(core, fn_cls):
    # a new user's report (stop 51): the reason repeated the name and quoted functorch's error
    torch.manual_seed(0)
    lin = nn.Linear(5, 5)
    xs = [torch.randn(5) * 2 for _ in range(6)]
    f = autobatch(lambda x: fn_cls.apply(lin(x)), core=core)
    out = f(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, fn_cls.apply(lin(x)))
    sum(o.sum() for o in out).backward()
    g_batched = lin.weight.grad.clone()
    lin.weight.grad = None
    sum(fn_cls.apply(lin(x)).sum() for x in xs).backward()
    torch.testing.assert_close(g_batched, lin.weight.grad)
    reasons = list(f.stats.fallback_reasons)
    if fn_cls is _ClipOld:
        assert len(reasons) == 1 and reasons[0].startswith("_ClipOld.apply: a custom autograd.Function without "
                                                           "setup_context")
        assert reasons[0].count("_ClipOld.apply") == 1
    else:
        assert not reasons  # batched by its vmap rule
