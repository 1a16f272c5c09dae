"""A per-instance 0-d integer used as a size or a count inside instance code: ``torch.zeros(n, 2)``
(sizeargs.py, reliability #272) and ``w.repeat(n, 1)`` / ``w.narrow(0, 0, n)``, whose output
shapes depend on ``n``'s value (infer.py, reliability #277)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.overrides import TorchFunctionMode

from batchcraft import autobatch, static_block
from batchcraft.errors import InstanceError

from equivalence import CORES, assert_matches_eager

W = torch.arange(1.0, 7.0)

SIZE_FIRST = {
    "zeros": lambda n: torch.zeros(n, 2) + 1,
    "ones-dtype": lambda n: torch.ones(n, 3, dtype=torch.float64),
    "empty-filled": lambda n: torch.empty(n, 2).fill_(0.5),
    "zeros-second": lambda n: torch.zeros(2, n),
    "zeros-tuple": lambda n: torch.zeros((n, 2)),
    "zeros-three": lambda n: torch.zeros(n, 1, 2),
}

VALUE_SHAPED = {
    "repeat-shared": lambda n: W.repeat(n, 1),
    "repeat-lazy": lambda n: (W * 2).repeat(n, 1),
    "narrow-shared": lambda n: W.narrow(0, 0, n),
    "narrow-lazy": lambda n: (W + 1).narrow(0, 1, n),
    "topk": lambda n: (W * 3).topk(n).values,
    "slice": lambda n: (W * 1)[:n],
    "arange": lambda n: torch.arange(n) * 2,
}

T3 = torch.arange(18.0).reshape(3, 3, 2)

#: a 0-d integer as a dim: shapes that two placeholder values cannot tell apart (sum over dims 0
#: and 1 of a (3, 3, 2) tensor: both (3, 2); over dim 2: (3, 3)) (a hostile find, stop 49)
AS_DIM = {
    "sum": lambda d: (T3 * 1).sum(d),
    "sum-shared": lambda d: T3.sum(d),
    "amax": lambda d: (T3 * 1).amax(d),
    "argmax": lambda d: (T3 * 1).argmax(d),
    "softmax": lambda d: (T3 * 1).softmax(d),
    "transpose": lambda d: (T3 * 1).transpose(d, 0).contiguous(),
    "unbind": lambda d: (T3 * 1).unbind(d)[0],
    "stack-of-ints": lambda d: torch.stack([d, d * 2]),  # (data, not dims: stays batched)
}


def _options(core, fast):
    return {"core": core} if fast else {"core": core, "fast_factories": False}


@pytest.mark.parametrize("fast", [True, False], ids=["fast-factories", "mode-only"])
@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", sorted(SIZE_FIRST))
def test_sizes_one_by_one_with_a_lazy_first_equal_eager(core, fast, name):
    # before: TypeError "zeros() takes 1 positional argument but 2 were given" (torch's parser
    # takes sizes one by one only when the first is an int, and a lazy value is not a Tensor)
    make = SIZE_FIRST[name]
    assert_matches_eager(lambda n: make(n) * 2, [torch.tensor(2), torch.tensor(3), torch.tensor(2)], [],
                         **_options(core, fast))


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", ["rand", "randn"])
def test_random_sizes_with_a_lazy_first_have_eager_shapes(core, name):
    # (read at the call, as instance code writes it: ``from torch import rand`` keeps torch's own)
    out = autobatch(lambda n: getattr(torch, name)(n, 2, dtype=torch.float64), core=core)([torch.tensor(1), torch.tensor(4)])
    assert [o.shape for o in out] == [(1, 2), (4, 2)] and all(o.dtype == torch.float64 for o in out)


@pytest.mark.parametrize("core", CORES)
def test_sizes_one_by_one_inside_a_static_block(core):
    @static_block
    def block(x, n):
        return torch.zeros(n, 2) + x.sum()

    assert_matches_eager(lambda n: block(W * 1, n), [torch.tensor(2), torch.tensor(3)], [], core=core)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", sorted(VALUE_SHAPED))
def test_outputs_shaped_by_a_lazy_value_equal_eager(core, name):
    # before: the real placeholder (0) gave every instance the shape of n = 0; instances with
    # different n failed to stack ("stack expects each tensor to be equal size")
    make = VALUE_SHAPED[name]
    for ns in ([2, 3, 1], [2, 2]):
        assert_matches_eager(lambda n: make(n) * 2, [torch.tensor(v) for v in ns], [], core=core)


@pytest.mark.parametrize("core", CORES)
def test_value_shaped_outputs_keep_gradients(core):
    lin = nn.Linear(6, 6)
    assert_matches_eager(lambda n: lin(W).repeat(n, 1).sum(0) + lin(W).narrow(0, 0, n).sum(),
                         [torch.tensor(1), torch.tensor(3)], list(lin.parameters()), core=core)


@settings(max_examples=25, deadline=None)
@given(ns=st.lists(st.integers(0, 5), min_size=1, max_size=5), core=st.sampled_from(CORES),
       which=st.sampled_from(["zeros", "repeat-lazy", "narrow-shared", "empty-filled"]))
def test_random_counts_equal_eager(ns, core, which):
    make = {**SIZE_FIRST, **VALUE_SHAPED}[which]
    assert_matches_eager(lambda n: make(n).sum(-1) + n, [torch.tensor(v) for v in ns], [], core=core)


@pytest.mark.parametrize("core", CORES)
def test_torch_functions_keep_their_identity_where_no_recorder_reads_them(core):
    # a mode of the user's handler compares func with torch.zeros; another thread reads torch.*
    seen, other = [], []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append((func is torch.zeros) or (func is torch.randn) or (func is torch.empty))
            return func(*args, **(kwargs or {}))

    def fn(x):
        with Mode():
            a = torch.zeros(2, 3)
            b = torch.empty(2)
            c = torch.randn(2)
        t = threading.Thread(target=lambda: other.append(all(getattr(torch, k) is vars(torch)[k]
                                                             for k in ("zeros", "ones", "empty", "rand", "randn"))))
        t.start()
        t.join()
        return x + a.sum() + b.numel() + c.numel()

    autobatch(fn, core=core)([torch.ones(1), torch.ones(1)])
    assert seen and all(seen)
    assert other == [True, True]


@pytest.mark.parametrize("core", CORES)
def test_a_factory_saved_and_restored_in_instance_code_stays_torchs(core):
    original = vars(torch)["randn"]

    def fn(x):
        saved = torch.randn
        torch.randn = saved  # (a mock.patch's exit writes what it read back)
        return x * 2

    autobatch(fn, core=core)([torch.ones(1)])
    assert vars(torch)["randn"] is original and torch.randn is original


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", sorted(AS_DIM))
def test_a_lazy_dim_gives_eager_shapes(core, name):
    # before: the signature inferred with the placeholder 0 gave instances with d = 2 the shape
    # of d = 0 (silently), or failed to stack mixed dims with a raw RuntimeError
    make = AS_DIM[name]
    for ds in ([2, 2], [2, 0], [1, 1]):
        assert_matches_eager(make, [torch.tensor(v) for v in ds], [], core=core)


class _Len:
    """An int-like object whose ``__index__`` needs a tensor's value (a wait inside instance code)."""

    def __init__(self, t):
        self.t = t

    def __index__(self):
        return int(self.t.sum().item())


