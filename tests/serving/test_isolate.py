"""run_isolated: a failing instance fails only its own request; the others are retried."""

from __future__ import annotations

import pytest
import torch

import batchcraft
from batchcraft.serving import run_isolated

LIN = torch.nn.Linear(3, 2)


def per_instance(x):
    if float(x[0]) > 100:
        raise ValueError(f"bad input {float(x[0])}")
    return torch.tanh(LIN(x))


def test_each_request_gets_its_own_value_or_error():
    torch.manual_seed(0)
    xs = [torch.randn(3) for _ in range(9)]
    for i in (2, 5, 8):
        xs[i][0] = 1000 + i
    calls = []
    f = batchcraft.autobatch(per_instance)

    def counted(batch):
        calls.append(len(batch))
        return f(batch)

    out = run_isolated(counted, xs)
    for i, (x, o) in enumerate(zip(xs, out)):
        if i in (2, 5, 8):
            assert isinstance(o.error, ValueError) and f"{1000 + i}" in str(o.error)   # its own error
            with pytest.raises(ValueError):
                o.unwrap()
        else:
            assert o.error is None
            torch.testing.assert_close(o.value, per_instance(x))
    # k failures: at most k + 1 calls; the requests before a failing one ran to their end in
    # that call (the error carries their results), so each call runs only those after it
    assert calls == [9, 6, 3]


def test_error_without_instance_fails_the_whole_batch():
    def broken(batch):
        raise MemoryError("out of memory")

    out = run_isolated(broken, [1, 2, 3])
    assert all(isinstance(o.error, MemoryError) for o in out)


def test_outputs_are_own_copies_without_grad():
    f = batchcraft.autobatch(per_instance)
    out = run_isolated(f, [torch.randn(3) for _ in range(4)])
    for o in out:
        assert o.value._base is None and not o.value.requires_grad
        assert o.value.untyped_storage().nbytes() == 2 * 4


def test_wrong_number_of_results():
    out = run_isolated(lambda b: b[:-1], [1, 2])
    assert all("returned 1 results for 2" in str(o.error) for o in out)


@pytest.mark.parametrize("fibers", [True, False])
def test_requests_before_a_failing_one_run_once(fibers):
    # hostile pass (stop 46): after #229's fix, a failed call leaves the in-place writes of the
    # requests before the failing one done (as eager does); rerunning them wrote them twice
    def fn(x):
        with torch.no_grad():
            x.add_(1)
        if float(x.sum()) > 1e6 or float(x[0]) > 100:  # (a value wait, then a value-dependent raise)
            raise ValueError("bad")
        return x * 2

    xs = [torch.zeros(2), torch.ones(2), torch.full((2,), 500.0), torch.ones(2) * 3]
    before = [x.clone() for x in xs]
    calls = []
    f = batchcraft.autobatch(fn, fibers=fibers)

    def counted(batch):
        calls.append(len(batch))
        return f(batch)

    out = run_isolated(counted, xs)
    for x, b in zip(xs, before):
        torch.testing.assert_close(x, b + 1)  # each request's write once, the failing one's too
    assert isinstance(out[2].error, ValueError)
    for k in (0, 1, 3):
        torch.testing.assert_close(out[k].value, 2 * (before[k] + 1))
    assert calls == [4, 1]


def test_a_nested_calls_error_names_the_outer_request():
    # hostile pass (stop 46): an inline nested call's InstanceError named its inner instance, and
    # run_isolated gave that error to the wrong request
    inner = batchcraft.autobatch(per_instance)

    def outer(x):
        return inner([x, x + 1, x - 5])[0].sum()

    xs = [torch.zeros(3), torch.full((3,), 200.0), torch.ones(3)]
    with pytest.raises(batchcraft.errors.InstanceError) as info:
        batchcraft.autobatch(outer)(xs)
    assert info.value.instance == 1
    out = run_isolated(batchcraft.autobatch(outer), xs)
    assert out[0].error is None and out[2].error is None and out[1].error is not None
    torch.testing.assert_close(out[2].value, per_instance(xs[2]).sum())
