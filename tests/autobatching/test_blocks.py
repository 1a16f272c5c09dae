"""Static blocks (blocks.py): when a block's traces are reused, and when its body runs unblocked.

A trace is reused while nothing it depends on changed (its module's, or for a function block the
modules it reaches, parameters, buffers and ``training`` flags, and the blocks it calls). A body
that writes state outliving the call (running statistics, a counter buffer) or updates a value in
place runs unblocked, operation by operation, with eager's results (reliability #82, #91, #94).
"""

from __future__ import annotations

import contextlib

import copy

import pytest
import torch
from torch import nn

from batchcraft import autobatch, static_block
from batchcraft.errors import InstanceError

from equivalence import CORES, assert_matches_eager


def _close(out, ref):
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("core", CORES)
def test_function_block_sees_a_replaced_parameter_of_a_module_it_calls(core):
    # reliability #94: the trace held the old weight
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    blk = static_block(lambda x: torch.tanh(lin(x)))
    xs = [torch.randn(3) for _ in range(4)]
    f = autobatch(lambda x: blk(x), core=core)
    _close(f(xs), [torch.tanh(lin(x)) for x in xs])
    lin.weight = nn.Parameter(torch.randn(3, 3))
    _close(f(xs), [torch.tanh(lin(x)) for x in xs])


@pytest.mark.parametrize("core", CORES)
def test_function_block_follows_train_and_eval_of_a_module_block_it_calls(core):
    # reliability #94: a nested module block switched to train() ran its eval trace
    torch.manual_seed(1)
    lin = nn.Linear(2, 2)
    bn_e = nn.BatchNorm1d(2)
    bn_b = static_block(copy.deepcopy(bn_e))
    outer = static_block(lambda x: torch.tanh(bn_b(lin(x))))
    xs = [torch.randn(n, 2) for n in (2, 4, 3, 4)]
    f = autobatch(lambda x: outer(x), core=core)
    for train in (False, True, False):
        bn_e.train(train)
        bn_b.train(train)
        ref = [torch.tanh(bn_e(lin(x))) for x in xs]
        _close(f(xs), ref)
        torch.testing.assert_close(bn_b.running_mean, bn_e.running_mean)
        assert int(bn_b.num_batches_tracked) == int(bn_e.num_batches_tracked)
        assert bool(f.stats.fallback_reasons) == train  # batched again in eval mode


@pytest.mark.parametrize("core", CORES)
def test_function_block_follows_dropout_eval(core):
    torch.manual_seed(2)
    lin, drop = nn.Linear(4, 4), nn.Dropout(0.5)
    blk = static_block(lambda x: drop(lin(x)))
    xs = [torch.randn(4) for _ in range(3)]
    f = autobatch(lambda x: blk(x), core=core)
    f(xs)  # traced in train mode
    drop.eval()
    _close(f(xs), [lin(x) for x in xs])


