"""In-place writes inside instance code are functionalised: values and gradients equal eager.

Issue 15 item 2. Writes into tensors the instance created or received work (``y[i] = v``,
``y[mask] = 0``, ``index_put_``, ``add_``, ``copy_``, ``clamp_``, ``+=``, in-place activations,
writes through views); a write into a *shared* tensor (a parameter, a captured tensor) with
per-instance values is a clear error that changes nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

from batchcraft import autobatch
from batchcraft.errors import InstanceError, UnsupportedOperationError

from equivalence import assert_matches_eager, check_inputs_against_eager

from equivalence import CORES  # noqa: E402
torch.manual_seed(0)
LIN = nn.Linear(4, 4)
PARAMS = list(LIN.parameters())


def _programs():
    def created(x):
        y = torch.zeros(6)
        for i in range(4):
            y[i] = x[i] * 2          # y[i] = v on a tensor the instance created
        y[y > 1] = 0.5               # boolean-mask write
        return LIN(y[:4]) + y[4:].sum()

    def received(x):
        h = LIN(x)
        h.add_(1).mul_(x)            # chained in-place methods on a computed value
        h.clamp_(min=-0.5)
        h += x                       # augmented assignment
        F.relu(h, inplace=True)
        return h

    def index_put(x):
        y = x.clone()
        y.index_put_((torch.tensor([0, 2]),), torch.tensor([9.0, -9.0]))
        z = torch.empty(4).copy_(y)
        z.masked_fill_(z < 0, 0.0)
        return LIN(z)

    def through_views(x):
        m = LIN(x).reshape(2, 2).clone()
        row = m[0]                   # a view of m
        row.mul_(3)                  # writes into m
        m.t()[1].add_(1)            # through a transposed view: m[:, 1]
        col = m.select(1, 0)
        col.sub_(x[:2])
        return m, row

    def loop_acc(x):
        acc = torch.zeros(4)
        for t in range(int(x.abs().sum().item() * 2) % 4 + 1):   # waits for a value
            acc.add_(LIN(x) * (t + 1))
        return acc

    return {"created": created, "received": received, "index_put": index_put, "through_views": through_views,
            "loop_acc": loop_acc}


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", sorted(_programs()))
def test_inplace_programs_match_eager(name, core):
    fn = _programs()[name]
    xs = [torch.randn(4) for _ in range(5)]
    assert_matches_eager(fn, xs, PARAMS, core=core)


@pytest.mark.parametrize("core", CORES)
def test_inplace_update_of_an_input_is_copied_back_as_eager_does(core):
    def fn(x):
        x.mul_(2)
        x[0] = -1.0
        return x.sum()

    xs = [torch.randn(3) for _ in range(4)]
    ys = [x.clone() for x in xs]
    out = autobatch(fn, core=core)(xs)
    ref = [fn(y) for y in ys]
    for o, r, x, y in zip(out, ref, xs, ys):
        torch.testing.assert_close(o, r)
        torch.testing.assert_close(x, y)  # the caller's tensors changed exactly as in eager


@pytest.mark.parametrize("core", CORES)
def test_inplace_on_a_leaf_that_requires_grad_fails_as_in_eager(core):
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x.add_(1)
    with pytest.raises(Exception, match="leaf Variable that requires grad"):
        autobatch(lambda v: v.add_(1), core=core)([x])


@pytest.mark.parametrize("core", CORES)
def test_writes_into_shared_tensors_are_refused_and_change_nothing(core):
    captured = torch.zeros(4)
    w_before = LIN.weight.detach().clone()

    for fn in (lambda x: captured.add_(x), lambda x: captured.copy_(x), lambda x: LIN.weight.data[0].add_(x),
               lambda x: captured.__setitem__(0, x[0])):
        with pytest.raises(UnsupportedOperationError, match="shared tensor"):
            autobatch(fn, core=core)([torch.randn(4), torch.randn(4)])
    assert torch.equal(captured, torch.zeros(4))
    assert torch.equal(LIN.weight.detach(), w_before)


@pytest.mark.parametrize("core", CORES)
def test_inplace_dtype_and_shape_rules_are_eager_s(core):
    with pytest.raises(Exception, match="can't be cast"):
        autobatch(lambda x: torch.zeros(3, dtype=torch.long).add_(x), core=core)([torch.randn(3)])
    with pytest.raises(Exception, match="doesn't match the broadcast shape"):
        autobatch(lambda x: torch.zeros(3).add_(x), core=core)([torch.randn(2, 3)])


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["set", "mask", "add_", "mul_", "clamp_", "iadd", "view_add"]),
                              st.integers(0, 3), st.floats(-2, 2, allow_nan=False)), min_size=1, max_size=6),
       n=st.integers(1, 5), core=st.sampled_from(CORES))
def test_random_inplace_sequences_match_eager(ops, n, core):
    def fn(x):
        y = LIN(x)
        for op, i, c in ops:
            if op == "set":
                y[i] = c
            elif op == "mask":
                y[y > c] = c
            elif op == "add_":
                y.add_(c)
            elif op == "mul_":
                y.mul_(x)
            elif op == "clamp_":
                y.clamp_(max=abs(c) + 0.1)
            elif op == "iadd":
                y += x * c
            else:
                y[i:].add_(c)
        return y

    xs = [torch.randn(4) for _ in range(n)]
    assert_matches_eager(fn, xs, PARAMS, core=core)


@pytest.mark.parametrize("core", CORES)
def test_a_shared_write_after_a_recorded_read_matches_eager(core):
    # bug #44: the write ran at once, before the read recorded earlier executed
    w = torch.randn(4, 4)
    w0 = w.clone()

    def fn(x):
        y = x @ w
        w.add_(1.0)  # eager: the next instance reads the updated w
        return y

    xs = [torch.randn(4) for _ in range(3)]
    ref = [fn(x) for x in xs]
    w_after = w.clone()
    w.copy_(w0)
    out = autobatch(fn, core=core)(xs)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    assert torch.equal(w, w_after)


@pytest.mark.parametrize("core", CORES)
def test_a_counter_that_nothing_reads_costs_no_sync(core):
    # train-mode BatchNorm's num_batches_tracked.add_(1) runs at once per instance, as in eager;
    # no recorded operation reads it, so it must not run pending work early
    torch.manual_seed(0)
    bn, lin = nn.BatchNorm1d(4), nn.Linear(4, 4)
    f = autobatch(lambda x: bn(lin(x).unsqueeze(0).expand(3, 4) * torch.arange(1.0, 4.0).unsqueeze(1)), core=core)
    f([torch.randn(4) for _ in range(5)])
    assert f.stats.syncs == 0 and int(bn.num_batches_tracked) == 5


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("how", ["clamp", "setitem", "read_after_write", "per_instance_write"])
def test_detach_of_a_shared_tensor_aliases_it_as_in_eager(core, how):
    # a hostile helper (stop 33, present before): `w.detach()` inside instance code became a
    # per-instance copy, so writes through it were lost (weight clipping) and a read recorded
    # before a write of the shared tensor saw the written value
    xs = [torch.ones(2) * (i + 1) for i in range(3)]

    def make(w):
        def fn(x):
            t = w.detach()
            if how == "clamp":
                t.clamp_(-1.0, 1.0)
            elif how == "setitem":
                t[0, 0] = 0.0
            elif how == "per_instance_write":
                t[0].add_(x)
            y1 = x @ t
            w.data.mul_(2.0)  # no per-instance value: runs at once, as in eager
            return y1, x @ t
        return fn

    w_e = torch.tensor([[1.0, -3.0], [3.0, 4.0]])
    w_b = w_e.clone()
    if how == "per_instance_write":
        with pytest.raises(UnsupportedOperationError, match="shared tensor"):
            autobatch(make(w_b), core=core)(xs)
        return
    ref = [make(w_e)(x) for x in xs]
    out = autobatch(make(w_b), core=core)(xs)
    torch.testing.assert_close(w_b, w_e)
    for (a1, a2), (b1, b2) in zip(out, ref):
        torch.testing.assert_close(a1, b1)
        torch.testing.assert_close(a2, b2)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("grad", [False, True])
def test_writes_through_a_detached_alias_of_a_value_reach_it(core, grad):
    # reliability #95: ``y.detach()`` of a per-instance value was a copy, so a write through it
    # (``a.add_(1)``) did not reach ``y``; with grad, ``y`` keeps its autograd history as in eager
    lin = nn.Linear(3, 3)

    def fn(x):
        y = lin(x) * 1.5
        a = y.detach()
        a.add_(1)
        b = y.detach()[1:]
        b.mul_(2)
        return y * x, a, b.requires_grad

    xs = [torch.randn(3, requires_grad=grad) for _ in range(3)]
    params = list(lin.parameters()) + (xs if grad else [])
    assert_matches_eager(lambda x: fn(x)[:2], xs, params, core=core)
    for o, x in zip(autobatch(fn, core=core)(xs), xs):
        assert o[2] is fn(x)[2] is False


@pytest.mark.parametrize("core", CORES)
def test_copy_and_deepcopy_of_values_follow_the_tensor_protocol(core):
    # reliability #67: copy.copy / copy.deepcopy of a lazy value raised "cannot pickle"
    import copy

    def fn(x):
        y = x * 2.0
        shallow = copy.copy(y)   # an alias of y's storage, a leaf with y's requires_grad
        deep = copy.deepcopy(x)  # a new leaf: its own storage
        with torch.no_grad():     # (outside no_grad refused for leaves that require grad: #96)
            shallow.add_(1)       # reaches y, as in eager
            deep.mul_(3)          # does not reach x
        pair = copy.deepcopy([x, x])
        return y, deep, x, pair[0] is pair[1], shallow.requires_grad, shallow.is_leaf, deep.requires_grad

    for rg in (False, True):
        xs = [torch.randn(3, requires_grad=rg) for _ in range(3)]
        out = autobatch(fn, core=core)([x.detach().clone().requires_grad_(rg) for x in xs])
        for o, x in zip(out, xs):
            r = fn(x.detach().clone().requires_grad_(rg))
            for a, b in zip(o[:3], r[:3]):
                torch.testing.assert_close(a, b)
            assert o[3:] == r[3:]

    def refused(x):
        return copy.deepcopy(x * 2)  # a value with autograd history: refused, as in eager

    with pytest.raises(Exception, match="graph leaves"):
        autobatch(refused, core=core)([torch.randn(3, requires_grad=True)])


@pytest.mark.parametrize("core", CORES)
def test_in_place_update_of_an_input_leaf_under_no_grad(core):
    # reliability #96 (found at stop 34, fixed at stop 35): eager allows this under no_grad
    def fn(x):
        with torch.no_grad():
            x.mul_(3)  # x stays a leaf that requires grad, its values change
        return x * 2, x.requires_grad, x.is_leaf

    xs = [torch.randn(3, requires_grad=True) for _ in range(2)]
    out = autobatch(fn, core=core)([x.detach().clone().requires_grad_() for x in xs])
    for o, x in zip(out, xs):
        r = fn(x.detach().clone().requires_grad_())
        torch.testing.assert_close(o[0], r[0])
        assert o[1:] == r[1:]
    check_inputs_against_eager(fn, [torch.randn(3, requires_grad=True) for _ in range(3)], core)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("op", ["mul_", "add_instance", "setitem", "copy_", "zero_", "twice", "then_data",
                                "inference_mode", "view_write", "relu_inplace"])
def test_in_place_writes_of_input_leaves_under_no_grad_match_eager(core, op):
    # reliability #96: values, flags, the caller's tensors after the call and gradients as eager
    v = nn.Parameter(torch.randn(3))

    def fn(x):
        y = x + v  # recorded before the write: reads x's old value (and saves nothing: a product
        # saving x would make eager's backward raise after the write, batched not: #83, #120)
        ctx = torch.inference_mode() if op == "inference_mode" else torch.no_grad()
        with ctx:
            if op in ("mul_", "inference_mode"):
                x.mul_(3)
            elif op == "add_instance":
                x.add_(x.detach() * 0.5 + 1)
            elif op == "setitem":
                x[0] = 5.0
            elif op == "copy_":
                x.copy_(torch.ones(3) * 7)
            elif op == "zero_":
                x.zero_()
            elif op == "twice":
                x.mul_(2)
                x.sub_(1)
            elif op == "then_data":
                x.mul_(2)
        if op == "then_data":
            x.data.add_(1)
        if op == "view_write":
            with torch.no_grad():
                x[1:].mul_(4)  # a view of a leaf: written through its base
        if op == "relu_inplace":
            with torch.no_grad():
                F.relu(x, inplace=True)
        return x * v + y, x.requires_grad, x.is_leaf, x.grad_fn is None

    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    check_inputs_against_eager(fn, xs, core, [v])


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("case", ["enable_grad", "after_no_grad", "setitem", "made_leaf", "copy_alias",
                                  "enable_grad_copy_alias", "view_of_leaf"])
def test_in_place_writes_of_leaves_with_grad_mode_on_still_fail_as_in_eager(core, case):
    # the counterpart of #96's fix: with grad mode on, eager refuses an in-place update of a leaf
    # that requires grad (also after a write under no_grad, also for values given
    # requires_grad_() and copy.copy of a value that requires grad); batched refuses it too
    import copy

    def fn(x):
        if case == "enable_grad":
            with torch.no_grad():
                with torch.enable_grad():
                    x.mul_(3)
        elif case == "after_no_grad":
            with torch.no_grad():
                x.mul_(3)
            x.add_(1)
        elif case == "setitem":
            with torch.enable_grad():
                x[0] = 1.0
        elif case == "made_leaf":
            y = x.detach() * 2
            y.requires_grad_()
            y.add_(1)  # before this fix batched accepted it
        elif case == "copy_alias":
            copy.copy(x * 2).add_(1)
        elif case == "view_of_leaf":
            x[1:].mul_(4)  # eager: "a view of a leaf Variable ..."; before this fix batched accepted it
        else:
            y = x * 2
            with torch.no_grad():
                s = copy.copy(y)
            with torch.enable_grad():
                s.mul_(2)
        return x * 1

    xs = [torch.randn(3, requires_grad=True) for _ in range(2)]
    xe = [x.detach().clone().requires_grad_() for x in xs]
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        for x in xe:
            fn(x)
    with pytest.raises(Exception, match="leaf Variable that requires grad"):
        autobatch(fn, core=core)(xs)
    # the caller's tensors are eager's: the failing instance's write under no_grad before its
    # error stays ("after_no_grad", reliability #229's fix), nothing else changed
    for x, e in zip(xs, xe):
        assert torch.equal(x.detach(), e.detach()) and x.requires_grad and x.is_leaf and x.grad is None


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("case", ["copy_of_value", "copy_of_input", "setitem_copy", "made_view_leaf"])
def test_writes_through_copy_copy_and_made_leaves_under_no_grad_match_eager(core, case):
    # reliability #96, its copy.copy part: ``copy.copy(y)`` of a value that requires grad is a
    # leaf of its own that shares y's values; written under no_grad it reaches y (y keeps its
    # graph) and stays a leaf that requires grad
    import copy

    v = nn.Parameter(torch.randn(3))

    def fn(x):
        # (y saves v, not x: a product saving x, then x written through an alias that eager's
        # version counter does not see, is #120's documented difference)
        y = v * 2.0 + x
        if case == "copy_of_value":
            s = copy.copy(y)
            with torch.no_grad():
                s.add_(1)
            return y * 2, s * 1, s.requires_grad, s.is_leaf, y.requires_grad, y.is_leaf
        if case == "copy_of_input":
            s = copy.copy(x)
            with torch.no_grad():
                s.mul_(3)  # reaches the caller's x
            return y + x * v, s.requires_grad, s.is_leaf, x.requires_grad, x.is_leaf
        if case == "setitem_copy":
            s = copy.copy(y)
            with torch.no_grad():
                s[1] = 4.0
            return y * y, s * 1, s.is_leaf
        # a view of a value that does not require grad, given requires_grad_(): a leaf that
        # shares its base's values (before this fix, a later write of the base made it the
        # whole base: wrong shape and values)
        b = x.detach() * 2
        w = b[1]
        w.requires_grad_()
        b.add_(1)  # w follows
        with torch.no_grad():
            w.mul_(3)  # b follows, still without grad
        return y + b, w * v, w.requires_grad, w.is_leaf, b.requires_grad

    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    check_inputs_against_eager(fn, xs, core, [v])


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("case", ["add_then_mul", "two_aliases", "copy_then_base_write", "view_of_detached"])
def test_writes_with_autograd_history_through_detached_aliases_match_eager(core, case):
    # a hostile helper's find on the #95 fix: ``a = y.detach(); a.add_(w)`` lost a's history
    # (w's gradient 12 against eager's 20) and gave y a path to w
    torch.manual_seed(0)
    w, v = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))

    def fn(x):
        y = x * v
        if case == "add_then_mul":
            a = y.detach()
            a.add_(w)
            a.mul_(2)
            y.add_(1)  # changes a's value, not its history
            return y * 3 + a * 5, a.requires_grad
        if case == "two_aliases":
            a = y.detach()
            a.mul_(w)
            b = y.detach()
            return y * 3 + a * 5 + b * 7, b.requires_grad
        if case == "copy_then_base_write":
            a = y.detach()
            a.copy_(w * x)
            y.mul_(2)
            return a * y, a.requires_grad
        y = y.detach()
        a = y[1:]
        a.mul_(w[1:])
        return y * 2, y.requires_grad

    xs = [torch.randn(3) for _ in range(4)]
    assert_matches_eager(lambda x: fn(x)[0], xs, [w, v], core=core)
    out = autobatch(fn, core=core)(xs)
    assert [o[1] for o in out] == [fn(x)[1] for x in xs]


@pytest.mark.parametrize("core", CORES)
def test_writes_through_data_reach_the_value_and_the_callers_input(core):
    # a hostile helper's find (stop 34): ``y.data.add_(1)`` was dropped silently; an input's
    # ``x.data`` write must reach the caller's tensor (a leaf that requires grad) as in eager
    w = nn.Parameter(torch.randn(3))

    def fn(x):
        x.data.mul_(2)
        y = x + w
        y.data.add_(1)
        return y * x  # (a .data write after a tensor was saved for backward is #83's case)

    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    xe = [x.detach().clone().requires_grad_() for x in xs]
    out = autobatch(fn, core=core)(xs)
    ref = [fn(x) for x in xe]
    for o, r, a, b in zip(out, ref, xs, xe):
        torch.testing.assert_close(o, r)
        torch.testing.assert_close(a, b)  # the caller's inputs were written
    sum(o.sum() for o in out).backward()
    gw = w.grad.clone()
    w.grad = None
    sum(r.sum() for r in ref).backward()
    torch.testing.assert_close(gw, w.grad)
    for a, b in zip(xs, xe):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("core", CORES)
def test_deepcopy_of_a_value_and_its_view_keeps_them_sharing_storage(core):
    # a hostile helper's find (stop 34): copies of ``[y, y[1:]]`` were separate tensors
    import copy

    def fn(x):
        y = x * 1.0
        a, b = copy.deepcopy([y, y[1:]])
        a.add_(1)  # shows in b, as in eager
        return b, y

    xs = [torch.zeros(3) for _ in range(2)]
    for o, x in zip(autobatch(fn, core=core)(xs), xs):
        for p, q in zip(o, fn(x)):
            torch.testing.assert_close(p, q)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("op", ["zero_", "fill_", "copy_"])
def test_overwriting_a_value_that_requires_grad_keeps_it_requiring_grad(core, op):
    # a hostile helper's finds (stop 34, third pass): ``y.copy_(c)`` / ``zero_`` / ``fill_`` on a
    # value that requires grad dropped requires_grad (eager keeps it, with a zero gradient), and
    # the same on a detached alias that had history kept the old history (w.grad 6 against 0)
    w, v = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))

    def overwrite(t, x):
        if op == "zero_":
            return t.zero_()
        if op == "fill_":
            return t.fill_(2.0)
        return t.copy_(x * 5)

    def fn(x):
        y = x * v
        overwrite(y, x)
        a = (x * 2).detach()
        a.add_(w)
        overwrite(a, x)
        return y * 3 + a * 2 + x, y.requires_grad, a.requires_grad

    xs = [torch.randn(3) for _ in range(3)]
    assert_matches_eager(lambda x: fn(x)[0], xs, [w, v], core=core)
    for o, x in zip(autobatch(fn, core=core)(xs), xs):
        assert o[1:] == fn(x)[1:] == (True, True)


@pytest.mark.parametrize("core", CORES)
def test_an_input_written_through_data_stays_a_leaf(core):
    # a hostile helper's find (stop 34, third pass): after ``x.data.mul_(2)`` instance code saw
    # is_leaf False, and a following ``x.add_(1)`` wrote the caller's leaf where eager raises
    def reads(x):
        x.data.mul_(2)
        x.detach().add_(1)
        return x * 1, x.is_leaf, x.requires_grad

    xs = [torch.randn(3, requires_grad=True) for _ in range(2)]
    xe = [x.detach().clone().requires_grad_() for x in xs]
    for o, x in zip(autobatch(reads, core=core)(xs), xe):
        r = reads(x)
        torch.testing.assert_close(o[0], r[0])
        assert o[1:] == r[1:] == (True, True)

    def writes(x):
        x.data.mul_(2)
        x.add_(1)  # eager: a leaf that requires grad, in place: refused
        return x

    with pytest.raises(RuntimeError, match="leaf Variable"):
        writes(torch.randn(3, requires_grad=True))
    with pytest.raises(Exception, match="leaf Variable"):
        autobatch(writes, core=core)([torch.randn(3, requires_grad=True) for _ in range(2)])


@pytest.mark.parametrize("core", CORES)
def test_inputs_that_are_views_of_a_leaf_are_written_through_data(core):
    # a hostile helper's find (stop 34, third pass): inputs ``big[i]`` (views of a leaf that
    # requires grad) written through ``.data`` raised in the write-back, after the call
    big = torch.ones(3, 3, requires_grad=True)
    big_e = big.detach().clone().requires_grad_()

    def fn(x):
        x.data.mul_(2)
        return x * 3

    out = autobatch(fn, core=core)([big[i] for i in range(3)])
    ref = [fn(big_e[i]) for i in range(3)]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    torch.testing.assert_close(big.detach(), big_e.detach())


@pytest.mark.parametrize("core", CORES)
def test_deepcopy_of_a_detached_alias_of_a_value_with_history(core):
    # a hostile helper's find on this stop's deepcopy (third pass): it copied the base, which is
    # not a leaf, and raised; eager copies the alias
    import copy

    w = nn.Parameter(torch.randn(3))

    def fn(x):
        y = x * w
        return copy.deepcopy(y.detach()) + copy.deepcopy(y.data)

    xs = [torch.randn(3) for _ in range(2)]
    for o, x in zip(autobatch(fn, core=core)(xs), xs):
        torch.testing.assert_close(o, fn(x))


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("op", ["zero_", "copy_", "setitem"])
def test_overwriting_under_no_grad_keeps_the_autograd_graph(core, op):
    # a hostile helper's find (stop 34, fourth pass; present before): under no_grad eager changes
    # y's values and keeps its graph (v.grad flows through it); batched, y stopped requiring grad
    v = nn.Parameter(torch.randn(3))

    def fn(x):
        y = x * v
        with torch.no_grad():
            if op == "zero_":
                y.zero_()
            elif op == "copy_":
                y.copy_(x)
            else:
                y[0] = 1.0
        return y * 2, y.requires_grad

    xs = [torch.randn(3) for _ in range(3)]
    assert_matches_eager(lambda x: fn(x)[0], xs, [v], core=core)
    assert all(o[1] for o in autobatch(fn, core=core)(xs))


@pytest.mark.parametrize("core", CORES)
def test_one_tensor_written_by_two_instances_warns(core):
    # a hostile helper's find (stop 34, fourth pass; present before): eager's writes compound
    # (b * 2 * 2), batched each instance starts from the original value; the call says so
    def fn(x):
        x.mul_(2)
        return x * 1

    b = torch.ones(3)
    with pytest.warns(RuntimeWarning, match="instances 0 and 1 received the same tensor"):
        autobatch(fn, core=core)([b, b])


PERMUTED_WRITES = {
    "t": lambda z, v: z.t().__setitem__((0, 1), v),
    "transpose": lambda z, v: z.transpose(0, 1).__setitem__((2, 0), v),
    "permute": lambda z, v: z.permute(1, 0).mul_(v),
    "movedim": lambda z, v: z.movedim(0, 1).add_(v),
}


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("how", sorted(PERMUTED_WRITES))
@pytest.mark.parametrize("value", ["python", "lazy"])
def test_a_write_through_a_permuting_view_keeps_the_base_contiguous(core, how, value):
    # reliability #259: the base's new value was the inverse permutation of the written view,
    # laid out as that view, and a later z.view(-1) failed ("view size is not compatible")
    lin = nn.Linear(3, 3)

    def fn(i):
        z = torch.zeros(2, 3) if value == "python" else lin(torch.ones(2, 3) * i)
        PERMUTED_WRITES[how](z, i if value == "python" else (lin.bias[0] * i))
        return z.view(-1), z.is_contiguous()

    if value == "python":
        assert_matches_eager(fn, [1, 2], [], core=core)
    else:
        assert_matches_eager(fn, [torch.tensor(1.0), torch.tensor(2.0)], list(lin.parameters()), core=core)


RESIZES = {
    "shrink": lambda y: y.resize_(2),
    "grow-then-fill": lambda y: y.resize_(7).fill_(0.5),
    "same-count": lambda y: y.resize_(2, 2),
    "tuple": lambda y: y.resize_((1, 4)),
    "grow-keeps-first": lambda y: y.resize_(6)[:4],
}


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("how", sorted(RESIZES))
def test_resize_changes_the_number_of_elements_as_eager(core, how):
    # reliability #264: resize_ was recorded as autograd's resize, which keeps the element count
    def fn(x):
        y = x * 2  # (no grad: eager refuses to resize a tensor that requires grad)
        z = torch.zeros(3)
        z.resize_(5)
        return RESIZES[how](y) + 0, z.fill_(1) + x.sum()

    assert_matches_eager(fn, [torch.arange(4.0), torch.arange(4.0) * 3], [], core=core)


@pytest.mark.parametrize("core", CORES)
def test_resize_of_a_value_that_requires_grad_fails_as_eager(core):
    w = torch.ones(4, requires_grad=True)

    def fn(x):
        y = x * w
        y.resize_(2)
        return y

    with pytest.raises(RuntimeError, match="cannot resize variables that require grad"):
        fn(torch.ones(4))
    with pytest.raises(InstanceError, match="cannot resize variables that require grad"):
        autobatch(fn, core=core)([torch.ones(4), torch.ones(4)])


def _resize_view(x):
    y = (x * 2)[1:]
    y.resize_(2)
    return y


def _resize_viewed(x):
    y = x * 2
    v = y[:3]
    y.resize_(2)
    return y, v


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("fn", [_resize_view, _resize_viewed], ids=["a-view", "a-viewed-value"])
def test_resize_of_a_view_and_of_a_viewed_value_as_eager(core, fn):
    # a hostile find (stop 49) on #264's fix: a view resized returned its base's first elements,
    # a view taken before a shrinking resize shrank with it
    assert_matches_eager(fn, [torch.arange(6.0), torch.arange(6.0) + 1], [], core=core)


@pytest.mark.parametrize("core", CORES)
def test_resize_of_an_input_resizes_the_callers_tensor(core):
    # a hostile find (stop 49): a raw RuntimeError at the write-back
    def fn(x):
        x.resize_(3)
        return x * 1

    xs = [torch.arange(6.0), torch.arange(6.0) + 1]
    eager = [fn(x.clone()) for x in xs]
    out = autobatch(fn, core=core)(xs)
    assert all(torch.equal(o, e) for o, e in zip(out, eager))
    assert [x.tolist() for x in xs] == [[0.0, 1.0, 2.0], [1.0, 2.0, 3.0]]


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("how", ["T-setitem", "mT-mul", "H-add"])
def test_writes_through_the_transposing_properties_reach_the_value(core, how):
    # a hostile find (stop 49), present before: recorded as the property, not as a view, writes
    # through .T and .mT were lost
    def fn(x):
        z = x * 1
        if how == "T-setitem":
            z.T[1] = 0.0
        elif how == "mT-mul":
            z.mT.mul_(3)
        else:
            z.H.add_(1)
        return z, z.T, z.mT

    assert_matches_eager(fn, [torch.randn(2, 3), torch.randn(2, 3)], [], core=core)
