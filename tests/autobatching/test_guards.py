"""Guards a newcomer meets (issue 15 item 8)."""

from __future__ import annotations

import pytest
import torch

from batchcraft import RunStats, autobatch
from batchcraft.errors import UnsupportedOperationError
from equivalence import CORES


def test_one_tensor_where_the_instances_belong_is_a_clear_error():
    f = autobatch(lambda x: x * 2)
    with pytest.raises(TypeError, match=r"sequence of instances.*one Tensor of shape \(4, 3\).*list\(x\)"):
        f(torch.randn(4, 3))
    out = f(list(torch.randn(4, 3)))  # the fix the message names works
    assert len(out) == 4 and out[0].shape == (3,)


def test_stats_are_an_empty_runstats_before_the_first_call():
    f = autobatch(lambda x: x * 2)
    assert isinstance(f.stats, RunStats)
    assert f.stats.instances == 0 and f.stats.batched_calls == 0 and f.stats.fallback_reasons == {}
    f([torch.ones(2)])
    assert f.stats.instances == 1 and f.stats.core in ("c", "python")


def test_bad_options_name_option_and_value():
    for kw, match in ((dict(scheduler="fifo"), "scheduler"), (dict(core="rust"), "core"),
                      (dict(max_pending=0), "max_pending"), (dict(kernels="mkl"), "kernels"),
                      (dict(ragged="yes"), "ragged")):
        with pytest.raises(ValueError, match=match):
            autobatch(lambda x: x, **kw)


@pytest.mark.parametrize("core", CORES)
def test_a_module_built_inside_instance_code_is_a_clear_error(core):
    def f(x):
        lin = torch.nn.Linear(4, 4)  # nn.Parameter(lazy value): the module would keep a lazy value
        return lin(x)

    with pytest.raises(UnsupportedOperationError, match=r"nn\.Parameter made inside instance code"):
        autobatch(f, core=core)([torch.randn(4) for _ in range(2)])


@pytest.mark.parametrize("core", CORES)
def test_an_uninitialized_lazy_module_is_a_clear_error_and_works_after_one_eager_forward(core):
    torch.manual_seed(0)
    m = torch.nn.LazyLinear(3)
    xs = [torch.randn(4) for _ in range(3)]
    f = autobatch(lambda x: m(x), core=core)
    with pytest.raises(UnsupportedOperationError, match=r"uninitialized parameter.*nn\.Lazy"):
        f(xs)
    m(xs[0])  # the fix the hint names
    out = f(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, m(x))
