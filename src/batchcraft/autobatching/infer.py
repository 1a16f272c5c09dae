"""Output inference: what an operation returns per instance, found once per signature.

The operation runs on ``meta`` tensors of the per-instance shapes (no data, no kernels),
under the grad mode of the call and with each input's ``requires_grad``, so the result gives
each output's shape, dtype and whether it requires grad exactly as eager would. Under autocast
(whose casts apply to real devices only) small real tensors are used instead.
"""

from __future__ import annotations

import torch

from batchcraft.autobatching.descs import DESCS, desc_id
from batchcraft.autobatching.signature import LEAF, flatten, rebuild


class NeedsValues(Exception):
    """The output of an operation cannot be inferred without concrete inputs (nonzero, unique)."""

    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


def _placeholder(did: int, rg: bool, device_kind: str):
    shape, dtype, device = DESCS[did]
    dev = "meta" if device_kind == "meta" else device
    t = torch.zeros(shape, dtype=dtype, device=dev) if device_kind == "real" else torch.empty(shape, dtype=dtype, device=dev)
    if rg and (dtype.is_floating_point or dtype.is_complex):
        t.requires_grad_(True)
    return t


def infer_outputs(func, struct, leaf_specs, state, lazy_type):
    """Run ``func`` on placeholders; return ``(out_struct, out_dids, out_rg)``.

    An output without tensors (``x.numel()``, ``torch.is_floating_point(x)``) depends on shapes
    only (placeholders have no data): its ``out_dids`` is empty and ``out_struct`` the value.

    Args:
        leaf_specs: per leaf of ``struct``: ``("lazy", did, requires_grad)`` or ``("shared", tensor)``.
        state: the :func:`~batchcraft.autobatching.threadstate.op_state` of the call.
    Raises:
        NeedsValues: the operation cannot run on placeholders (value-dependent shapes, ...).
    """
    grad, inference, autocast = state
    kind = "real" if autocast is not None else "meta"
    device = None
    with torch._C.DisableTorchFunction():
        vals = []
        for spec in leaf_specs:
            if spec[0] == "lazy":
                if device is None:
                    device = DESCS[spec[1]][2]
                vals.append(_placeholder(spec[1], spec[2] and grad, kind))
            else:
                t = spec[1]
                vals.append(t.to("meta") if kind == "meta" and t.device.type != "meta" else t)
        it = iter(vals)
        args = rebuild(struct[0], it)
        kwargs = rebuild(struct[1], it) if struct[1] is not None else {}
        try:
            with torch.set_grad_enabled(grad):
                out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError) as exc:
            raise NeedsValues(exc) from None
    out_leaves: list = []
    out_struct = flatten(out, out_leaves, lazy_type)
    dids, rgs = [], []
    for t in out_leaves:
        if not isinstance(t, torch.Tensor):  # pragma: no cover - flatten only collects tensors
            raise NeedsValues(TypeError(f"output of type {type(t).__name__}"))
        dev = device if device is not None else t.device
        if kind == "meta" and t.device.type == "meta" and device is not None:
            dev = device
        dids.append(desc_id((tuple(t.shape), t.dtype, dev)))
        rgs.append(bool(t.requires_grad))
    return out_struct, tuple(dids), tuple(rgs)
