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

``F.instance_norm`` with input statistics and running statistics (``InstanceNorm*`` with
``track_running_stats=True`` in train mode) is handled the same way (:func:`instance_norm_train`).

Source: FIELD-FAULTS.md, "Batch statistics" (giotto-deep #75, yolov5 #1630).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BATCH_NORMS = (F.batch_norm,)
INSTANCE_NORMS = (F.instance_norm,)


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


def instance_norm_train(x, weight, bias, eps: float):
    """Instance norm of one instance's ``x`` (N, C, *spatial) with input statistics:
    ``(out, mean, var)``; ``mean`` and ``var`` (C,) are what eager's running averages take in,
    the per-sample channel means and unbiased variances averaged over N (``F.instance_norm``
    runs batch norm over (1, N * C, *spatial) and averages the N running copies)."""
    out = F.instance_norm(x, None, None, weight, bias, True, 0.0, eps)
    mean, var_u = _stats(x.detach().unsqueeze(0), list(range(3, x.dim() + 1)))  # (1, N, C) -> per sample
    return out, mean[0].mean(0), var_u[0].mean(0)


def rule_instance_norm_train(func, struct, leaves, mask, shapes, n):
    """Batched :func:`instance_norm_train`: per-sample statistics do not mix instances, so the
    instances' samples are one larger batch of samples."""
    from batchcraft.autobatching.rules import _args, rule_vmap

    args, _ = _args(struct, leaves)
    x, weight, bias, eps = args
    if not mask[0] or any(mask[1:]):
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    flat = x.reshape((-1,) + tuple(x.shape[2:]))
    out = F.instance_norm(flat, None, None, weight, bias, True, 0.0, eps).reshape(x.shape)
    spatial = list(range(3, x.dim()))
    mean, var_u = _stats(x.detach(), spatial)  # (n, N, C)
    return out, mean.mean(1), var_u.mean(1)


def _bind(names, defaults, required, args, kwargs):
    """``args``/``kwargs`` bound to ``names`` with ``defaults`` (None when they do not bind or a
    ``required`` name is missing)."""
    if len(args) > len(names):
        return None
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names or k in bound:
            return None
        bound[k] = v
    for k, v in defaults.items():
        bound.setdefault(k, v)
    return bound if all(k in bound for k in required) else None


_INSTANCE_NORM = (("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps"),
                  {"running_mean": None, "running_var": None, "weight": None, "bias": None,
                   "use_input_stats": True, "momentum": 0.1, "eps": 1e-5}, ("input",))
_BATCH_NORM = (("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
               {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5},
               ("input", "running_mean", "running_var"))


def parse_instance_norm(args, kwargs):
    """The arguments of ``F.instance_norm`` as a dict (None when they do not bind)."""
    return _bind(*_INSTANCE_NORM, args, kwargs)


def record_instance_norm(rec, args, kwargs):
    """Record an instance norm that updates running statistics (``use_input_stats`` with
    ``running_mean``/``running_var``) as :func:`instance_norm_train` plus the updates, applied
    as for batch norm (:func:`apply_deferred`); NotImplemented for any other call."""
    b = parse_instance_norm(args, kwargs)
    if b is None or not b["use_input_stats"] or type(b["input"]) is not rec.lazy_type:
        return NotImplemented
    rm, rv = b["running_mean"], b["running_var"]
    lazy = rec.lazy_type
    if rm is None or rv is None or not all(isinstance(t, torch.Tensor) or type(t) is lazy for t in (rm, rv)):
        return NotImplemented
    momentum = float(b["momentum"])
    out, mean, var = rec.record(instance_norm_train, (b["input"], b["weight"], b["bias"], float(b["eps"])), {})
    _update(rec, ((rm, mean), (rv, var)), momentum, None)
    return out


def parse_batch_norm(args, kwargs):
    """The arguments of ``F.batch_norm`` as a dict (None when they do not bind)."""
    return _bind(*_BATCH_NORM, args, kwargs)


_SCALAR_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.bfloat16: "BFloat16", torch.float16: "Half"}


def _check_stat_dtypes(x, rm, rv) -> None:
    """Eager's CPU rule: running statistics have the input's dtype, or float32 for a bfloat16 /
    float16 input (raised at record time, as eager raises at the call)."""
    if x.device.type != "cpu":
        return
    allowed = (x.dtype, torch.float32) if x.dtype in (torch.bfloat16, torch.float16) else (x.dtype,)
    for t in (rm, rv):
        if t.dtype not in allowed:
            want = "Float" if x.dtype in (torch.bfloat16, torch.float16) else _SCALAR_NAMES.get(x.dtype, str(x.dtype))
            raise RuntimeError(f"mixed dtype (CPU): expect parameter to have scalar type of {want}")


def record_batch_norm(rec, args, kwargs):
    """Record a train-mode batch norm with running statistics (see the module docstring), or
    return NotImplemented when the call is not of that kind.

    Running statistics made inside the instance (lazy values) are updated there and then, as
    recorded in-place operations of that instance; shared ones (a module's buffers) are kept for
    :func:`apply_deferred`.

    Raises:
        TypeError: ``momentum=None``, as eager's ``F.batch_norm`` does (``nn.BatchNorm`` passes
            its cumulative factor as a float).
    """
    b = parse_batch_norm(args, kwargs)
    if b is None or not b["training"] or type(b["input"]) is not rec.lazy_type:
        return NotImplemented
    rm, rv = b["running_mean"], b["running_var"]
    lazy = rec.lazy_type
    if not all(isinstance(t, torch.Tensor) or type(t) is lazy for t in (rm, rv)):
        return NotImplemented
    momentum = b["momentum"]
    if momentum is None:
        raise TypeError("batch_norm(): argument 'momentum' (position 7) must be float, not NoneType")
    _check_stat_dtypes(b["input"], rm, rv)
    momentum = float(momentum)
    read = rec.counter_read  # nn.BatchNorm's cumulative factor: 1.0 / float(num_batches_tracked)
    c = read[1] if read is not None and read[0] == rec.instance else None
    counted = c if (type(c) is float and c > 0 and 1.0 / c == momentum) else None
    rec.counter_read = None
    out, mean, var = rec.record(batch_norm_train, (b["input"], b["weight"], b["bias"], float(b["eps"])), {})
    _update(rec, ((rm, mean), (rv, var)), momentum, counted)
    return out


def _update(rec, pairs, momentum: float, counted) -> None:
    """Running-statistics updates ``buf = (1 - m) buf + m stat`` for each ``(buf, stat)``."""
    lazy = rec.lazy_type
    for buf, stat in pairs:
        if type(buf) is lazy:
            # the instance's own tensor: an in-place update of that instance, in recording order
            if buf.dtype != stat.dtype:
                stat = rec.general(torch.Tensor.to, (stat, buf.dtype), {})[0]
            rec.inplace(buf, torch.Tensor.mul_, (buf, 1 - momentum), {})
            rec.inplace(buf, torch.Tensor.add_, (buf, stat), {"alpha": momentum})
        else:
            rec.deferred.append((rec.instance, len(rec.deferred), stat, buf, momentum, counted))


def _eager_factors(entries):
    """The momentum factors in the order eager would use them.

    ``nn.BatchNorm(momentum=None)`` computes its factor as ``1.0 / float(num_batches_tracked)``
    right after ``num_batches_tracked.add_(1)``: a shared count that instances interleaved by
    value waits consume in another order than eager's. When every update of one buffer took
    such a factor (its momentum is exactly ``1.0 / c`` for the count ``c`` read just before),
    the counts, in recording order, go to the updates in instance order; any other factors
    (constant, per instance) stay with their call.
    """
    if not all(d[5] is not None for d in entries):
        return [d[4] for d in entries]
    counts = [d[5] for d in sorted(entries, key=lambda d: d[1])]
    return [1.0 / c for c in counts]


def apply_deferred(rec) -> None:
    """After the call: the running-statistics updates of shared buffers, instance by instance,
    in order (within an instance, in recording order)."""
    if not rec.deferred:
        return
    per_buffer: dict = {}
    for d in rec.deferred:
        per_buffer.setdefault(id(d[3]), []).append(d)
    with torch.no_grad():
        for entries in per_buffer.values():
            entries.sort(key=lambda d: (d[0], d[1]))
            for (_, _, stat, buf, _, _), m in zip(entries, _eager_factors(entries)):
                buf.mul_(1 - m).add_(rec.resolve(stat).to(buf.dtype), alpha=m)


__all__ = ["batch_norm_train", "record_batch_norm", "apply_deferred", "rule_batch_norm_train",
           "instance_norm_train", "record_instance_norm", "rule_instance_norm_train"]
