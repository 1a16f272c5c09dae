"""Kernel checks that do not trust reused memory (measure/poison.py, reliability #211)."""

from __future__ import annotations

import torch

from batchcraft.measure.poison import fresh_inputs, poisoned_call


def test_fresh_inputs_differ_per_call_and_leave_the_random_state():
    before = torch.random.get_rng_state()
    a, b = fresh_inputs((4, 3), (2,))
    (c,) = fresh_inputs((4, 3))
    assert a.shape == (4, 3) and b.shape == (2,) and not torch.equal(a, c)
    assert a.min() >= -0.5 and a.max() < 0.5
    assert torch.equal(before, torch.random.get_rng_state())


def test_a_kernel_that_returns_an_earlier_products_rows_fails_the_check():
    """The protocol of the kernel checks: fresh inputs per check, the reference after the call. A
    kernel that leaves its rows as an earlier call wrote them (here: literally returns them) passes
    only the check whose product it happens to hold."""
    stale: dict = {}

    def lazy_kernel(x, w):
        if "out" not in stale:
            stale["out"] = x @ w.t()
        return stale["out"]

    def check(kernel):
        x, w = fresh_inputs((8, 4), (3, 4))
        got = poisoned_call(torch.empty(8, 3), lambda: kernel(x, w))
        return torch.allclose(got, x @ w.t())

    assert check(lazy_kernel)
    assert not check(lazy_kernel)
    assert check(lambda x, w: x @ w.t()) and check(lambda x, w: x @ w.t())