@pytest.mark.parametrize("core", CORES)
def test_in_place_updates_inside_a_block_run_unblocked_as_eager(core):
    lin = nn.Linear(3, 3)

    @static_block
    def blk(x, y):
        h = lin(x)
        h += y          # in place on a value of the block
        h[0] = h[1] * 2  # item assignment
        return h.relu_()

    xs = [torch.randn(3) for _ in range(4)]
    assert_matches_eager(lambda x: blk(x, x * 3), xs, list(lin.parameters()), core=core)
    f = autobatch(lambda x: blk(x, x * 3), core=core)
    f(xs)
    (reason,) = f.stats.fallback_reasons
    assert "blk" in reason and "runs unblocked" in reason


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("switch", ["no_grad", "enable_grad", "inference_mode"])
def test_a_block_that_switches_grad_mode_inside_runs_unblocked_as_eager(core, switch):
    # hostile pass, stop 39 (present before): the program ran every step under the call's grad
    # mode, so a ``with torch.no_grad():`` inside the body was ignored (gradients where eager has
    # none; requires_grad False where eager's is True)
    torch.manual_seed(5)
    lin, out = nn.Linear(4, 4), nn.Linear(4, 4)
    ctx = {"no_grad": torch.no_grad, "enable_grad": torch.enable_grad,
           "inference_mode": torch.inference_mode}[switch]

    @static_block
    def blk(x):
        with ctx():
            h = torch.tanh(lin(x))
        if switch == "inference_mode":
            h = h.clone()  # an inference tensor must leave the mode as a normal one
        return out(h) + x, h.requires_grad

    xs = [torch.randn(4, requires_grad=True) for _ in range(5)]
    outer = torch.no_grad if switch == "enable_grad" else contextlib.nullcontext
    with outer():
        f = autobatch(lambda x: blk(x), core=core)
        got = f(xs)
        ref = [blk(x) for x in xs]
    for (a, ra), (b, rb) in zip(got, ref):
        torch.testing.assert_close(a, b)
        assert a.requires_grad == b.requires_grad and ra == rb
    assert any("grad mode" in r for r in f.stats.fallback_reasons), f.stats.fallback_reasons
    if switch == "no_grad":
        params = list(lin.parameters()) + list(out.parameters())
        gb = torch.autograd.grad(sum(a.sum() for a, _ in got), params, allow_unused=True)
        ge = torch.autograd.grad(sum(b.sum() for b, _ in ref), params, allow_unused=True)
        for a, b in zip(gb, ge):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("core", CORES)
def test_a_counter_buffer_in_a_block_counts_every_instance(core):
    # reliability #82: ``self.calls += 1`` on a buffer inside a static block
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            self.calls += 1
            return self.lin(x)

    torch.manual_seed(3)
    eager = Counted()
    blk = static_block(copy.deepcopy(eager))
    xs = [torch.randn(3) for _ in range(5)]
    ref = [eager(x) for x in xs]
    _close(autobatch(lambda x: blk(x), core=core)(xs), ref)
    assert float(blk.calls) == float(eager.calls) == 5


@pytest.mark.parametrize("core", CORES)
def test_a_buffer_no_trace_reads_may_be_reassigned_every_call_without_retracing(core, monkeypatch):
    # #99: the fingerprint held every buffer's id, so ``model.ema = ...`` retraced every call
    from batchcraft.autobatching import blocks

    traces = []
    orig = blocks.StaticBlock.trace
    monkeypatch.setattr(blocks.StaticBlock, "trace", lambda self, *a, **k: traces.append(1) or orig(self, *a, **k))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(4, 4)
            self.register_buffer("ema", torch.zeros(4))

    model = Model()
    step = static_block(lambda x, h: torch.tanh(model.out(x + h)))

    def fn(xs):
        h = torch.zeros(4)
        for x in xs:
            h = step(x, h)
        with torch.no_grad():
            model.ema = 0.9 * model.ema + 0.1 * h
        return h

    data = [[torch.randn(4) for _ in range(3)] for _ in range(4)]
    f = autobatch(fn, core=core)
    f(data)
    n = len(traces)
    for _ in range(3):
        f(data)
    assert len(traces) == n


@pytest.mark.parametrize("core", CORES)
def test_in_place_torch_functions_and_inplace_modules_inside_a_block(core):
    # #99: nn.ReLU(inplace=True) and torch.clamp_ inside a block, with grad on, raised
    lin = nn.Linear(3, 3)
    seq = static_block(nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True)))
    clamp = static_block(lambda h: torch.clamp_(lin(h) * 1.0, -0.2, 0.2))
    xs = [torch.randn(3) for _ in range(4)]
    params = list(lin.parameters()) + list(seq.parameters())
    assert_matches_eager(lambda x: clamp(seq(x)), xs, params, core=core)


