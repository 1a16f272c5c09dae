"""The default dtype in static blocks (dtypes.py, reliability #271): a block's factory steps make
the dtype eager's call made, whatever the default when the program runs."""

from __future__ import annotations

import pytest
import torch

from batchcraft import autobatch, static_block
from batchcraft.autobatching.dtypes import with_default_dtype

from equivalence import CORES


@pytest.fixture(autouse=True)
def _float32_after():
    yield
    torch.set_default_dtype(torch.float32)


@static_block
def made_in_block(x):
    return (torch.zeros(2) + x.float().sum(), torch.tensor(1.5) * 2, torch.arange(3.0) + 1,
            torch.full((2,), 1) + 1, torch.ones(2, dtype=torch.float16) * 3)


def _dtypes_and_values(out):
    return [(t.dtype, t.tolist()) for t in out]


def _in_float64(x):
    torch.set_default_dtype(torch.float64)
    try:
        return made_in_block(x)
    finally:
        torch.set_default_dtype(torch.float32)  # restored before the flush runs the block


@pytest.mark.parametrize("core", CORES)
def test_a_default_set_in_instance_code_reaches_the_blocks_factories(core):
    # before: float32 (the default when the program ran), where eager makes float64
    xs = [torch.ones(2), torch.full((2,), 2.0)]
    eager = [_dtypes_and_values(_in_float64(x)) for x in xs]
    assert eager[0][0][0] == torch.float64 and eager[0][3][0] == torch.int64
    assert [_dtypes_and_values(o) for o in autobatch(_in_float64, core=core)(xs)] == eager


@pytest.mark.parametrize("core", CORES)
def test_a_block_traced_under_one_default_is_traced_again_under_another(core):
    def fn(x):
        return made_in_block(x), _in_float64(x), made_in_block(x)

    xs = [torch.ones(2), torch.full((2,), 3.0)]
    eager = [[_dtypes_and_values(part) for part in fn(x)] for x in xs]
    assert [[_dtypes_and_values(part) for part in o] for o in autobatch(fn, core=core)(xs)] == eager
    # across calls: the default set before a call
    f = autobatch(made_in_block, core=core)
    assert [_dtypes_and_values(o) for o in f(xs)] == [_dtypes_and_values(made_in_block(x)) for x in xs]
    torch.set_default_dtype(torch.float64)
    second = [_dtypes_and_values(o) for o in f(xs)]
    assert second == [_dtypes_and_values(made_in_block(x)) for x in xs] and second[0][0][0] == torch.float64


@pytest.mark.parametrize("core", CORES)
def test_set_default_dtype_is_torchs_own_again_after_a_call(core):
    original = vars(torch)["set_default_dtype"]
    autobatch(_in_float64, core=core)([torch.ones(2)])
    assert torch.set_default_dtype is original and torch.get_default_dtype() == torch.float32


def test_with_default_dtype_adds_only_what_the_default_decides():
    torch.set_default_dtype(torch.float64)
    assert with_default_dtype(torch.zeros, ((2,),), {}) == {"dtype": torch.float64}
    assert with_default_dtype(torch.tensor, (1.5,), {}) == {"dtype": torch.float64}
    assert with_default_dtype(torch.tensor, (1j,), {}) == {"dtype": torch.complex128}
    assert with_default_dtype(torch.arange, (3,), {}) == {}  # int64 whatever the default
    assert with_default_dtype(torch.full, ((2,), 1), {}) == {}
    assert with_default_dtype(torch.zeros, ((2,),), {"dtype": torch.int8}) == {"dtype": torch.int8}
    assert with_default_dtype(torch.sigmoid, (torch.ones(1),), {}) == {}  # not a factory
    assert with_default_dtype(torch.zeros, ("bad",), {}) == {}  # eager's error is raised at the step


@static_block
def random_in_block(x):
    return torch.randn(2) + x, torch.normal(0.0, 1.0, (2,))


@pytest.mark.parametrize("core", CORES)
def test_normal_in_a_block_takes_the_default_dtype(core):
    # a hostile find (stop 49): torch.normal(mean, std, size) is not in torch's list of factories
    def fn(x):
        torch.set_default_dtype(torch.float64)
        try:
            return random_in_block(x)
        finally:
            torch.set_default_dtype(torch.float32)

    assert [[t.dtype for t in o] for o in autobatch(fn, core=core)([torch.ones(2), torch.ones(2)])] == \
        [[t.dtype for t in fn(torch.ones(2))]] * 2 == [[torch.float64, torch.float64]] * 2


@static_block
def cast_to_autocast_dtype(x):
    return x.to(torch.get_autocast_dtype("cpu"))


@pytest.mark.parametrize("core", CORES)
def test_a_block_reading_autocast_dtype_while_off_follows_set_autocast_dtype(core):
    # reliability #263: the block kept its first trace (autocast's dtypes were in its trace key
    # only while autocast was on)
    def fn(x):
        a = cast_to_autocast_dtype(x)
        torch.set_autocast_dtype("cpu", torch.float16)
        try:
            return a, cast_to_autocast_dtype(x * 1)
        finally:
            torch.set_autocast_dtype("cpu", torch.bfloat16)

    xs = [torch.ones(2), torch.ones(2)]
    assert [[t.dtype for t in o] for o in autobatch(fn, core=core)(xs)] == [[t.dtype for t in fn(x)] for x in xs]
    f = autobatch(cast_to_autocast_dtype, core=core)
    assert [o.dtype for o in f(xs)] == [torch.bfloat16] * 2
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        assert [o.dtype for o in f(xs)] == [torch.float16] * 2
    finally:
        torch.set_autocast_dtype("cpu", torch.bfloat16)
