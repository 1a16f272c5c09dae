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