@pytest.mark.parametrize("core", CORES)
def test_a_block_that_reassigns_module_state_runs_unblocked(core):
    # #101: ``self.calls = self.calls + 1`` / an EMA re-assigned inside a module block left the
    # trace's lazy value on the module (every later use of the module failed)
    class Tracked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("calls", torch.zeros(()))
            self.register_buffer("ema", torch.zeros(3))

        def forward(self, x):
            h = self.lin(x)
            self.calls = self.calls + 1
            with torch.no_grad():
                self.ema = 0.9 * self.ema + 0.1 * h
            return h

    torch.manual_seed(5)
    eager = Tracked()
    blk = static_block(copy.deepcopy(eager))
    xs = [torch.randn(3) for _ in range(4)]
    ref = [eager(x) for x in xs]
    f = autobatch(lambda x: blk(x), core=core)
    _close(f(xs), ref)
    assert type(blk.calls) is torch.Tensor and float(blk.calls) == float(eager.calls) == 4
    torch.testing.assert_close(blk.ema, eager.ema)
    # (its first reason found: the no_grad around the EMA since stop 39, the store before)
    assert any("stores a value (Tracked." in k or "changes grad mode" in k for k in f.stats.fallback_reasons)
    blk.state_dict()  # usable afterwards


@pytest.mark.parametrize("core", CORES)
def test_a_decorated_method_block_follows_its_module(core):
    # #100 (its method part): ``self`` is an argument of the block, so its module's state was not
    # in the fingerprint: a replaced weight and train() ran the old trace
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.drop = nn.Dropout(0.5)

        @static_block
        def step(self, x):
            return self.drop(torch.tanh(self.lin(x)))

        def forward(self, x):
            return self.step(x)

    torch.manual_seed(0)
    m = M().eval()
    xs = [torch.randn(3) for _ in range(4)]
    f = autobatch(m, core=core)
    f(xs)
    m.lin.weight = nn.Parameter(torch.randn(3, 3))
    _close(f(xs), [m(x) for x in xs])
    m.train()
    out = f(xs)
    assert sum(int((o == 0).sum()) for o in out) > 0  # dropout is on (traced again in train mode)
    m2 = M().eval()
    _close(autobatch(m2, core=core)(xs), [m2(x) for x in xs])


class _Holder:
    """A plain object holding a module (reached through its attributes)."""


_COMPREHENSION_LIN = nn.Linear(3, 3)  # a module-level global named only inside a comprehension


def _reach_cases(lin):
    import types

    holder = _Holder()
    holder.layer = lin
    helper = types.ModuleType("helper")  # a Python module the block's code names
    helper.lin = lin
    exec("def apply(x):\n    return lin(x)", helper.__dict__)

    class Stepper:
        def __init__(self, m):
            self.m = m

        def step(self, x):
            return self.m(x)

    class Cell(nn.Module):  # a module block whose forward uses a module from outside it
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 3)

        def forward(self, x):
            return self.inner(x) + lin(x)

    mods, table = [lin], {"l": lin}
    return {
        "list": lambda x: mods[0](x),
        "dict": lambda x: table["l"](x),
        "object attribute": lambda x: holder.layer(x),
        "comprehension": lambda x: torch.stack([_COMPREHENSION_LIN(x) for _ in range(1)])[0],
        "python module": lambda x: helper.apply(x),
        "bound method of an object": Stepper(lin).step,
        "module block": Cell(),
    }


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("case", ["list", "dict", "object attribute", "comprehension", "python module",
                                  "bound method of an object", "module block"])
def test_blocks_see_a_replaced_weight_of_modules_they_reach(core, case):
    # reliability #100: modules reached through containers, objects, nested code and other Python
    # modules were not in the fingerprint: the old weight ran (and got the gradient)
    torch.manual_seed(7)
    lin = _COMPREHENSION_LIN if case == "comprehension" else nn.Linear(3, 3)
    body = _reach_cases(lin)[case]
    blk = static_block(body)
    xs = [torch.randn(3) for _ in range(3)]
    f = autobatch(lambda x: blk(x), core=core)
    f(xs)
    lin.weight = nn.Parameter(torch.randn(3, 3))
    _close(f(xs), [body(x) for x in xs])