INDEX_OBJECTS = {
    "repeat": lambda x: (x * 1).repeat(_Len(x), 1),
    "new_zeros": lambda x: (x * 1).new_zeros(_Len(x), 2),
    "new_zeros-tuple": lambda x: (x * 1).new_zeros((_Len(x), 2)),
    "expand": lambda x: (x[:1] * 1).expand(_Len(x), -1),
    "pad": lambda x: torch.nn.functional.pad(x * 1, (_Len(x), 0)),
    "shared-repeat": lambda x: W.repeat(_Len(x), 1) * x.sum(),
    "zeros": lambda x: torch.zeros(_Len(x), 2) + x.sum(),
}


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", sorted(INDEX_OBJECTS))
def test_int_like_objects_that_need_values_are_read_in_instance_code(core, name):
    # before: read by torch's parser while the output was inferred, where no value can be waited
    # for: a TypeError, and the caller's thread left with torch functions disabled
    assert_matches_eager(INDEX_OBJECTS[name], [torch.tensor([1.0, 0.0]), torch.tensor([2.0, 1.0])], [], core=core)
    assert torch._C._is_torch_function_enabled()


@pytest.mark.parametrize("core", CORES)
def test_an_error_after_a_wait_inside_disabled_torch_functions_leaves_them_enabled(core):
    def fn(x):
        with torch._C.DisableTorchFunction():
            pass
        n = _Len(x)
        if float(x.sum()) > 2.5:
            raise ValueError("boom")
        return torch.zeros(n, 2)

    with pytest.raises(InstanceError, match="boom"):
        autobatch(fn, core=core)([torch.tensor([1.0, 0.0]), torch.tensor([2.0, 1.0])])
    assert torch._C._is_torch_function_enabled()


@pytest.mark.parametrize("core", CORES)
def test_factories_read_in_instance_code_compare_hash_and_pickle_as_torchs(core):
    import copy
    import pickle

    table = {getattr(torch, k): k for k in ("zeros", "ones", "empty", "rand", "randn")}

    def fn(x):
        fs = [getattr(torch, k) for k in ("zeros", "ones", "empty", "rand", "randn")]
        ok = [f in table for f in fs] + [pickle.loads(pickle.dumps(f)) == f for f in fs]
        ok += [repr(f) == repr(vars(torch)[k]) for f, k in zip(fs, table.values())]
        ok.append(copy.copy(torch.randn)(2, 3).shape == (2, 3))
        return torch.tensor(ok) & (x > 0)

    assert autobatch(fn, core=core)([torch.ones(16, dtype=torch.bool)])[0].all()


