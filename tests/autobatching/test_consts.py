"""Constant factories in instance code (consts.py): ``torch.zeros((1, h))``, ``torch.full``,
``torch.arange``, ``torch.eye`` are leaves standing for a copy of one template per distinct call,
with eager's values, dtypes, errors and gradients, and no template ever reaching the caller."""

from __future__ import annotations

import math

import pytest
import torch

from batchcraft import autobatch
from batchcraft.autobatching import consts
from batchcraft.errors import InstanceError

from equivalence import CORES, assert_matches_eager, general_path_calls

FACTORIES = {
    "zeros-ints": lambda i: torch.zeros(1, 4),
    "zeros-tuple": lambda i: torch.zeros((2, 3)),
    "zeros-list": lambda i: torch.zeros([3]),
    "zeros-size": lambda i: torch.zeros(torch.Size([2, 2])),
    "zeros-0d": lambda i: torch.zeros(()),
    "ones-float64": lambda i: torch.ones(2, dtype=torch.float64),
    "full-float": lambda i: torch.full((3,), 2.5),
    "full-bool": lambda i: torch.full((2,), True),
    "full-int": lambda i: torch.full((2,), 7),
    "full-negative-zero": lambda i: torch.full((2,), -0.0),
    "full-zero": lambda i: torch.full((2,), 0.0),
    "full-nan": lambda i: torch.full((2,), math.nan),
    "arange-per-instance": lambda i: torch.arange(i + 1),
    "arange-floats": lambda i: torch.arange(1.0, 3.0, 0.5),
    "eye": lambda i: torch.eye(3),
    "eye-int": lambda i: torch.eye(2, dtype=torch.int64),
    "device-kw": lambda i: torch.zeros(2, device="cpu"),
}


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    if a.is_floating_point():  # -0.0 and 0.0: the sign bits too
        assert torch.equal(torch.signbit(a), torch.signbit(b))


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_constant_factories_equal_eager(core, name):
    make = FACTORIES[name]

    def fn(i):
        t = make(i)
        return t, t + t if t.dtype is not torch.bool else t & t

    xs = [0, 1, 2, 3]
    for _ in range(2):  # (the second call finds the templates)
        for out, i in zip(autobatch(fn, core=core)(xs), xs):
            ref = fn(i)
            _same(out[0], ref[0])
            _same(out[1], ref[1])


@pytest.mark.parametrize("core", CORES)
def test_the_default_dtype_of_each_instance_is_part_of_the_key(core):
    def fn(wide):
        if wide:
            torch.set_default_dtype(torch.float64)
        try:
            return torch.zeros(2) + 1, torch.arange(0.0, 1.0, 0.5)
        finally:
            torch.set_default_dtype(torch.float32)

    for out, w in zip(autobatch(fn, core=core)([False, True, False, True]), [False, True, False, True]):
        ref = fn(w)
        assert out[0].dtype == ref[0].dtype and out[1].dtype == ref[1].dtype


@pytest.mark.parametrize("core", CORES)
def test_outputs_and_in_place_updates_never_touch_the_template_or_each_other(core):
    def fn(i):
        h = torch.zeros(3)
        h += i                 # in place on the constant's leaf
        g = torch.ones(2)
        g[0] = i * 10          # an indexed write
        return h, g, torch.full((2,), 5.0)

    xs = [1, 2, 3]
    f = autobatch(fn, core=core)
    for _ in range(2):
        out = f(xs)
        for o, i in zip(out, xs):
            assert o[0].tolist() == [i] * 3 and o[1].tolist() == [i * 10, 1]
        out[0][2].add_(100)    # the caller writes one output
        assert out[1][2].tolist() == [5.0, 5.0] and out[0][2].tolist() == [105.0, 105.0]
    assert torch.zeros(3).tolist() == [0.0] * 3 and torch.full((2,), 5.0).tolist() == [5.0, 5.0]


@pytest.mark.parametrize("core", CORES)
def test_gradients_through_constant_leaves_equal_eager(core):
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)

    def fn(x):
        h = torch.zeros(4)
        for k in range(len(x)):
            h = torch.tanh(h * w + x[k])
        mask = torch.arange(4) < len(x)
        s = torch.ones(4).requires_grad_()
        return torch.where(mask, h, torch.full((4,), -1.0)) * s

    xs = [torch.randn(n) for n in (1, 3, 2, 4)]
    assert_matches_eager(fn, xs, [w], core=core)


@pytest.mark.parametrize("core", CORES)
def test_large_constants_and_errors_as_in_eager(core):
    big = consts.MAX_CONST_BYTES // 4 + 1  # float32 elements: over the limit, made per call

    def fn(i):
        if i == 2:
            torch.zeros(-1)
        return torch.ones(big)[i] + torch.arange(i + 2).sum()

    with pytest.raises(InstanceError, match="negative") as info:
        autobatch(fn, core=core)([0, 1, 2, 3])
    assert info.value.instance == 2
    out = autobatch(fn, core=core)([0, 1, 3])
    assert [o.item() for o in out] == [fn(i).item() for i in (0, 1, 3)]


