"""Output inference: what an operation returns per instance, found once per signature.

The operation runs once on placeholders of the per-instance shapes, under the grad mode of the
call and with each input's ``requires_grad``, so the result gives each output's shape, dtype,
device and whether it requires grad exactly as eager would.

Placeholders are real zero tensors for operations with a batching rule (their output shapes never
depend on values, and one instance's worth of compute costs microseconds; the random state is
restored), and ``meta`` tensors (no data) for everything else: an operation whose output shape
depends on values fails on ``meta`` and is run on concrete values instead (:class:`NeedsValues`).
Real placeholders also avoid the first ``meta`` call's import of torch's Python decompositions
(about a second per process), and they see autocast, whose casts apply to real devices only.

A 0-d integer input may be a size or a count (``w.repeat(n, 1)``, ``w.narrow(0, 0, n)``: eager's
parser reads its value), and a rule's real placeholder is 0. Such a signature is inferred again
with placeholders of 1: outputs that differ, or a call that then fails, depend on the value, and
the call runs on values (reliability #277; before, the zeros' shapes were taken for every instance).
Two values cannot show a dim (``x.sum(d)`` over dims of equal size), so a 0-d integer past the first
input of a rule that takes dims or sizes runs on values at once (#278); a rule whose tensor
arguments are all data (elementwise, products, ``cat``, indexing) keeps its 0-d integers batched,
and ``x[i]`` with a 0-d integer ``i`` is inferred on real placeholders (its shape never depends on
``i``; on ``meta`` torch cannot read the int, #288).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchcraft.autobatching.descs import DESCS, desc_id, is_int_scalar
from batchcraft.autobatching.signature import LEAF, flatten, rebuild
from batchcraft.autobatching.threadstate import outside_transforms


class NeedsValues(Exception):
    """The output of an operation cannot be inferred without concrete inputs (nonzero, unique)."""

    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


def _int_scalar(did: int) -> bool:
    """Whether values of descriptor ``did`` are 0-d integers (maybe a size: see the module docstring)."""
    return is_int_scalar(*DESCS[did][:2])


def _placeholder(did: int, rg: bool, device_kind: str, fill: int = 0):
    shape, dtype, device = DESCS[did]
    dev = "meta" if device_kind == "meta" else device
    if device_kind == "real":
        t = torch.full(shape, fill, dtype=dtype, device=dev) if fill else torch.zeros(shape, dtype=dtype, device=dev)
    else:
        t = torch.empty(shape, dtype=dtype, device=dev)
    if rg and (dtype.is_floating_point or dtype.is_complex):
        with outside_transforms():  # (functorch refuses requires_grad_() inside jvp and grad)
            t.requires_grad_(True)
    return t


def _real_ok(func, struct) -> bool:
    from batchcraft.autobatching.rules import RULES
    from batchcraft.autobatching.views import _is_basic

    if func not in RULES:
        return False
    if func is torch.Tensor.__getitem__:
        return _is_basic(struct[0][1][1])
    if func is torch.where and len(struct[0][1]) == 1 and struct[1] is None:
        return False  # torch.where(cond): nonzero
    return True


def _int_index(func, struct, leaf_specs) -> bool:
    """``x[i]`` with ``i`` a 0-d integer lazy value: eager reads ``i``'s value as an int (a meta
    placeholder cannot give one), but the output's shape never depends on it."""
    return (func is torch.Tensor.__getitem__ and len(leaf_specs) == 2 and struct[0][1][1] is LEAF
            and leaf_specs[1][0] == "lazy" and is_int_scalar(*DESCS[leaf_specs[1][1]][:2], with_bool=False))


#: batching rules whose tensor arguments are all data (a 0-d integer one is a value, not a dim)
_DATA_RULES = frozenset({"elementwise", "direct", "weight", "rnn_cell", "matmul", "seq", "getitem", "setitem"})


def _used_as_int(func, leaf_specs) -> bool:
    """A 0-d integer lazy input past the first of a rule that takes dims or sizes (``x.sum(d)``,
    ``x.transpose(d, 0)``): eager reads its value, so shapes may depend on it in ways two
    placeholder values cannot show (``sum`` over dims of equal size; reliability #277)."""
    from batchcraft.autobatching.rules import RULES

    if RULES[func].name in _DATA_RULES:
        return False
    return any(s[0] == "lazy" and _int_scalar(s[1]) for s in leaf_specs[1:])


