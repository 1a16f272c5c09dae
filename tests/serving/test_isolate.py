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
    assert calls == [9, 8, 7, 6]   # k failures: k + 1 calls, each without the failed one


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
