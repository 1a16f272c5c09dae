"""Constant factories in instance code: ``torch.zeros(1, hidden)``, ``torch.full((3,), 2.0)``,
``torch.arange(n)``, ``torch.eye(k)``.

Their result depends only on their arguments, the default dtype and the device, so every
instance that makes one makes the same values. Each distinct call is made once (with eager's
errors, at the first call) and kept as a *template*; the leaf an instance gets holds a
:class:`ConstLeaf` instead of a tensor of its own. At the flush the leaves of one descriptor
become one tensor (``gather.stack_leaves``: one template expanded and copied); a leaf whose own
tensor is needed (an in-place update, ``requires_grad_``) gets a copy. No template is ever handed
to instance code or written.

Before, each call ran the general recording path and made its tensor (``torch.zeros(hidden)``
for every leaf of a plain tree model: 4 µs; ``torch.zeros((1, hidden))`` or ``torch.arange(n)``:
12-14 µs). The C core finds a call's template in a cache keyed by the call's arguments
(``const_leaf_c``, filled by ``CRecorder.const_entry``) and reads these factories as fast
functions while a call records: about 0.8 µs a call, where eager's call costs 1.4-2.1 µs.
"""

from __future__ import annotations

import math

import torch

#: factories whose result is fixed by their arguments, the default dtype and the device
CONST_FACTORIES = frozenset({torch.zeros, torch.ones, torch.full, torch.arange, torch.eye})
#: templates of at most this many bytes are kept (a larger constant is made per call, as before)
MAX_CONST_BYTES = 1 << 16
#: at most this many templates in the process
MAX_CONSTS = 256

_KW = frozenset({"dtype", "device"})
_DEVICE_TYPES = (str, torch.device, int)
_TEMPLATES: dict = {}  # key -> (did, ConstLeaf)


class ConstLeaf:
    """A leaf's Python value standing for a copy of ``template`` (see the module docstring)."""

    __slots__ = ("template",)

    def __init__(self, template: torch.Tensor):
        self.template = template

    def tensor(self) -> torch.Tensor:
        """A new tensor with the template's values (what eager's call returned); made outside any
        torch-function mode (it may be asked for while a call records)."""
        with torch._C.DisableTorchFunction():
            return self.template.clone()

    def rows(self, k: int) -> torch.Tensor:
        """A new ``(k, *shape)`` tensor whose rows are the template's values. Always a new tensor:
        ``expand(...).contiguous()`` of one row is the template itself, and a view of it reached
        the caller (reliability #254)."""
        t = self.template
        with torch._C.DisableTorchFunction():
            out = torch.empty((k,) + tuple(t.shape), dtype=t.dtype, device=t.device)
            out.copy_(t)
        return out

    def __repr__(self) -> str:
        return f"ConstLeaf({tuple(self.template.shape)}, {self.template.dtype})"


def _part(a):
    t = type(a)
    if t is int or t is bool:
        return (t, a)
    if t is float:
        if a != a:  # NaN: equal to nothing, so never found again; made per call
            return None
        return (t, a, math.copysign(1.0, a))  # (-0.0 and 0.0 compare equal)
    if t in (tuple, list, torch.Size) and all(type(x) is int for x in a):
        return (tuple, tuple(a))
    return None


def key(func, args: tuple, kwargs: dict | None):
    """A hashable key of ``func(*args, **kwargs)`` for :data:`CONST_FACTORIES`, or None when the call
    is not a plain constant (tensor arguments, ``requires_grad=``, ``out=``, a generator...)."""
    if all(type(a) is int for a in args):  # torch.zeros(1, hidden): the sizes are the key
        parts = args
    else:
        parts = []
        for a in args:
            p = _part(a)
            if p is None:
                return None
            parts.append(p)
        parts = tuple(parts)
    dt = dev = None
    if kwargs:
        if not kwargs.keys() <= _KW:
            return None
        dt, dev = kwargs.get("dtype"), kwargs.get("device")
        if (dt is not None and type(dt) is not torch.dtype) or (dev is not None and type(dev) not in _DEVICE_TYPES):
            return None
    return func, parts, dt, dev, torch.get_default_dtype()


def template(func, args: tuple, kwargs: dict | None, k, describe):
    """``(did, ConstLeaf)`` of the call with key ``k``, made now (under ``DisableTorchFunction``;
    eager's error raises here) the first time; ``(None, tensor)`` when the result is not kept (too
    large, more than :data:`MAX_CONSTS` templates, or it requires grad): the caller makes a leaf of
    that tensor, as before. ``describe(t)`` gives a tensor's did."""
    hit = _TEMPLATES.get(k)
    if hit is not None:
        return hit
    with torch._C.DisableTorchFunction():
        t = func(*args, **(kwargs or {}))
    if t.requires_grad or t.numel() * t.element_size() > MAX_CONST_BYTES or len(_TEMPLATES) >= MAX_CONSTS:
        return None, t  # (made in the instance's mode, as eager makes it)
    if t.is_inference():  # a template is a plain tensor: one made under inference mode could not
        with torch._C.DisableTorchFunction(), torch.inference_mode(False):  # be saved for backward
            t = t.clone()                                                # by a later call (#255)
    hit = _TEMPLATES.setdefault(k, (describe(t), ConstLeaf(t)))
    return hit


_ON_CLEAR: list = []  # caches of templates elsewhere (the C core's, by call key)


def on_clear(fn) -> None:
    """Call ``fn()`` whenever :func:`clear` runs."""
    _ON_CLEAR.append(fn)


def clear() -> None:
    """Forget every template, here and in the caches registered with :func:`on_clear`."""
    _TEMPLATES.clear()
    for fn in _ON_CLEAR:
        fn()


__all__ = ["CONST_FACTORIES", "MAX_CONST_BYTES", "MAX_CONSTS", "ConstLeaf", "key", "template", "on_clear", "clear"]
