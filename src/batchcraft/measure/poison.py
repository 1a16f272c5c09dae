"""Checking a kernel's values against a reference without trusting reused memory.

A kernel that leaves some output rows unwritten (torch's oneDNN linear under
``OMP_THREAD_LIMIT`` below the thread count, or ``OMP_DYNAMIC=true``: reliability #211) returns
whatever the allocator's reused block held. When that block held the same product, computed just
before by the reference or by another candidate, the check passes on garbage. :func:`fresh_inputs`
gives every check inputs no earlier check used, :func:`poisoned_call` frees a NaN block of the
output's size right before the call (unwritten rows then tend to read NaN), and the reference is
computed after the call, never before it.
"""

from __future__ import annotations

import itertools

import torch

_seeds = itertools.count(0x5EED)


def fresh_inputs(*shapes) -> list:
    """Uniform [-0.5, 0.5) float32 tensors of ``shapes``, different from every earlier call's, from a
    private generator (the caller's random state does not move)."""
    g = torch.Generator().manual_seed(next(_seeds))
    return [torch.rand(s, generator=g) - 0.5 for s in shapes]


def poisoned_call(like: torch.Tensor, fn):
    """``fn()``, called right after a NaN tensor shaped like ``like`` was freed (see the module
    docstring); returns what ``fn`` returns."""
    poison = torch.full_like(like, float("nan"))
    del poison
    return fn()


__all__ = ["poisoned_call", "fresh_inputs"]
