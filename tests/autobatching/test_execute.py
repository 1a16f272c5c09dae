"""Execution details: gathers from several sources, output arenas, flushes mid-recording."""

from __future__ import annotations

import pytest
import torch

from batchcraft import autobatch, static_block

from equivalence import assert_matches_eager


def _children_program(cell):
    def fn(inst):
        x, n_children = inst
        hs = [torch.tanh(x * (j + 1)) for j in range(n_children)]
        return cell(x, hs)
    return fn


@static_block
def _sum_cell(x, hs):
    if hs:
        return x + torch.stack(hs, dim=-2).sum(-2)
    return x * 2


@pytest.mark.parametrize("grad", [False, True])
def test_list_arguments_of_mixed_sources_equal_eager(grad):
    torch.manual_seed(0)
    insts = [(torch.randn(5, requires_grad=grad), k) for k in (0, 1, 2, 3, 2, 3, 1, 0, 3)]
    with torch.set_grad_enabled(grad):
        assert_matches_eager(_children_program(_sum_cell), insts, [x for x, _ in insts])


def test_outputs_of_groups_of_one_kind_share_an_arena_in_inference():
    lin = torch.nn.Linear(6, 6)

    @static_block
    def step(h):
        return torch.tanh(lin(h))

    def fn(inst):
        h, n = inst
        for _ in range(n):
            h = step(h)
        return h

    torch.manual_seed(1)
    insts = [(torch.randn(6), n) for n in (1, 3, 2, 3, 1)]
    f = autobatch(fn)
    with torch.no_grad():
        out = f(insts)
        ref = [fn(x) for x in insts]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    # the three depths of `step` wrote into one buffer: every output is a row of the same tensor
    bases = {o.untyped_storage().data_ptr() for o in out}
    assert len(bases) == 1


def test_no_arena_when_autograd_records():
    lin = torch.nn.Linear(6, 6)

    @static_block
    def step(h):
        return torch.tanh(lin(h))

    def fn(inst):
        h, n = inst
        for _ in range(n):
            h = step(h)
        return h

    insts = [(torch.randn(6), n) for n in (1, 3, 2, 3, 1)]
    out = autobatch(fn)(insts)  # grad on: each group keeps its own output tensor
    bases = {o.untyped_storage().data_ptr() for o in out}
    assert len(bases) == 3  # one per depth reached by some instance's last step
    for o, x in zip(out, insts):
        torch.testing.assert_close(o, fn(x))



def test_arena_keeps_eager_layout_so_view_works_as_in_eager():
    """Break-it report A: copying a non-contiguous result into an arena changed its strides, so a
    later ``.view()`` that works eagerly failed."""

    def fn(x):  # x: (2, 3)
        a = x.t() * 2  # non-contiguous, as in eager
        b = a.t() * 2  # contiguous in eager: a.t() is
        c = b.t() * 2  # same op and output shape as `a`: would share an arena with it
        return b.view(-1), c

    torch.manual_seed(3)
    xs = [torch.randn(2, 3) for _ in range(4)]
    with torch.no_grad():
        out = autobatch(fn)(xs)
        for (b, c), x in zip(out, xs):
            rb, rc = fn(x)
            torch.testing.assert_close(b, rb)
            torch.testing.assert_close(c, rc)
            assert c.stride() == rc.stride()


def test_outputs_that_alias_in_eager_are_equal_and_editing_one_instance_leaves_the_others():
    """Break-it report B. Eager's ``(a, a.t(), a[0])`` share memory; batched, ``a.t()`` and ``a[0]``
    are computed from a gathered copy of ``a`` when its rows come from several groups (with or
    without arenas), so they come back equal but separate (README, differences from eager). What
    must hold: equal values, and an in-place edit of one instance's output changes no other
    instance's outputs."""

    def fn(inst):
        x, n = inst
        a = x
        for _ in range(n):
            a = torch.tanh(a)
        return a, a.t(), a[0]

    torch.manual_seed(4)
    insts = [(torch.randn(3, 3), n) for n in (1, 2, 3, 1, 2, 3)]
    with torch.no_grad():
        out = autobatch(fn)(insts)
        for o, inst in zip(out, insts):
            for t, r in zip(o, fn(inst)):
                torch.testing.assert_close(t, r)
        before = [[t.clone() for t in o] for o in out]
        for t in out[0]:
            t.add_(1)
        for o, b in zip(out[1:], before[1:]):
            assert all(torch.equal(t, u) for t, u in zip(o, b))


W3 = torch.randn(3)


@pytest.mark.parametrize("make, expected", [
    (lambda v: torch.tensor(v, dtype=torch.float64) * W3, torch.float32),
    (lambda v: torch.tensor(int(v)) * torch.ones(3, dtype=torch.int32), torch.int32),
    (lambda v: (torch.tensor(v, dtype=torch.float64) * W3) @ torch.eye(3), torch.float32),
])
def test_zero_dim_per_instance_values_promote_like_eager(make, expected):
    """Break-it report C: a batched 0-dim argument counted as a dimensioned tensor in type promotion
    (float64 instead of float32); the executor now checks output dtypes and falls back."""
    xs = [1.5, 2.5, -0.5]
    out = autobatch(make)(xs)
    for o, v in zip(out, xs):
        ref = make(v)
        assert o.dtype == ref.dtype == expected
        torch.testing.assert_close(o, ref)
