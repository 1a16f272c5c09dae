"""The planned convolution as ``torch.library`` custom operators (so torch.compile and torch.export see it).

Two operators in the ``batchcraft`` namespace:

* ``batchcraft::planned_conv2d(x, weight, bias, stride, padding, dilation, groups, layer, plan) -> y``
* ``batchcraft::planned_conv2d_backward(dy, x, weight, stride, padding, dilation, groups, layer, plan,
  output_mask) -> (dx, dw, db)``; an output not asked for by ``output_mask`` is an empty tensor.

``plan`` is the layer's division of every planned pass, encoded as text by :func:`encode_steps`
(``"forward=fft:32,fft:32;backward_data=default:64"``); a pass missing from it was not planned
and refuses to run (no workspace guarantee). ``layer`` names the layer for errors and for
:class:`~batchcraft.microbatching.execute.WorkspaceAudit`. Each operator has a fake (meta)
implementation giving the result's shape, dtype and device without computing, and the forward
has an autograd formula (``register_autograd``) that calls the backward operator, so AOTAutograd
traces both passes. Both are checked with ``torch.library.opcheck`` in the tests. A pass
planned as PyTorch's default, undivided, is exactly PyTorch's call (bias fused; one
``convolution_backward`` for both backward passes when both are).

Source: PyTorch custom operators manual (``torch.library.custom_op``, ``register_fake``,
``register_autograd``, ``opcheck``); μ-cuDNN (arXiv 1804.04806) §III-A for the passes.
"""

from __future__ import annotations

import functools
from typing import Mapping, Optional, Sequence

import torch

from batchcraft.errors import WorkspaceError
from batchcraft.microbatching.algorithms import PASSES, ConvGeometry
from batchcraft.microbatching.execute import audited, execute_pass
from batchcraft.microbatching.types import Step

__all__ = ["encode_steps", "decode_steps", "planned_conv2d", "planned_conv2d_backward", "geometry_of"]


def encode_steps(steps: Mapping[str, Sequence[Step]]) -> str:
    """``{"forward": [("fft", 4), ("im2col", 2)]}`` -> ``"forward=fft:4,im2col:2"`` (passes in PASSES order)."""
    parts = []
    for p in PASSES:
        if p in steps:
            parts.append(p + "=" + ",".join(f"{a}:{int(n)}" for a, n in steps[p]))
    return ";".join(parts)


@functools.lru_cache(maxsize=4096)
def decode_steps(text: str) -> dict[str, tuple[Step, ...]]:
    """Inverse of :func:`encode_steps`."""
    out = {}
    for part in filter(None, text.split(";")):
        p, _, body = part.partition("=")
        out[p] = tuple((a, int(n)) for a, _, n in (s.rpartition(":") for s in body.split(",")))
    return out


def geometry_of(x_shape, w_shape, stride, padding, dilation, groups) -> ConvGeometry:
    """Per-sample geometry of a call from the input (N, C, H, W) and weight (O, C/g, kh, kw) shapes."""
    return ConvGeometry(int(x_shape[1]), int(w_shape[0]), (int(w_shape[2]), int(w_shape[3])),
                        (int(stride[0]), int(stride[1])), (int(padding[0]), int(padding[1])),
                        (int(dilation[0]), int(dilation[1])), int(groups), int(x_shape[2]), int(x_shape[3]))


def _steps(layer: str, plan: str, pass_: str) -> tuple[Step, ...]:
    steps = decode_steps(plan).get(pass_)
    if steps is None:
        raise WorkspaceError(
            f"layer {layer}: pass {pass_} was not planned, so it has no workspace guarantee",
            hint="plan it: microbatch(..., passes='training')")
    return steps


