"""Each fiber keeps its own thread state; the caller's state after a call equals its state before.

Issue 15 item 1 (greenlet #196, PyTorch PR #49017): grad mode, inference mode, autocast, the
default dtype, the torch-function mode stack and context variables are per thread in torch and
Python; a fiber that waits inside ``torch.no_grad()`` must not leave the next fiber (or the caller)
with gradients off. Every test compares with eager and checks the caller's state afterwards.
"""

from __future__ import annotations

import contextvars

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from batchcraft import autobatch, static_block
from batchcraft.errors import AutobatchError, InstanceError

from equivalence import CORES


def _state():
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch._C._len_torch_function_stack())


@pytest.fixture(params=CORES)
def core(request):
    return request.param


def test_wait_inside_no_grad_keeps_gradients_for_everyone(core):
    lin = nn.Linear(4, 4)

    def f(x):
        with torch.no_grad():
            x.sum().item() > 0  # the fiber waits here, inside no_grad
        return lin(x)

    xs = [torch.randn(4) for _ in range(3)]
    before = _state()
    out = autobatch(f, core=core)(xs)
    assert _state() == before
    assert [o.requires_grad for o in out] == [f(x).requires_grad for x in xs] == [True] * 3
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, f(x))


@pytest.mark.parametrize("fibers", [True, False])
def test_flush_inside_no_grad_keeps_earlier_rows_history(core, fibers):
    """A flush (max_pending reached, or a sync) inside a no_grad block runs groups recorded with
    grad on: their gathers and outputs must keep autograd history (a fuzzer find: the gathers ran
    under the caller's no_grad, and a later hook on such a row raised)."""

    def f(x):
        h = torch.tanh(x * 2)
        if h.requires_grad:
            h.register_hook(lambda g: g * 0.5)
        with torch.no_grad():
            v = h.tolist()  # a sync on h under no_grad
            w = torch.sigmoid(h + 1)
        return h * 3 + w + len(v)

    xs = [torch.randn(3, requires_grad=(i % 3 == 1)) for i in range(8)]
    out = autobatch(f, core=core, fibers=fibers, max_pending=5)(xs)
    ref = [f(x) for x in xs]
    assert [o.requires_grad for o in out] == [r.requires_grad for r in ref]
    gb = torch.autograd.grad(sum(o.sum() for o in out), [x for x in xs if x.requires_grad])
    ge = torch.autograd.grad(sum(r.sum() for r in ref), [x for x in xs if x.requires_grad])
    for a, b in zip(gb, ge):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fibers", [True, False])
def test_no_grad_cell_feeding_a_grad_layer_keeps_its_saved_rows(core, fibers):
    """Rows computed under no_grad and then saved for backward by a grad-mode layer must not be
    overwritten by later groups of the same flush (a fuzzer find: output arenas did, and backward
    raised "modified by an inplace operation")."""
    torch.manual_seed(0)
    cell, lin = nn.GRUCell(1, 1), nn.Linear(1, 1)

    def f(x):
        h = torch.tanh(x.sum(0))
        with torch.no_grad():
            for t in range(x.shape[0]):
                h = cell(x[t], h)
        return lin(h)

    xs = [torch.randn(n, 1) for n in (1, 2, 3)]
    out = autobatch(f, core=core, fibers=fibers, hoist=False)(xs)
    gb = torch.autograd.grad(sum(o.sum() for o in out), list(lin.parameters()))
    ge = torch.autograd.grad(sum(f(x).sum() for x in xs), list(lin.parameters()))
    for a, b in zip(gb, ge):
        torch.testing.assert_close(a, b)