@pytest.mark.parametrize("core", CORES)
def test_a_float_first_size_keeps_eagers_error(core):
    def fn(x):
        return torch.ones(x.sum() * 1.0, 2)

    with pytest.raises(TypeError, match="positional argument"):
        fn(torch.ones(2))
    with pytest.raises(InstanceError, match="positional argument"):
        autobatch(fn, core=core)([torch.ones(2)])


TABLE = torch.randn(5, 3)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("base", ["shared", "lazy"])
def test_a_lazy_0d_index_selects_rows_batched_and_as_eager(core, base):
    # a hostile find (stop 49): x[i] with a per-instance 0-d integer ran eagerly for every call
    # (a meta placeholder cannot give torch the int it reads), about 30x slower than eager
    lin = nn.Linear(3, 3)

    def fn(ids):
        t = TABLE if base == "shared" else lin(TABLE)
        return sum(t[i] for i in ids) + t[ids[0]] * 2

    xs = [[torch.tensor(v) for v in ids] for ids in ([0, 4, -1], [2, 2, 3], [1, -5, 0])]
    f = assert_matches_eager(fn, xs, list(lin.parameters()) if base == "lazy" else [], core=core)
    assert f.stats.eager_ops == 0 and f.stats.groups_by_rule.get("getitem", 0) >= 1


@pytest.mark.parametrize("core", CORES)
def test_a_lazy_0d_index_out_of_range_names_the_instance(core):
    def fn(i):
        return TABLE[i] * 2

    with pytest.raises(IndexError):
        fn(torch.tensor(5))
    with pytest.raises(InstanceError, match="out of") as info:
        autobatch(fn, core=core)([torch.tensor(1), torch.tensor(5), torch.tensor(-6)])
    assert info.value.instance == 1


@pytest.mark.parametrize("core", CORES)
def test_a_write_into_a_row_picked_by_a_lazy_index_reaches_the_base(core):
    # (present before: the row was a copy made by the eager run, and the base kept its values)
    def fn(i):
        t = TABLE * 1
        row = t[i]
        row.mul_(10)  # eager: a view, so t changes
        return t

    assert_matches_eager(fn, [torch.tensor(0), torch.tensor(3)], [], core=core)


@pytest.mark.parametrize("core", CORES)
def test_an_op_that_needs_values_is_inferred_once(core, monkeypatch):
    # its output inference fails inside torch (about 0.1 ms a time): the failure is remembered
    # per signature (SignatureCache.values_needed), so later calls run on values at once
    from batchcraft.autobatching import infer

    def fn(x):
        return torch.zeros(x.sum().long() % 3 + 1, 2).sum(0)

    xs = [torch.ones(2), torch.full((2,), 2.0)]
    f = autobatch(fn, core=core)
    f(xs)
    calls = []
    real = infer._infer
    monkeypatch.setattr(infer, "_infer", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    assert [o.tolist() for o in f(xs)] == [fn(x).tolist() for x in xs]
    assert torch.zeros not in calls and f.stats.eager_ops == 2


@pytest.mark.parametrize("core", CORES)
def test_rows_picked_by_a_lazy_index_and_returned_alias_their_tensor(core):
    # a hostile find (stop 49) on #288's fix: batched, the returned E[i] was a copy (eager: a view
    # of E), and so was a returned y[i] of a returned y
    E = torch.zeros(5, 3)

    def picked(i):
        return E[i]

    out = autobatch(picked, core=core)([torch.tensor(1), torch.tensor(3)])
    out[0].fill_(7.0)
    assert E[1].tolist() == [7.0] * 3 and out[1]._base is E

    def row_of_own(x):
        y = x * 2
        return y, y[torch.tensor(1)]

    (y, r), _ = autobatch(row_of_own, core=core)([torch.randn(3, 2), torch.randn(3, 2)])
    y[1, 0] = 100.0
    assert r[0].item() == 100.0


@pytest.mark.parametrize("core", CORES)
def test_setitem_at_a_lazy_index_stays_batched(core):
    def fn(a):
        i, x = a
        y = x * 1
        y[i] = 0.0
        return y

    xs = [(torch.tensor(k % 3), torch.randn(4)) for k in range(6)]
    f = assert_matches_eager(fn, xs, [], core=core)
    assert f.stats.eager_ops == 0


@pytest.mark.parametrize("core", CORES)
def test_a_failing_group_names_the_earliest_instance(core):
    # a hostile find (stop 49): the group's first failing node, not the earliest instance's
    E = torch.randn(5, 3)

    def fn(a):
        steps, i = a
        h = E[0]
        for _ in range(steps):
            h = h * 2
        return E[i] + h

    with pytest.raises(InstanceError) as info:
        autobatch(fn, core=core)([(3, torch.tensor(7)), (0, torch.tensor(9))])
    assert info.value.instance == 0