def test_keys_tell_apart_calls_with_different_results():
    zeros = torch.zeros
    k = consts.key
    assert k(zeros, (2, 3), None) == k(zeros, (2, 3), {})
    assert k(zeros, (2, 3), None) != k(zeros, ((2, 3),), None)  # (both fine: separate templates)
    assert k(torch.full, ((2,), 1), None) != k(torch.full, ((2,), True), None)
    assert k(torch.full, ((2,), 1), None) != k(torch.full, ((2,), 1.0), None)
    assert k(torch.full, ((2,), 0.0), None) != k(torch.full, ((2,), -0.0), None)
    assert k(zeros, (2,), {"dtype": torch.float64}) != k(zeros, (2,), None)
    assert k(torch.full, ((2,), math.nan), None) is None  # never equal to itself: made per call
    assert k(zeros, (2,), {"requires_grad": True}) is None
    assert k(zeros, (torch.tensor(2),), None) is None
    assert k(zeros, (2,), {"out": None}) is None


def test_steady_calls_make_constants_without_the_general_path(monkeypatch):
    # each torch.zeros((1, h)) / torch.full / torch.arange took the general path: the mode, a
    # signature lookup and a tensor made per call (12-14 µs; about 3 µs now)
    from batchcraft.autobatching import _native

    if not _native.available:
        pytest.skip("the C core was not built")

    def fn(x):
        h = torch.zeros((1, 3))
        pos = torch.arange(len(x))
        return (h + torch.full((1, 3), 0.5)).sum() + (x * pos).sum() + torch.eye(3).sum() + torch.zeros(2, 2).sum()

    xs = [torch.randn(n) for n in (1, 3, 2)]
    out, calls = general_path_calls(fn, xs, monkeypatch)
    assert calls == []
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, fn(x))


@pytest.mark.parametrize("core", CORES)
def test_factories_with_tensor_arguments_device_contexts_and_other_spellings(core):
    from torch import zeros as module_level_zeros  # bound outside the call: the real function

    def fn(x):
        a = torch.full((2,), x.sum())            # a tensor fill value: not a constant
        b = torch.arange(x.shape[0], dtype=torch.float32)
        with torch.device("cpu"):
            c = torch.ones(2)                    # under a device context
        d = module_level_zeros(2) + getattr(torch, "eye")(2)[0]
        e = torch.zeros(2, dtype=None) + torch.zeros(size=(2,))
        return a, b.sum(), c, d, e

    xs = [torch.randn(n) for n in (1, 3, 2)]
    for _ in range(2):
        for out, x in zip(autobatch(fn, core=core)(xs), xs):
            for o, r in zip(out, fn(x)):
                _same(o, r)


@pytest.mark.parametrize("core", CORES)
def test_a_constant_read_by_one_instance_is_a_copy_never_the_template(core):
    # reliability #254: one leaf of a constant was `template.expand((1, ...)).contiguous()`, the
    # template itself; a view of it reached the caller (and `.numpy()` inside instance code)
    f = autobatch(lambda i: torch.zeros(2, 3)[0], core=core)
    out = f([0])
    out[0].add_(7)  # the caller writes its output
    assert torch.zeros(2, 3).sum() == 0
    g = autobatch(lambda i: torch.zeros(2, 3) + i, core=core)
    assert [o.sum().item() for o in g([0, 1])] == [0.0, 6.0]
    assert f([0])[0].tolist() == [0.0, 0.0, 0.0]

    def writes_numpy(i):
        a = torch.zeros(2, 3)[0].numpy()
        a[0] = 5
        return torch.zeros(2, 3).sum() + i

    assert [o.item() for o in autobatch(writes_numpy, core=core)([0])] == [0.0]
    mixed = autobatch(lambda i: torch.zeros(2, 3)[0] if i == 0 else torch.ones(4) * i, core=core)
    mixed(list(range(6)))[0].fill_(5)
    assert [o.sum().item() for o in g([0, 1, 2])] == [0.0, 6.0, 12.0]


@pytest.mark.parametrize("core", CORES)
def test_a_template_made_under_inference_mode_serves_later_calls_with_autograd(core):
    # reliability #255: the template was an inference tensor; a later grad-mode call could not
    # save it for backward, and an output of it said is_inference() where eager's does not
    consts.clear()  # (templates are kept for the process: these must be made here first)
    w = torch.nn.Parameter(torch.randn(3))
    with torch.inference_mode():
        autobatch(lambda i: (torch.full((3,), 0.25) + i, torch.eye(3) + i), core=core)([0, 1])

    def fn(i):
        return (torch.full((3,), 0.25) * w).sum() + (torch.eye(3)[0] @ w) * i

    out = autobatch(fn, core=core)([0])
    ref = [fn(i) for i in (0,)]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    gw = torch.autograd.grad(sum(out), w)[0]
    torch.testing.assert_close(gw, torch.autograd.grad(sum(ref), w)[0])
    alone = autobatch(lambda i: torch.eye(3)[0], core=core)([0])[0]
    assert not alone.is_inference()
