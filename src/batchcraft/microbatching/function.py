"""Execution of a plan: a custom autograd Function and the module that replaces ``Conv2d``.

Each pass runs a list of *steps* ``(algorithm, micro_batch)`` over consecutive slices of the
batch. forward and backward_data write disjoint slices of a preallocated result; backward_filter
*accumulates* dW over micro-batches (μ-cuDNN's original code was only right when the caller
passed beta = 1; here the sum is explicit). Bias is added once on the whole output and its
gradient is one sum, so micro-batching never changes what a sample sees.

Source: μ-cuDNN (arXiv 1804.04806) §III-A (micro-batched execution of the three passes).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from batchcraft.errors import WorkspaceError
from batchcraft.microbatching.algorithms import ConvGeometry, get_algorithm

__all__ = ["execute_pass", "execute_step", "PlannedConv2d", "WorkspaceAudit"]


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
    if dest is not None and pass_ == "backward_filter" and hasattr(algo, "backward_filter_accumulate"):
        return algo.backward_filter_accumulate(a, b, geom, dest)  # no temporary dW
    r = algo.run(pass_, a, b, geom)
    if dest is None:
        return r
    if pass_ == "backward_filter":
        return dest.add_(r)
    return dest.copy_(r)


def execute_pass(pass_: str, steps: Sequence[tuple[str, int]], a: torch.Tensor, b: torch.Tensor,
                 geom: ConvGeometry) -> torch.Tensor:
    """Run ``pass_`` over the batch with ``steps`` [(algorithm, micro_batch), ...].

    If the batch differs from the planned one, the steps are repeated cyclically and the last
    one is cut short, so no micro-batch is ever larger than planned.
    """
    n = a.shape[0]
    if len(steps) == 1 and steps[0][1] >= n:
        return execute_step(pass_, steps[0][0], a, b, geom, None)
    out = None if pass_ == "backward_filter" else a.new_empty(geom.result_shape(pass_, n))
    start, i = 0, 0
    while start < n:
        algorithm, size = steps[i % len(steps)]
        end = min(n, start + size)
        sa, sb = _slice_args(pass_, a, b, start, end)
        if out is None:  # first dW partial becomes the accumulator
            if hasattr(get_algorithm(algorithm), "backward_filter_accumulate"):
                out = torch.zeros(geom.weight_shape(), dtype=a.dtype, device=a.device)
                execute_step(pass_, algorithm, sa, sb, geom, out)
            else:
                out = execute_step(pass_, algorithm, sa, sb, geom, None)
        else:
            execute_step(pass_, algorithm, sa, sb, geom, out if pass_ == "backward_filter" else out[start:end])
        start, i = end, i + 1
    return out


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


def _audited(layer: str, passes, fn):
    audit = WorkspaceAudit._active
    return fn() if audit is None else audit.run(layer, passes, fn)


def _run(layer: str, pass_: str, steps, a, b, geom):
    if steps is None:
        raise WorkspaceError(
            f"layer {layer}: pass {pass_} was not planned, so it has no workspace guarantee",
            hint="plan it: microbatch(..., passes='training')")
    a = a.contiguous()
    return _audited(layer, pass_, lambda: execute_pass(pass_, steps, a, b.contiguous(), geom))


def _is_plain_default(steps, n: int) -> bool:
    return steps is not None and len(steps) == 1 and steps[0][0] == "default" and steps[0][1] >= n


def _default_conv(x, weight, bias, g: ConvGeometry):
    return torch.ops.aten.convolution(x, weight, bias, list(g.stride), list(g.padding), list(g.dilation),
                                      False, [0, 0], g.groups)


class _PlannedConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module):
        g, steps = module.geometry, module.steps.get("forward")
        if _is_plain_default(steps, x.shape[0]):
            # the plan is PyTorch's own call: make it exactly that call (bias fused), no extra pass
            y = _audited(module.layer_name, "forward", lambda: _default_conv(x, weight, bias, g))
        else:
            y = _run(module.layer_name, "forward", steps, x, weight, g)
            if bias is not None:
                y = y.add_(bias.view(1, -1, 1, 1))
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.has_bias = module, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        m = ctx.module
        dy = dy.contiguous()
        dx = dw = db = None
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        plain = [_is_plain_default(m.steps.get(p), x.shape[0]) for p in ("backward_data", "backward_filter")]
        if (plain[0] or not need_x) and (plain[1] or not need_w):
            # both passes are PyTorch's default, undivided: one convolution_backward, as autograd
            # would do; its peak is recorded for both passes
            g = m.geometry
            dx, dw, db = _audited(m.layer_name, [p for p, need in (("backward_data", need_x),
                                                                   ("backward_filter", need_w)) if need],
                                  lambda: torch.ops.aten.convolution_backward(
                dy, x, weight, [weight.shape[0]] if need_b else None, list(g.stride), list(g.padding),
                list(g.dilation), False, [0, 0], g.groups, [need_x, need_w, need_b]))
            return dx, dw, db, None
        if need_x:
            dx = _run(m.layer_name, "backward_data", m.steps.get("backward_data"), dy, weight, m.geometry)
        if need_w:
            dw = _run(m.layer_name, "backward_filter", m.steps.get("backward_filter"), dy, x, m.geometry)
        if need_b:
            db = dy.sum((0, 2, 3))
        return dx, dw, db, None


class PlannedConv2d(nn.Module):
    """Drop-in replacement for one ``Conv2d`` that runs its planned micro-batches.

    Shares the original's ``weight`` and ``bias`` Parameters (same objects), so optimisers and
    state dicts see no change. Input (N, C, H, W) -> output (N, O, Ho, Wo), equal to the
    original ``Conv2d`` within float32 rounding of the chosen algorithms.

    Args:
        conv (nn.Conv2d): the layer replaced; zero padding only.
        layer_name (str): qualified name in the model (for errors and the plan table).
        geometry (ConvGeometry): per-sample geometry the plan was made for.
        steps (dict[str, list[tuple[str, int]]]): per pass, [(algorithm, micro_batch), ...].
    """

    def __init__(self, conv: nn.Conv2d, layer_name: str, geometry: ConvGeometry,
                 steps: dict[str, list[tuple[str, int]]]):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.layer_name, self.geometry, self.steps = layer_name, geometry, dict(steps)
        self.original = [conv]  # list: not registered as a submodule (no duplicate parameters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[1:]) != (self.geometry.in_channels, self.geometry.height, self.geometry.width):
            raise WorkspaceError(
                f"layer {self.layer_name}: planned for input (N, {self.geometry.in_channels}, "
                f"{self.geometry.height}, {self.geometry.width}), got {tuple(x.shape)}",
                hint="plan again with an example input of this size")
        return _PlannedConvFunction.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return f"{self.layer_name}: {self.geometry.key()}, " + ", ".join(
            f"{p}={'+'.join(f'{a}x{n}' for a, n in s)}" for p, s in self.steps.items())