def test_value_dependent_shape_under_autocast_runs_on_values(core):
    """Under autocast outputs are inferred on real zero placeholders, which hide value-dependent
    shapes (x[mask] of zeros is empty for every instance): such ops must run on values (a
    fuzzer find: the group stacked rows of 0 and 2 elements)."""

    def f(x):
        h = torch.tanh(x.sum(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(h + x[x.sum(-1) > 0].sum(0))
        return h.float()

    torch.manual_seed(0)
    xs = [torch.randn(n, 4) for n in (1, 1, 3, 2, 3, 1, 3, 3)]
    for o, x in zip(autobatch(f, core=core)(xs), xs):
        torch.testing.assert_close(o, f(x))


def test_wait_inside_enable_grad_called_under_no_grad(core):
    lin = nn.Linear(4, 4)

    def f(x):
        with torch.enable_grad():
            h = lin(x)
            bool(h.sum() > 0)
            return h * 2

    xs = [torch.randn(4) for _ in range(4)]
    with torch.no_grad():
        out = autobatch(f, core=core)(xs)
        assert not torch.is_grad_enabled()
        ref = [f(x) for x in xs]
    assert [o.requires_grad for o in out] == [r.requires_grad for r in ref] == [True] * 4
    gb = torch.autograd.grad(sum(o.sum() for o in out), lin.weight)[0]
    ge = torch.autograd.grad(sum(r.sum() for r in ref), lin.weight)[0]
    torch.testing.assert_close(gb, ge)


def test_caller_state_restored_when_an_instance_raises_inside_no_grad(core):
    def f(x):
        with torch.no_grad():
            if x.sum().item() > 100:
                raise ValueError("boom")
            bool(x.mean() > 0)
            if x[0].item() > 1.5:
                raise ValueError("late boom")
        return x * 2

    xs = [torch.full((3,), 2.0), torch.zeros(3), torch.ones(3)]
    before = _state()
    with pytest.raises(InstanceError, match="late boom") as ei:
        autobatch(f, core=core)(xs)
    assert ei.value.instance == 0
    assert _state() == before


def test_custom_autograd_function_whose_forward_waits(core):
    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 3 if x.sum().item() > 0 else x * 5   # waits for a value, grad disabled

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * torch.where(x.sum() > 0, torch.tensor(3.0), torch.tensor(5.0))

    lin = nn.Linear(3, 3)

    def f(x):
        return Scaled.apply(lin(x)).tanh()

    xs = [torch.randn(3) for _ in range(5)]
    before = _state()
    out = autobatch(f, core=core)(xs)
    assert _state() == before
    ref = [f(x) for x in xs]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
        assert o.requires_grad == r.requires_grad
    gb = torch.autograd.grad(sum(o.sum() for o in out), lin.weight)[0]
    ge = torch.autograd.grad(sum(r.sum() for r in ref), lin.weight)[0]
    torch.testing.assert_close(gb, ge)


def test_inference_mode_inside_instances(core):
    lin = nn.Linear(4, 4)

    def f(x):
        with torch.inference_mode():
            y = lin(x)
            bool(y.sum() > 0)
            z = y * 2
        return z, lin(x)

    xs = [torch.randn(4) for _ in range(3)]
    before = _state()
    out = autobatch(f, core=core)(xs)
    assert _state() == before
    for (z, w), x in zip(out, xs):
        rz, rw = f(x)
        torch.testing.assert_close(z, rz)
        torch.testing.assert_close(w, rw)
        assert z.is_inference() == rz.is_inference() and w.requires_grad == rw.requires_grad


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_bfloat16_autocast(core, where):
    lin = nn.Linear(8, 8)

    def f(x):
        if where == "inside":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = lin(x)
                bool(y.float().sum() > 0)  # a wait inside the autocast region
                return lin(y).relu()
        return lin(lin(x)).relu()

    xs = [torch.randn(8) for _ in range(4)]
    before = _state()
    if where == "outside":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = autobatch(f, core=core)(xs)
            ref = [f(x) for x in xs]
    else:
        out = autobatch(f, core=core)(xs)
        ref = [f(x) for x in xs]
    assert _state() == before
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype == torch.bfloat16
        torch.testing.assert_close(o, r, atol=2e-2, rtol=2e-2)


def test_default_dtype_changed_inside_an_instance_is_its_own(core):
    def f(x):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            bool(x.sum() > 0)
            return x.to(torch.get_default_dtype()) + torch.tensor(0.5)
        finally:
            torch.set_default_dtype(old)

    xs = [torch.randn(3) for _ in range(3)]
    before = _state()
    out = autobatch(f, core=core)(xs)
    assert _state() == before
    for o, x in zip(out, xs):
        r = f(x)
        assert o.dtype == r.dtype == torch.float64
        torch.testing.assert_close(o, r)


def test_user_torch_function_mode_around_and_inside(core):
    seen = []

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def f(x):
        with Count():
            y = x * 2
            bool(y.sum() > 0)
            return y + 1

    xs = [torch.randn(3) for _ in range(3)]
    before = _state()
    out = autobatch(f, core=core)(xs)
    assert _state() == before
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, x * 2 + 1)
    assert seen  # the user's mode saw the instances' calls


VAR = contextvars.ContextVar("batchcraft_test_var", default="unset")


def test_context_variables_are_the_callers(core):
    def f(x):
        v = VAR.get()
        bool(x.sum() > 0)
        VAR.set("changed by an instance")
        return x * (2.0 if v == "caller" else -1.0), VAR.get()

    xs = [torch.randn(3) for _ in range(3)]
    token = VAR.set("caller")
    try:
        out = autobatch(f, core=core)(xs)
        assert VAR.get() == "caller"  # instance changes stay in the instance's context
    finally:
        VAR.reset(token)
    for (o, seen), x in zip(out, xs):
        torch.testing.assert_close(o, x * 2.0)
        assert seen == "changed by an instance"


def test_view_made_under_no_grad_reads_requires_grad_as_in_eager(core):
    """Bug #30 (long fuzz): in eager a view made under no_grad of a tensor that requires grad reads
    requires_grad=True and has no history; batchcraft inferred False."""

    def f(x):
        h = torch.tanh(x * 2)
        with torch.no_grad():
            v = h.reshape(1, -1).permute(1, 0).reshape(-1)
        return v * 3

    xs = [torch.randn(3, requires_grad=(i > 0)) for i in range(3)]
    out = autobatch(f, core=core)(xs)
    ref = [f(x) for x in xs]
    assert [o.requires_grad for o in out] == [r.requires_grad for r in ref] == [False, True, True]
    wrt = [x for x in xs if x.requires_grad]
    gb = torch.autograd.grad(sum(o.sum() for o in out if o.requires_grad), wrt, allow_unused=True)
    ge = torch.autograd.grad(sum(r.sum() for r in ref if r.requires_grad), wrt, allow_unused=True)
    assert gb == ge == (None, None)  # no history through the no_grad view, as in eager


class _Tag(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_fiber_state_fast_path_skips_only_when_the_state_is_the_schedulers():
    """``leave``/``enter`` do nothing when the fiber left the scheduler's state as it was; a change
    of any part, a mode stack of the same depth and top with another mode below, takes the full path."""
    from batchcraft.autobatching.threadstate import FiberState

    outer, inner = _Tag(), _Tag()
    with outer, inner:
        main = FiberState.capture()
        fs = main.copy()
        fs.enter(main)
        fs.leave(main)  # nothing changed: fast path
        assert fs.same_as(main) and _state() == (True, False, torch.float32, False, torch.bfloat16, 2)

        fs.enter(main)
        torch._C._set_grad_enabled(False)  # the fiber turns gradients off and yields
        fs.leave(main)
        assert fs.grad is False and torch.is_grad_enabled()  # captured; the scheduler's restored
        fs.enter(main)
        assert not torch.is_grad_enabled()  # resumed with its own state
        torch._C._set_grad_enabled(True)
        fs.leave(main)

        fs.enter(main)
        other = _Tag()
        assert torch._C._pop_torch_function_stack() is inner
        assert torch._C._pop_torch_function_stack() is outer
        torch._C._push_on_torch_function_stack(other)  # same depth, same top, another mode below
        torch._C._push_on_torch_function_stack(inner)
        fs.leave(main)
        assert fs.modes == (other, inner)
        assert torch._C._get_function_stack_at(0) is outer  # the scheduler's stack is back
        fs.enter(main)
        assert torch._C._get_function_stack_at(0) is other
        for _ in range(2):
            torch._C._pop_torch_function_stack()
        torch._C._push_on_torch_function_stack(outer)
        torch._C._push_on_torch_function_stack(inner)
        fs.leave(main)
        assert fs.same_as(main)
    assert torch._C._len_torch_function_stack() == 0


def test_float16_autocast_inside_leaves_the_callers_dtype_and_no_cast_weight_behind(core):
    """Autocast's cast cache is keyed by tensor, not dtype: a float16 copy of a weight left in it
    broke the caller's next bfloat16 region ("mat1 and mat2 must have the same dtype")."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    xs = [torch.randn(8) for _ in range(3)]

    def f(x):
        with torch.autocast("cpu", dtype=torch.float16):
            return lin(x).float()

    before = _state()
    got = autobatch(f, core=core)(xs)
    assert _state() == before  # the dtype too (bfloat16, autocast's CPU default)
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, f(x), atol=1e-2, rtol=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(xs[0]).dtype is torch.bfloat16  # eager code after the call still works


@pytest.mark.parametrize("fibers", [True, False])
def test_two_autocast_dtypes_in_one_instance(core, fibers):
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    xs = [torch.randn(8) for _ in range(3)]

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = lin(x)
        if h.float().sum() > 100:  # a value wait between the two regions
            h = h * 2
        with torch.autocast("cpu", dtype=torch.float16):
            g = lin(x)
        return h.float(), g.float()

    before = _state()
    got = autobatch(f, core=core, fibers=fibers)(xs)
    assert _state() == before
    for (gh, gg), x in zip(got, xs):
        eh, eg = f(x)
        torch.testing.assert_close(gh, eh, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(gg, eg, atol=2e-2, rtol=2e-2)


class _Double(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if getattr(func, "__name__", "") == "relu" else out


def _assert_matches_eager(f, xs, core):
    got = autobatch(f, core=core)(xs)
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, f(x))


def test_a_mode_entered_inside_instance_code_sees_tensor_methods(core):  # reliability #49
    def f(x):
        with _Double():
            return x.relu()

    xs = [torch.ones(3), torch.full((3,), 2.0)]
    _assert_matches_eager(f, xs, core)


def test_a_mode_entered_inside_instance_code_sees_torch_functions(core):
    def f(x):
        with _Double():
            return torch.relu(x)

    xs = [torch.ones(3), torch.full((3,), 2.0)]
    _assert_matches_eager(f, xs, core)


class _Log(TorchFunctionMode):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.log.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _logged(logs, key, w):
    def f(x):
        h = torch.tanh(x @ w)  # outside the mode: batched, not seen
        log = logs.setdefault((key, round(float(x.detach().sum()), 4)), [])
        with _Log(log):
            a = h.relu() + 1                      # a method and an operator
            b = a[1:] * a[:-1].sigmoid()          # __getitem__
            c = b.unsqueeze(0).T.logsumexp(0).sum()  # a property, a method not in the fast table
            d = (h > 0).float().mean()            # a comparison
            y = h.clone()
            y.add_(1)                             # in place
            y[0] = c                              # item assignment
            y *= 2                                # in-place operator
            z = h.clone().view(2, 2)
            z.t_()                                # metadata-only in place
        return c + d + y.sum() + z[0, 1] + h.sum()
    return f


def test_a_mode_entered_inside_instance_code_sees_every_call_as_in_eager(core):
    """Reliability #49: methods, operators, properties, in-place updates and item assignment of
    lazy values reach a mode that instance code entered, once each, in eager's order; values and
    gradients equal eager's; each such call is a counted fallback, the code outside the mode is not."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    xs = [torch.randn(4) for _ in range(3)]
    logs: dict = {}
    eager = [_logged(logs, "eager", w)(x) for x in xs]
    (g_eager,) = torch.autograd.grad(sum(eager), w)
    f = autobatch(_logged(logs, "batched", w), core=core)
    got = f(xs)
    (g_got,) = torch.autograd.grad(sum(got), w)
    torch.testing.assert_close(torch.stack(got), torch.stack(eager))
    torch.testing.assert_close(g_got, g_eager)
    keys = sorted(k[1] for k in logs if k[0] == "eager")
    assert len(keys) == len(xs)
    for k in keys:
        assert logs[("batched", k)] == logs[("eager", k)]
        assert "add_" in logs[("eager", k)] and "__setitem__" in logs[("eager", k)]
    reasons = f.stats.fallback_reasons
    assert any(r.startswith("relu: under a torch-function mode") for r in reasons)
    assert not any(r.startswith("tanh") for r in reasons)  # before the mode: recorded, batched
    assert f.stats.batched_calls > 0


def test_a_concrete_result_with_autograd_history_is_no_leaf(core):
    """Reliability #53: ``w * 2`` inside instance code (w a parameter, no lazy argument) runs
    concretely; it has autograd history, so it is not a leaf and may be updated in place, as
    in eager (it was refused as "a leaf Variable that requires grad")."""
    w = torch.randn(3, requires_grad=True)

    def f(x):
        t = w * 2
        facts = (t.is_leaf, t.grad_fn is not None)
        t.add_(1)
        return x * t, facts

    xs = [torch.ones(3), torch.full((3,), 2.0)]
    eager = [f(x) for x in xs]
    got = autobatch(f, core=core)(xs)
    for (ge, fe), (gg, fg) in zip(eager, got):
        assert fg == fe == (False, True)
        torch.testing.assert_close(gg, ge)
    (a,) = torch.autograd.grad(sum(o.sum() for o, _ in eager), w)
    (b,) = torch.autograd.grad(sum(o.sum() for o, _ in got), w)
    torch.testing.assert_close(b, a)


def test_a_view_under_no_grad_keeps_requires_grad_when_its_rows_are_gathered(core):
    # found by the long fuzz run at stop 25 (values equal; the flag differs): the same reshape twice
    # reads h's rows in another order than they were laid out, so the group gathers them
    w = torch.randn(2, requires_grad=True)

    def f(x):
        h = x * w
        with torch.no_grad():
            a = h.reshape(2, 1)
            c = h.reshape(2, 1).t()
            d = h.reshape(2, 1).tanh()  # not a view: no grad, in both
        return a, c, d

    xs = [torch.randn(2), torch.randn(2)]
    eager = [f(x) for x in xs]
    got = autobatch(f, core=core)(xs)
    flags = lambda outs: [[t.requires_grad for t in o] for o in outs]
    assert flags(got) == flags(eager) == [[True, True, False]] * 2
    for e, g in zip(eager, got):
        for a, b in zip(e, g):
            torch.testing.assert_close(b, a)
    # no history through a no_grad view in either: nothing reaches w
    ge = torch.autograd.grad(sum(o[0].sum() + o[1].sum() for o in eager), w, allow_unused=True)
    gg = torch.autograd.grad(sum(o[0].sum() + o[1].sum() for o in got), w, allow_unused=True)
    assert ge == gg == (None,)


class _Pass(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_view_made_under_a_mode_sees_a_later_in_place_update_of_its_base(core):
    # a hostile helper's finding on #49's first fix: views made under the mode were concrete copies
    # of the rows, so `y.tanh_()` did not reach `v` (wrong value and gradient); now recorded views
    w = torch.randn(4, 4, requires_grad=True)

    def f(x):
        h = x @ w
        with _Pass():
            y = h.clone()
            v = y[0]
            s = y[0:2]
            y.mul_(3)
            y[3] = 7.0
            y.tanh_()
        return v, s, y

    xs = [torch.randn(4), torch.randn(4)]
    eager = [f(x) for x in xs]
    got = autobatch(f, core=core)(xs)
    for e, g in zip(eager, got):
        for a, b in zip(e, g):
            torch.testing.assert_close(b, a)
    (ge,) = torch.autograd.grad(sum(sum(t.square().sum() for t in o) for o in eager), w)
    (gg,) = torch.autograd.grad(sum(sum(t.square().sum() for t in o) for o in got), w)
    torch.testing.assert_close(gg, ge)


class _Halve(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 0.5 if isinstance(out, torch.Tensor) and out.is_floating_point() else out


def test_a_mode_that_checks_isinstance_tensor_sees_tensors(core):
    def f(x):
        h = x * 1.0
        with _Halve():
            return h.tanh()

    xs = [torch.ones(4), torch.full((4,), 2.0)]
    _assert_matches_eager(f, xs, core)


def test_a_mode_sees_tensors_as_results_of_torch_functions_on_lazy_values(core):
    # reliability #56, the torch-function path: the handler's func(*args) got lazy values back
    # (not tensors: _Halve left them whole), from torch.tanh, F.relu (Python-level) and F.linear
    w = torch.randn(4, 4, requires_grad=True)

    def f(x):
        h = x @ w
        with _Halve():
            a = torch.tanh(h)
            b = torch.nn.functional.relu(h)
            c = torch.nn.functional.linear(h, w)
        return a + b * c

    xs = [torch.randn(4) for _ in range(3)]
    eager = [f(x) for x in xs]
    runner = autobatch(f, core=core)
    got = runner(xs)
    for e, g in zip(eager, got):
        torch.testing.assert_close(g, e)
    (ge,) = torch.autograd.grad(sum(o.square().sum() for o in eager), w)
    (gg,) = torch.autograd.grad(sum(o.square().sum() for o in got), w)
    torch.testing.assert_close(gg, ge)
    reasons = runner.stats.fallback_reasons
    assert any(r.startswith("tanh: called by a torch-function mode's handler") for r in reasons)
    assert any(r.startswith("relu: called by a torch-function mode's handler") for r in reasons)


def test_torch_functions_outside_a_users_mode_still_batch(core):
    # the handler search (bug #56) finds no user mode: recorded and batched, no fallback
    def f(x):
        h = x * 2
        return torch.tanh(h) + torch.nn.functional.relu(h)

    xs = [torch.randn(3) for _ in range(4)]
    runner = autobatch(f, core=core)
    _assert_matches_eager(f, xs, core)
    runner(xs)
    assert not runner.stats.fallback_reasons
    assert runner.stats.batched_calls > 0


def test_an_in_place_torch_function_under_a_mode_writes_the_lazy_value(core):
    # #56's in-place side: the handler gets a tensor, the instance's value and its view see the write
    w = torch.randn(4, 4, requires_grad=True)

    def f(x):
        h = x @ w
        v = h[1:3]
        with _Halve():
            z = h.add_(0.5)
            y = torch.nn.functional.relu(h, inplace=True)
        return y, h, z, v

    xs = [torch.randn(4) for _ in range(3)]
    eager = [f(x) for x in xs]
    got = autobatch(f, core=core)(xs)
    for e, g in zip(eager, got):
        for a, b in zip(e, g):
            torch.testing.assert_close(b, a)
    (ge,) = torch.autograd.grad(sum(sum(t.square().sum() for t in o) for o in eager), w)
    (gg,) = torch.autograd.grad(sum(sum(t.square().sum() for t in o) for o in got), w)
    torch.testing.assert_close(gg, ge)


class _NotImpl(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.tanh:
            return NotImplemented
        return func(*args, **(kwargs or {}))


def test_a_mode_returning_not_implemented_raises_as_in_eager(core):
    def f(x):
        h = x * 2
        with _NotImpl():
            return torch.tanh(h)

    with pytest.raises(TypeError, match="Multiple dispatch failed"):
        f(torch.ones(2))
    with pytest.raises(InstanceError, match="Multiple dispatch failed"):
        autobatch(f, core=core)([torch.ones(2), torch.zeros(2)])


def test_a_mode_entered_inside_a_static_block_is_refused_by_name(core):
    # a block traces once on stand-in values, which the mode's handler would see: a clear error
    # (it gave whole values, not halved ones, silently, before #56's fix)
    @static_block
    def blk(h):
        with _Halve():
            return torch.tanh(h)

    def f(x):
        return blk(x * 1.0)

    with pytest.raises(AutobatchError, match=r"torch-function mode \(_Halve\) entered inside a static block"):
        autobatch(f, core=core)([torch.ones(4), torch.zeros(4)])


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("first", ["inference_grad", "plain"])
def test_inference_mode_with_grad_enabled_inside_is_its_own_state(core, first):
    # a hostile helper (stop 33): `inference_mode()` with `enable_grad()` inside has grad mode on
    # *and* inference mode on; a state word that took grad-on to mean no inference mode let such
    # a call and an ordinary one share signatures (requires_grad False in training, or a hook
    # registered on a tensor that does not require grad)
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def fn(x):
        y = torch.tanh(lin(x))
        return y, y.requires_grad

    xs = [torch.randn(4) for _ in range(3)]
    f = autobatch(fn, core=core)
    calls = ["inference_grad", "plain"] if first == "inference_grad" else ["plain", "inference_grad"]
    for how in calls:
        if how == "plain":
            out, ref = f(xs), [fn(x) for x in xs]
        else:
            with torch.inference_mode(), torch.enable_grad():
                out, ref = f(xs), [fn(x) for x in xs]
        for (y, flag), (ey, eflag) in zip(out, ref):
            assert flag == eflag and y.requires_grad == ey.requires_grad
            torch.testing.assert_close(y, ey)
        if how == "plain":
            sum(y.sum() for y, _ in out).backward()
            assert lin.weight.grad is not None


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("fibers", [True, False])
def test_print_options_set_around_a_wait_are_each_instances_own(core, fibers):
    # hostile find (stop 35): str() waits for the value, so fibers switch inside a printoptions
    # block; torch's print options are process-wide: they were mixed between instances and leaked
    from torch._tensor_str import printoptions

    def fn(x):
        y = x * 3
        with printoptions(precision=1, threshold=2, edgeitems=1):
            short = str(y)
        return y, short, str(y)

    before = dict(vars(torch._tensor_str.PRINT_OPTS))
    xs = [torch.randn(5) for _ in range(4)]
    out = autobatch(fn, core=core, fibers=fibers)(xs)
    assert dict(vars(torch._tensor_str.PRINT_OPTS)) == before
    for (y, short, full), x in zip(out, xs):
        _, rshort, rfull = fn(x)
        assert (short, full) == (rshort, rfull)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("fibers", [True, "auto"])
def test_disabled_saved_tensor_hooks_stay_with_their_instance(core, fibers):
    # reliability #174: the "disabled" flag is per thread in torch; an instance waiting inside
    # disable_saved_tensors_hooks made another instance's save_on_cpu raise
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    def fn(inp):
        k, x = inp
        if k == 0:
            with torch.autograd.graph.disable_saved_tensors_hooks("disabled by instance 0"):
                y = lin(x)
                if y.sum() > -1e9:  # a value wait inside the region
                    y = y * 2
                return y
        with torch.autograd.graph.save_on_cpu():
            return torch.tanh(lin(x))

    xs = [(k, torch.randn(8, requires_grad=True)) for k in range(3)]
    ref = [fn(x) for x in xs]
    out = autobatch(fn, core=core, fibers=fibers)(xs)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-6, rtol=1e-5)
    assert torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is None


@pytest.mark.parametrize("core", CORES)
def test_grad_mode_turned_off_by_an_instance_that_raises_is_confined_to_it(core):
    # reliability #237 (documented): eager leaves grad mode off after such an instance; batchcraft
    # confines thread state an instance changes to that instance, on the error path too
    def fn(k):
        torch.set_grad_enabled(False)
        if k == 1:
            raise ValueError("stop")
        return torch.ones(2) * k

    assert torch.is_grad_enabled()
    with pytest.raises(Exception, match="stop"):
        autobatch(fn, core=core)([0, 1, 2])
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("fibers", [True, False])
@pytest.mark.parametrize("core", CORES)
def test_the_autocast_cache_switch_is_the_callers_after_the_call(core, fibers):
    # reliability #257: autocast's cast cache switched off inside instance code stayed off in the
    # caller's thread (a caller without autocast was captured as None, which set no cache switch)
    lin = nn.Linear(4, 4)

    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            h = lin(x)
        if fibers:
            _ = h.sum().item()  # a wait: the fiber leaves and comes back
        return h

    def state():
        return torch.is_autocast_cache_enabled(), torch.is_autocast_enabled("cpu")

    xs = [torch.randn(4) for _ in range(3)]
    for caller in (True, False):
        try:
            torch.set_autocast_cache_enabled(caller)
            ref = [fn(x) for x in xs]
            want = state()  # (torch's own exit leaves autocast on when the cache was off before)
            torch.set_autocast_cache_enabled(caller)
            torch.set_autocast_enabled("cpu", False)
            out = autobatch(fn, core=core, fibers=fibers)(xs)
            assert state() == want, caller
        finally:
            torch.set_autocast_cache_enabled(True)
            torch.set_autocast_enabled("cpu", False)
        for o, r in zip(out, ref):
            torch.testing.assert_close(o, r)


@pytest.mark.parametrize("fibers", [True, False])
@pytest.mark.parametrize("core", CORES)
def test_inference_mode_false_inside_the_callers_inference_mode_keeps_gradients(core, fibers):
    # reliability #258: the outputs said requires_grad but were leaves without history (their rows
    # were taken under the caller's inference mode), and the weight got no gradient
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def fn(x):
        with torch.inference_mode(False):
            return lin(x)

    xs = [torch.randn(4) for _ in range(3)]
    with torch.inference_mode():
        ref = [fn(x) for x in xs]
        out = autobatch(fn, core=core, fibers=fibers)(xs)
    for o, r in zip(out, ref):
        assert o.requires_grad and o.grad_fn is not None and not o.is_inference()
        torch.testing.assert_close(o, r)
    g = torch.autograd.grad(sum(o.sum() for o in out), lin.weight)[0]
    torch.testing.assert_close(g, torch.autograd.grad(sum(r.sum() for r in ref), lin.weight)[0])


FACTORY_CALLS = (lambda: torch.zeros(2), lambda: torch.tensor([1.0, 2.0]), lambda: torch.arange(2.0),
                 lambda: torch.tensor(2.0), lambda: torch.full((2,), 3.0))


@pytest.mark.parametrize("fibers", [True, False])
@pytest.mark.parametrize("core", CORES)
def test_factories_in_another_inference_mode_than_the_callers_are_what_eager_made(core, fibers):
    # reliability #266 and #267: a leaf without a tensor (a scalar, a list, a constant) is made at
    # the flush in the caller's inference mode; made in another mode inside instance code, eager's
    # tensor is an inference tensor or not by that mode (backward through it failed, or eager's
    # later errors did not happen)
    w = torch.randn(2, requires_grad=True)

    def out_of_it(i):
        with torch.inference_mode(False):
            return tuple(make() for make in FACTORY_CALLS)

    def into_it(i):
        with torch.inference_mode():
            return tuple(make() for make in FACTORY_CALLS)

    with torch.inference_mode():
        ref = [out_of_it(i) for i in range(2)]
        out = autobatch(out_of_it, core=core, fibers=fibers)([0, 1])
    for o, r in zip(out, ref):
        assert [t.is_inference() for t in o] == [t.is_inference() for t in r] == [False] * 5
        (o[0] * w).sum().backward()  # (saved for backward: a plain tensor)
    ref = [into_it(i) for i in range(2)]
    out = autobatch(into_it, core=core, fibers=fibers)([0, 1])
    for o, r in zip(out, ref):
        assert [t.is_inference() for t in o] == [t.is_inference() for t in r] == [True] * 5
        for a, b in zip(o, r):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fibers", [True, False])
@pytest.mark.parametrize("core", CORES)
def test_a_cache_switch_left_changed_by_instance_code_is_the_callers_again_after_the_call(core, fibers):
    # reliability #268: the caller's state after a call is its state before (README); the cache
    # switch changed outside any autocast region was missed by the check that the state is unchanged
    def fn(i):
        torch.set_autocast_cache_enabled(i % 2 == 1)  # (the last instance leaves it off)
        if fibers:
            _ = torch.ones(2).sum().item()
        return torch.ones(2) * i

    try:
        for caller in (True, False):
            torch.set_autocast_cache_enabled(caller)
            autobatch(fn, core=core, fibers=fibers)([0, 1, 2])
            assert torch.is_autocast_cache_enabled() is caller
    finally:
        torch.set_autocast_cache_enabled(True)
