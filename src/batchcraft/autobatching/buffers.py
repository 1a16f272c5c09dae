"""Module buffers changed by instance code: applied once per instance, in instance order.

``BatchNorm`` in train mode normalises each instance with the statistics of its own values and
updates the module's running statistics in place. Batched naively, the running statistics would
be updated group by group (and a vmap of the kernel refuses in-place updates of unbatched
buffers). Here a train-mode ``F.batch_norm`` on a per-instance input with running statistics is
recorded as :func:`batch_norm_train` (normalised output plus the instance's mean and unbiased
variance, batched like any other operation), and the running-statistics updates are kept and
applied after the call, instance by instance in instance order and, within an instance, in the
order they were recorded: the final buffers equal eager's (float32 rounding apart).

Reads of a running statistic inside instance code during the call see its value from before the
call (eager would see earlier instances' updates); ``num_batches_tracked.add_(1)`` (no
per-instance value) runs at once, as in eager.

Source: FIELD-FAULTS.md, "Batch statistics" (giotto-deep #75, yolov5 #1630).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BATCH_NORMS = (F.batch_norm,)


def _dims(rank: int) -> list:
    return [0] + list(range(2, rank))


def _stats(x, dims):
    """Mean and unbiased variance of ``x`` over ``dims`` in float32 at least (eager's batch norm
    accumulates a bfloat16/float16 input in float32, and its running statistics are float32)."""
    xs = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    var_b, mean = torch.var_mean(xs, dims, unbiased=False)
    count = 1
    for d in dims:
        count *= x.shape[d]
    return mean, var_b * (count / max(count - 1, 1))


def batch_norm_train(x, weight, bias, eps: float):
    """Train-mode batch norm of one instance's ``x`` (N, C, *spatial): ``(out, mean, var)``.

    ``out`` is torch's own kernel without running statistics (so its dtype and rounding are
    eager's: a bfloat16 input under autocast gives a bfloat16 output); ``mean`` and ``var``
    (unbiased) are (C,), the statistics the running averages take in.
    """
    out = F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)
    mean, var_u = _stats(x.detach(), _dims(x.dim()))
    return out, mean, var_u


def rule_batch_norm_train(func, struct, leaves, mask, shapes, n):
    """Batched :func:`batch_norm_train`: each instance's channels become channels of their own.

    ``x`` (n, N, C, *spatial) is laid out as (N, n * C, *spatial) and normalised by torch's batch
    norm with the weight and bias repeated per instance: per (instance, channel) statistics,
    the same kernel, dtype and backward as eager's.
    """
    from batchcraft.autobatching.rules import _args, rule_vmap

    args, _ = _args(struct, leaves)
    x, weight, bias, eps = args
    if not mask[0] or any(mask[1:]):
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    rank = len(shapes[0])
    N, C, rest = x.shape[1], x.shape[2], tuple(x.shape[3:])
    xt = x.transpose(0, 1).reshape((N, n * C) + rest)
    w = weight.repeat(n) if weight is not None else None
    b = bias.repeat(n) if bias is not None else None
    out = F.batch_norm(xt, None, None, w, b, True, 0.0, eps).reshape((N, n, C) + rest).transpose(0, 1)
    # laid out as the input, as eager's kernel lays each instance's output (channels_last stays so)
    out = torch.empty_like(x, dtype=out.dtype).copy_(out)
    mean, var_u = _stats(x.detach(), [d + 1 for d in _dims(rank)])
    return out, mean, var_u


def parse_batch_norm(args, kwargs):
    """The arguments of ``F.batch_norm`` as a dict (None when they do not bind)."""
    names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
    defaults = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
    if len(args) > len(names):
        return None
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names or k in bound:
            return None
        bound[k] = v
    for k, v in defaults.items():
        bound.setdefault(k, v)
    if "input" not in bound or "running_mean" not in bound or "running_var" not in bound:
        return None
    return bound


def record_batch_norm(rec, args, kwargs):
    """Record a train-mode batch norm with running statistics (see the module docstring), or
    return NotImplemented when the call is not of that kind."""
    b = parse_batch_norm(args, kwargs)
    if b is None or not b["training"] or type(b["input"]) is not rec.lazy_type:
        return NotImplemented
    rm, rv = b["running_mean"], b["running_var"]
    if not (isinstance(rm, torch.Tensor) and isinstance(rv, torch.Tensor)):
        return NotImplemented
    out, mean, var = rec.record(batch_norm_train, (b["input"], b["weight"], b["bias"], float(b["eps"])), {})
    momentum = b["momentum"]
    rec.deferred.append((rec.instance, mean, var, rm, rv, 0.1 if momentum is None else float(momentum)))
    return out


def apply_deferred(rec) -> None:
    """After the call: the running-statistics updates, instance by instance, in order."""
    if not rec.deferred:
        return
    with torch.no_grad():
        for _, mean, var, rm, rv, m in sorted(rec.deferred, key=lambda d: d[0]):
            rm.mul_(1 - m).add_(rec.resolve(mean).to(rm.dtype), alpha=m)
            rv.mul_(1 - m).add_(rec.resolve(var).to(rv.dtype), alpha=m)


__all__ = ["batch_norm_train", "record_batch_norm", "apply_deferred", "rule_batch_norm_train"]