@pytest.mark.parametrize("core", CORES)
def test_a_block_sees_a_captured_tensor_rebound_or_made_to_require_grad(core):
    # reliability #100: a captured plain tensor re-bound (``W = ...``) or switched to requires_grad
    state = {"W": torch.randn(3, 3)}
    W = state["W"]
    blk = static_block(lambda x: torch.tanh(x @ W))
    xs = [torch.randn(3) for _ in range(3)]
    f = autobatch(lambda x: blk(x), core=core)
    f(xs)
    W.requires_grad_()
    out = f(xs)
    assert all(o.requires_grad for o in out)
    _close(out, [torch.tanh(x @ W) for x in xs])


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("block", [False, True])
def test_values_stored_into_containers_on_a_module_come_back_as_tensors(core, block):
    # a hostile helper's find (stop 34): ``self.history.append(h)`` / ``self.log.last = h`` left
    # lazy values behind (inside a block: one value of the trace; outside: the call's)
    import types

    class Hist(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.history = []
            self.by_name = {}
            self.log = types.SimpleNamespace(last=None)

        def forward(self, x):
            h = self.lin(x)
            self.history.append(h)
            self.by_name["h"] = h
            self.log.last = h
            return h

    torch.manual_seed(8)
    eager = Hist()
    batched = copy.deepcopy(eager)
    xs = [torch.randn(3) for _ in range(4)]
    ref = [eager(x) for x in xs]
    _close(autobatch(static_block(batched) if block else batched, core=core)(xs), ref)
    assert len(batched.history) == 4 and all(type(h) is torch.Tensor for h in batched.history)
    _close(batched.history, eager.history)
    torch.testing.assert_close(batched.log.last, eager.log.last)
    torch.testing.assert_close(batched.by_name["h"], eager.by_name["h"])


@pytest.mark.parametrize("core", CORES)
def test_a_module_passed_as_an_argument_is_part_of_the_fingerprint(core):
    # a hostile helper's find (stop 34): ``step(m, x)`` and ``A.meth(m, x)`` ran the old trace
    @static_block
    def step(m, x):
        return torch.tanh(m.lin(x))

    class A(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.drop = nn.Dropout(0.5)

        @static_block
        def meth(self, x):
            return self.drop(torch.tanh(self.lin(x)))

    torch.manual_seed(9)
    m = A().eval()
    xs = [torch.randn(3) for _ in range(4)]
    f = autobatch(lambda x: step(m, x), core=core)
    f(xs)
    m.lin.weight = nn.Parameter(torch.randn(3, 3))
    _close(f(xs), [step(m, x) for x in xs])
    g = autobatch(lambda x: A.meth(m, x), core=core)
    g(xs)
    m.train()
    assert sum(int((o == 0).sum()) for o in g(xs)) > 0


def test_a_decorated_method_of_an_unhashable_module_runs_outside_autobatch():
    # a hostile helper's find on this stop's first method fix (a WeakSet of bound modules):
    # a module class with __eq__ (so no __hash__) could not call its method block at all.
    # (Inside autobatch such a module fails in torch's own ``modules()``, which keeps a set.)
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def __eq__(self, other):
            return self is other

        @static_block
        def step(self, x):
            return self.lin(x)

    m = M()
    x = torch.randn(3)
    torch.testing.assert_close(m.step(x), m.lin(x))


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("how", ["tuple", "list", "object"])
def test_a_module_inside_a_container_argument_is_part_of_the_fingerprint(core, how):
    # a hostile helper's find (stop 34, third pass): ``step((m,), x)`` ran the old trace
    import types

    @static_block
    def step(holder, x):
        m = holder.m if how == "object" else holder[0]
        return torch.tanh(m(x))

    torch.manual_seed(10)
    m = nn.Linear(3, 3)
    holder = {"tuple": (m,), "list": [m], "object": types.SimpleNamespace(m=m)}[how]
    xs = [torch.randn(3) for _ in range(3)]
    f = autobatch(lambda x: step(holder, x), core=core)
    f(xs)
    m.weight = nn.Parameter(torch.randn(3, 3))
    _close(f(xs), [step(holder, x) for x in xs])


@pytest.mark.parametrize("core", CORES)
def test_a_block_storing_a_new_list_on_its_module_runs_unblocked(core):
    # a hostile helper's find (stop 34, third pass): ``self.hist = self.hist + [h]`` left the
    # trace's value on the module
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.hist = []

        def forward(self, x):
            h = self.lin(x)
            self.hist = self.hist + [h]
            return h

    torch.manual_seed(11)
    eager = M()
    blk = static_block(copy.deepcopy(eager))
    xs = [torch.randn(3) for _ in range(3)]
    ref = [eager(x) for x in xs]
    _close(autobatch(lambda x: blk(x), core=core)(xs), ref)
    assert len(blk.hist) == 3 and all(type(h) is torch.Tensor for h in blk.hist)
    _close(blk.hist, eager.hist)


@pytest.mark.parametrize("core", CORES)
def test_a_mode_of_the_users_around_a_block_call_is_refused_even_once_the_block_is_traced(core):
    # reliability #170: the check ran only when the block was traced; a cached program ignored the mode
    from torch.overrides import TorchFunctionMode

    from batchcraft.errors import AutobatchError

    class Half(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 0.5 if func is torch.sigmoid else out

    blk = static_block(lambda x, c: torch.sigmoid(x) * c + torch.tanh(c))
    xs = [(torch.randn(4), torch.randn(4)) for _ in range(3)]

    def with_mode(i):
        with Half():
            return blk(*i)

    autobatch(lambda i: blk(*i), core=core)(xs)  # traced and cached without the mode
    f = autobatch(with_mode, core=core)
    for _ in range(2):
        with pytest.raises(AutobatchError, match=r"torch-function mode \(Half\)"):
            f(xs)


@pytest.mark.parametrize("where", ["submodule", "global"])
def test_a_hook_added_or_removed_between_calls_is_seen(where):
    # reliability #185 (hostile helper, stop 38; present before): a forward hook runs inside the
    # block's trace; removed between two calls, it still applied in the second (the trace was kept)
    torch.manual_seed(0)

    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    proj = static_block(Proj())
    xs = [torch.randn(4) for _ in range(6)]
    f = autobatch(proj)
    hook = (lambda m, i, o: o * 2)
    with torch.no_grad():
        f(xs)
        h = (proj.lin.register_forward_hook(hook) if where == "submodule"
             else torch.nn.modules.module.register_module_forward_hook(hook))
        try:
            hooked, ref_hooked = f(xs), [proj(x) for x in xs]
        finally:
            h.remove()
        plain, ref_plain = f(xs), [proj(x) for x in xs]
    for got, ref in ((hooked, ref_hooked), (plain, ref_plain)):
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("core", CORES)
def test_a_block_returning_facts_of_a_captured_tensor_returns_the_tensors_facts(core):
    # hostile helper, stop 40 (present before): the block's trace inferred ``W.device`` on a
    # meta copy of W and returned device("meta"); the facts now come from W itself (a torch.Size
    # comes back as an equal tuple, like every tuple a block returns)
    W = torch.nn.Parameter(torch.randn(3))

    @static_block
    def blk(x):
        return x * W, W.shape, W.device, W.dtype, W.requires_grad

    xs = [torch.randn(3) for _ in range(3)]
    out = autobatch(lambda x: blk(x), core=core)(xs)
    for (y, shape, device, dtype, rg), x in zip(out, xs):
        ey, eshape, edevice, edtype, erg = blk.fn(x) if hasattr(blk, "fn") else blk(x)
        assert (shape, device, dtype, rg) == (eshape, edevice, edtype, erg)
        torch.testing.assert_close(y, ey)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("op", ["mask", "nonzero", "unique"])
def test_a_block_whose_output_shape_depends_on_values_runs_unblocked_as_eager(core, op):
    # before, such a block raised AutobatchError ("cannot be traced at per-instance shapes"):
    # an unsupported operation must fall back to eager execution, counted, not crash
    torch.manual_seed(2)
    lin = nn.Linear(5, 5)
    body = {"mask": lambda h: h[h > 0].sum(),
            "nonzero": lambda h: (h * h.gt(0).nonzero().float().mean()).sum(),
            "unique": lambda h: h.sum() * torch.unique(h.gt(0).long()).numel()}[op]

    @static_block
    def blk(x):
        return body(torch.tanh(lin(x)))

    xs = [torch.randn(5) for _ in range(6)]
    assert_matches_eager(lambda x: blk(x) * 2, xs, list(lin.parameters()), core=core)
    f = autobatch(lambda x: blk(x) * 2, core=core)
    f(xs)
    (reason,) = f.stats.fallback_reasons
    assert "blk" in reason and "runs unblocked" in reason and "placeholders" in reason


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("bad_at", [0, 2])
def test_an_operation_failing_in_a_block_raises_as_outside_a_block_and_the_next_call_is_batched(core, bad_at):
    # reliability #242: the error was AutobatchError "cannot be traced"; eager raises torch's
    # RuntimeError, which batchcraft reports as for any instance code (InstanceError, its cause).
    # bad_at=0: no good signature is cached before the failure (the C core kept the block
    # unblocked in later calls: a helper's find, stop 47)
    w = torch.randn(4, 4)
    blk = static_block(lambda x: torch.tanh(x @ w))
    good = [torch.randn(4) for _ in range(3)]
    bad = good[:bad_at] + [torch.randn(3)] + good[bad_at:]
    with pytest.raises(RuntimeError) as eager_err:
        [torch.tanh(x @ w) for x in bad]
    errors = []
    for fn in (lambda x: blk(x), lambda x: torch.tanh(x @ w)):
        f = autobatch(fn, core=core)
        with pytest.raises(InstanceError) as err:
            f(bad)
        assert err.value.instance == bad_at
        assert type(err.value.__cause__) is type(eager_err.value)
        errors.append(str(err.value.__cause__))
    assert errors[0] == errors[1] == str(eager_err.value)
    # the failure was one input's: the block is traced again and batched at the next call
    f = autobatch(lambda x: blk(x), core=core)
    with pytest.raises(InstanceError):
        f(bad)
    _close(f(good), [torch.tanh(x @ w) for x in good])
    assert not f.stats.fallback_reasons


@pytest.mark.parametrize("core", CORES)
def test_a_value_dependent_block_inside_another_block(core):
    torch.manual_seed(3)
    lin = nn.Linear(4, 4)
    inner = static_block(lambda h: h[h > 0].sum() + h.sum())
    outer = static_block(lambda x: inner(torch.tanh(lin(x))) * x.sum())
    xs = [torch.randn(4) for _ in range(5)]
    assert_matches_eager(lambda x: outer(x), xs, list(lin.parameters()), core=core)


@pytest.mark.parametrize("core", CORES)
def test_a_block_over_children_with_a_value_dependent_reduction_runs_as_eager(core):
    torch.manual_seed(4)
    lin = nn.Linear(4, 4)

    @static_block
    def cell(x, kids):  # a list argument: keyed ragged (empty / non-empty) where the trace allows
        h = torch.tanh(lin(x))
        if kids:
            s = torch.stack(kids, -2).sum(-2)
            h = h + s[s > 0].sum()
        return h

    def tree(t):
        return cell(t[0], [tree(k) for k in t[1]])

    def make(d):
        return (torch.randn(4), [make(d - 1) for _ in range(d % 3)] if d > 0 else [])

    assert_matches_eager(tree, [make(3), make(4), make(2), make(5)], list(lin.parameters()), core=core)


@pytest.mark.parametrize("core", CORES)
def test_a_list_block_that_traces_only_at_its_real_lengths_stays_batched(core):
    # the ragged trace (two-member placeholder lists) fails where the body needs the real length
    # (``torch.cat(kids) @ W``); the per-length traces work: the block must stay batched, not run
    # unblocked (a helper's find on e9f5149, stop 47)
    torch.manual_seed(5)
    w = torch.randn(4, 4)

    @static_block
    def node(x, kids):
        return torch.tanh(x + torch.cat(kids) @ w) if kids else torch.tanh(x)

    def chain(xs):
        h = node(xs[0], [])
        for x in xs[1:]:
            h = node(x, [h])
        return h

    data = [[torch.randn(4) for _ in range(n)] for n in (3, 5, 4, 2)]
    f = autobatch(chain, core=core)
    for _ in range(2):
        _close(f(data), [chain(d) for d in data])
        assert not f.stats.fallback_reasons
