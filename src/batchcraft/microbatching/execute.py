"""Execution of a division: run a pass's steps over slices of the batch, and audit their workspace.

Each pass runs a list of *steps* ``(algorithm, micro_batch)`` over consecutive slices of the
batch. forward and backward_data write disjoint slices of a preallocated result; backward_filter
*accumulates* dW over micro-batches (μ-cuDNN's original code was only right when the caller
passed beta = 1; here the sum is explicit, in float32 for 16-bit dtypes). Bias is handled by
the caller (:mod:`batchcraft.microbatching.op`): added once on the whole output, its gradient one
sum, so micro-batching never changes what a sample sees.

Source: μ-cuDNN (arXiv 1804.04806) §III-A (micro-batched execution of the three passes).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from batchcraft.microbatching.algorithms import ConvGeometry, accumulator_dtype, get_algorithm
from batchcraft.microbatching.types import Step

__all__ = ["execute_pass", "execute_step", "WorkspaceAudit", "audited"]


def _slice_args(pass_: str, a: torch.Tensor, b: torch.Tensor, s: int, e: int):
    # forward (x, w) and backward_data (dy, w) split only a; backward_filter (dy, x) splits both
    return (a[s:e], b[s:e]) if pass_ == "backward_filter" else (a[s:e], b)


def execute_step(pass_: str, algorithm: str, a: torch.Tensor, b: torch.Tensor, geom: ConvGeometry,
                 dest: torch.Tensor | None) -> torch.Tensor:
    """One micro-batch of ``pass_``: the whole result if ``dest`` is None, else written into it.

    ``dest`` is the result's slice (forward, backward_data) or the dW accumulator
    (backward_filter), which receives ``+=``.
    """
    algo = get_algorithm(algorithm)
    if (dest is not None and pass_ == "backward_filter" and hasattr(algo, "backward_filter_accumulate")
            and dest.dtype == a.dtype):
        return algo.backward_filter_accumulate(a, b, geom, dest)  # no temporary dW
    r = algo.run(pass_, a, b, geom)
    if dest is None:
        return r
    if pass_ == "backward_filter":
        return dest.add_(r)
    return dest.copy_(r)


def execute_pass(pass_: str, steps: Sequence[Step], a: torch.Tensor, b: torch.Tensor,
                 geom: ConvGeometry) -> torch.Tensor:
    """Run ``pass_`` over the batch with ``steps`` [(algorithm, micro_batch), ...].

    If the batch differs from the planned one, the steps are repeated cyclically and the last
    one is cut short, so no micro-batch is ever larger than planned.
    """
    n = a.shape[0]
    if len(steps) == 1 and steps[0][1] >= n:
        return execute_step(pass_, steps[0][0], a, b, geom, None)
    acc = accumulator_dtype(a.dtype)
    out = None if pass_ == "backward_filter" else a.new_empty(geom.result_shape(pass_, n))
    start, i = 0, 0
    while start < n:
        algorithm, size = steps[i % len(steps)]
        end = min(n, start + size)
        sa, sb = _slice_args(pass_, a, b, start, end)
        if out is None:  # first dW partial becomes the accumulator
            if hasattr(get_algorithm(algorithm), "backward_filter_accumulate") or acc != a.dtype:
                out = torch.zeros(geom.weight_shape(), dtype=acc, device=a.device)
                execute_step(pass_, algorithm, sa, sb, geom, out)
            else:
                out = execute_step(pass_, algorithm, sa, sb, geom, None)
        else:
            execute_step(pass_, algorithm, sa, sb, geom, out if pass_ == "backward_filter" else out[start:end])
        start, i = end, i + 1
    return out.to(a.dtype)


class WorkspaceAudit:
    """Collects the measured peak workspace of every planned layer-pass while active.

    ``with WorkspaceAudit() as audit: model(x).sum().backward()`` then ``audit.peak_bytes``
    maps (layer, pass) to the largest extra bytes seen (result excluded). Slow: profiles each call.
    """

    _active: "WorkspaceAudit | None" = None

    def __init__(self):
        self.peak_bytes: dict[tuple[str, str], int] = {}

    def __enter__(self):
        WorkspaceAudit._active = self
        return self

    def __exit__(self, *exc):
        WorkspaceAudit._active = None

    def run(self, layer: str, passes, fn):
        """Run ``fn`` profiled; record its peak minus its result(s) under each of ``passes``."""
        from batchcraft.microbatching.memory import peak_extra_bytes

        result, peak = peak_extra_bytes(fn)
        results = result if isinstance(result, tuple) else (result,)
        extra = max(0, peak - sum(r.numel() * r.element_size() for r in results if r is not None))
        for pass_ in ([passes] if isinstance(passes, str) else passes):
            key = (layer, pass_)
            self.peak_bytes[key] = max(self.peak_bytes.get(key, 0), extra)
        return result


def audited(layer: str, passes, fn: Callable[[], object]):
    """``fn()``, profiled under the active :class:`WorkspaceAudit` if there is one."""
    audit = WorkspaceAudit._active
    return fn() if audit is None else audit.run(layer, passes, fn)