def _plain_default(steps, n: int) -> bool:
    return len(steps) == 1 and steps[0][0] == "default" and steps[0][1] >= n


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy if it is a view (of an algorithm's temporary): autograd forbids in-place use
    (``relu_`` after a convolution) of a custom op's output that is a view."""
    return t if t._base is None else t.clone()


@torch.library.custom_op("batchcraft::planned_conv2d", mutates_args=())
def planned_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: list[int],
                   padding: list[int], dilation: list[int], groups: int, layer: str, plan: str) -> torch.Tensor:
    """Forward of a planned ``Conv2d``: x (N, C, H, W), weight (O, C/g, kh, kw), bias (O,) or None -> (N, O, Ho, Wo)."""
    g = geometry_of(x.shape, weight.shape, stride, padding, dilation, groups)
    steps = _steps(layer, plan, "forward")
    if _plain_default(steps, x.shape[0]):
        # the plan is PyTorch's own call: make it exactly that call (bias fused), no extra pass
        return audited(layer, "forward", lambda: torch.ops.aten.convolution(
            x, weight, bias, list(g.stride), list(g.padding), list(g.dilation), False, [0, 0], g.groups))
    xc, wc = x.contiguous(), weight.contiguous()
    y = _own(audited(layer, "forward", lambda: execute_pass("forward", steps, xc, wc, g)))
    if bias is not None:
        y = y.add_(bias.view(1, -1, 1, 1))
    return y


@planned_conv2d.register_fake
def _planned_conv2d_fake(x, weight, bias, stride, padding, dilation, groups, layer, plan):
    n, _, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = weight.shape[2:], stride, padding, dilation
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return x.new_empty((n, weight.shape[0], ho, wo))


@torch.library.custom_op("batchcraft::planned_conv2d_backward", mutates_args=())
def planned_conv2d_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: list[int],
                            padding: list[int], dilation: list[int], groups: int, layer: str, plan: str,
                            output_mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW, db) of a planned ``Conv2d`` for ``output_mask`` = [dx?, dW?, db?]; the others are empty."""
    g = geometry_of(x.shape, weight.shape, stride, padding, dilation, groups)
    need_x, need_w, need_b = (bool(m) for m in output_mask)
    dy = dy.contiguous()
    n = x.shape[0]
    empty = dy.new_empty(0)
    data = _steps(layer, plan, "backward_data") if need_x else None
    filt = _steps(layer, plan, "backward_filter") if need_w else None
    if (data is None or _plain_default(data, n)) and (filt is None or _plain_default(filt, n)):
        # both passes are PyTorch's default, undivided: one convolution_backward, as autograd would do;
        # its peak is recorded for both passes
        dx, dw, db = audited(layer, [p for p, s in (("backward_data", data), ("backward_filter", filt)) if s],
                             lambda: torch.ops.aten.convolution_backward(
            dy, x, weight, [weight.shape[0]] if need_b else None, list(g.stride), list(g.padding),
            list(g.dilation), False, [0, 0], g.groups, [need_x, need_w, need_b]))
        return (dx if need_x else empty, dw if need_w else empty.clone(), db if need_b else empty.clone())
    dx = dw = db = None
    if need_x:
        wc = weight.contiguous()
        dx = _own(audited(layer, "backward_data", lambda: execute_pass("backward_data", data, dy, wc, g)))
    if need_w:
        xc = x.contiguous()
        dw = _own(audited(layer, "backward_filter", lambda: execute_pass("backward_filter", filt, dy, xc, g)))
    if need_b:
        db = dy.sum((0, 2, 3))
    return (empty.clone() if dx is None else dx, empty.clone() if dw is None else dw,
            empty.clone() if db is None else db)


@planned_conv2d_backward.register_fake
def _planned_conv2d_backward_fake(dy, x, weight, stride, padding, dilation, groups, layer, plan, output_mask):
    shapes = (x.shape, weight.shape, (weight.shape[0],))
    return tuple(dy.new_empty(s if m else (0,)) for s, m in zip(shapes, output_mask))


def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, groups, layer, plan = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = (stride, padding, dilation, groups, layer, plan)
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
    if not any(mask):
        return (None,) * 9
    dx, dw, db = planned_conv2d_backward(dy, x, weight, *ctx.args, mask)
    return (dx if mask[0] else None, dw if mask[1] else None, db if mask[2] else None) + (None,) * 6


planned_conv2d.register_autograd(_backward, setup_context=_setup_context)