def infer_outputs(func, struct, leaf_specs, state, lazy_type):
    """:func:`_infer` on real placeholders where safe (see the module docstring), else on meta."""
    real_ok = _real_ok(func, struct) or _int_index(func, struct, leaf_specs)
    if real_ok and func is not F.embedding and _used_as_int(func, leaf_specs):
        raise NeedsValues(ValueError("a 0-d integer input may be a dim or a size"))
    if state[2] is not None and not real_ok:
        # autocast needs real placeholders (it does not act on meta tensors), but zeros hide a
        # value-dependent shape (x[mask] of zeros is always empty: a fuzzer find): an op that
        # meta tensors cannot run without values runs on values instead
        _infer(func, struct, leaf_specs, state, lazy_type, "meta")
    if state[2] is not None or real_ok:
        rng = torch.get_rng_state()
        try:
            out = _infer(func, struct, leaf_specs, state, lazy_type, "real")
            if func is not F.embedding and any(s[0] == "lazy" and _int_scalar(s[1]) for s in leaf_specs):
                torch.set_rng_state(rng)
                if _infer(func, struct, leaf_specs, state, lazy_type, "real", fill=1)[:2] != out[:2]:
                    raise NeedsValues(ValueError("output shapes depend on a 0-d integer input's value"))
            return out
        except NeedsValues:
            if state[2] is not None:
                raise
        finally:
            torch.set_rng_state(rng)
    return _infer(func, struct, leaf_specs, state, lazy_type, "meta")


def _infer(func, struct, leaf_specs, state, lazy_type, kind, fill=0):
    """Run ``func`` on placeholders; return ``(out_struct, out_dids, out_rg)``.

    An output without tensors (``x.numel()``, ``torch.is_floating_point(x)``) depends on shapes
    only (placeholders have no data): its ``out_dids`` is empty and ``out_struct`` the value.

    Args:
        leaf_specs: per leaf of ``struct``: ``("lazy", did, requires_grad)`` or ``("shared", tensor)``.
        state: the :func:`~batchcraft.autobatching.threadstate.op_state` of the call.
        fill: the value of real placeholders of 0-d integer inputs (others are zeros).
    Raises:
        NeedsValues: the operation cannot run on placeholders (value-dependent shapes, ...).
    """
    grad, inference, autocast = state
    device = None
    with torch._C.DisableTorchFunction():
        vals = []
        for spec in leaf_specs:
            if spec[0] == "lazy":
                if device is None:
                    device = DESCS[spec[1]][2]
                if kind == "real" and DESCS[spec[1]][2].type == "meta":
                    raise NeedsValues(TypeError("meta instance"))
                vals.append(_placeholder(spec[1], spec[2] and not inference, kind,
                                         fill if fill and _int_scalar(spec[1]) else 0))
            else:
                t = spec[1]
                vals.append(t.to("meta") if kind == "meta" and t.device.type != "meta" else t)
        it = iter(vals)
        args = rebuild(struct[0], it)
        kwargs = rebuild(struct[1], it) if struct[1] is not None else {}
        if func is F.embedding and kind == "real" and len(args) > 1 and isinstance(args[1], torch.Tensor) and (
                kwargs.get("max_norm") is not None or (len(args) > 3 and args[3] is not None)):
            # max_norm renorms the looked-up rows of the table in place: placeholder indices (0)
            # must not renorm the shared table's row 0 (found at stop 35)
            args = (args[0], args[1].detach().clone().requires_grad_(args[1].requires_grad), *args[2:])
        try:
            with torch.set_grad_enabled(grad):
                out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError) as exc:
            raise NeedsValues(exc) from None
        # still without torch-function handling: reading .device or .shape of a tensor under the
        # recording mode would itself be recorded
        out_leaves: list = []
        out_struct = flatten(out, out_leaves, lazy_type)
        dids, rgs = [], []
        for t in out_leaves:
            if not isinstance(t, torch.Tensor):  # pragma: no cover - flatten only collects tensors
                raise NeedsValues(TypeError(f"output of type {type(t).__name__}"))
            dev = t.device if kind == "real" else (device if device is not None else t.device)
            dids.append(desc_id((tuple(t.shape), t.dtype, dev)))
            rgs.append(bool(t.requires_grad))
    return out_struct, tuple(dids), tuple(rgs)
