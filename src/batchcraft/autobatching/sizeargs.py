"""Sizes given one by one to a torch factory, the first a per-instance value: ``torch.zeros(n, 2)``.

In eager, a 0-d integer tensor ``n`` is a size like an int. A lazy value is not a ``Tensor`` but
an object with ``__torch_function__``, and torch's argument parser takes the sizes one by one
only when the first is an int: ``torch.zeros(n, 2)`` fails there with "zeros() takes 1
positional argument but 2 were given", before any torch-function mode sees the call
(reliability #272). The same sizes as one tuple, ``torch.zeros((n, 2))``, reach the recording
mode, which waits for ``n``'s value as eager's parser reads it.

While calls record, ``torch``'s module class (torchclass.py) has data descriptors that read
:data:`FACTORIES`, in a thread whose calls reach a recorder, as wrappers that pass the sizes as
one tuple when the first of several is such an object; every other call goes to torch's
function unchanged.
"""

from __future__ import annotations

import inspect
import sys

import torch

from batchcraft.autobatching import mode as _mode
from batchcraft.autobatching.patches import WrappedAttr

#: torch functions whose positional arguments are all sizes (``size (int...)`` in torch's docs)
FACTORIES = ("zeros", "ones", "empty", "rand", "randn")


def _packs(x) -> bool:
    """Whether torch's parser would refuse ``x`` as the first of several sizes though eager
    would take a tensor in its place: a non-Tensor with ``__torch_function__`` (a lazy value) of
    an integer dtype (a float one keeps eager's error)."""
    t = type(x)
    if t is int or isinstance(x, torch.Tensor) or not hasattr(t, "__torch_function__"):
        return False
    dtype = getattr(x, "dtype", None)
    return not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex)


def _user_function(co) -> bool:
    """Whether code ``co`` is a function (not a module or class body), not a ``__torch_function__``
    handler and not torch's (as the C core's ``read_by_user_function``)."""
    return bool(co.co_flags & inspect.CO_OPTIMIZED) and co.co_name != _mode.TF_NAME and \
        not co.co_filename.startswith(_mode.TORCH_DIR)


class Packed:
    """``fn`` taking its sizes as one tuple when the first of several is a lazy value.

    Compares, hashes, pickles and prints as ``fn`` (a dict keyed by torch's functions still
    finds it; ``is`` cannot hold), and reads other attributes through to it.
    """

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *size, **kwargs):
        if len(size) > 1 and _packs(size[0]):
            return self.fn(size, **kwargs)
        return self.fn(*size, **kwargs)

    def __eq__(self, other):
        return self.fn == (other.fn if type(other) is Packed else other)

    def __hash__(self):
        return hash(self.fn)

    def __repr__(self):
        return repr(self.fn)

    def __reduce__(self):
        return self.fn.__reduce__()

    def __getattr__(self, name):
        return getattr(self.fn, name)


class SizeArg(WrappedAttr):
    """``torch.<name>`` read as :class:`Packed` of torch's function, only where a recorder gets
    the call and a function of instance code reads it: elsewhere (other threads, a mode of the
    user's and its handler, ``DisableTorchFunction``, torch's own code, a module body's
    ``from torch import zeros``) ``func is torch.zeros`` holds."""

    __slots__ = ()

    def __init__(self, name: str, original):
        super().__init__(name, original, Packed(original))

    def wanted(self, depth: int) -> bool:
        return _mode.recording_here() and _user_function(sys._getframe(depth).f_code)


def descriptors() -> dict:
    """:class:`SizeArg` of each of :data:`FACTORIES` torch has, by name (for torchclass.py)."""
    return {name: SizeArg(name, getattr(torch, name)) for name in FACTORIES if hasattr(torch, name)}


__all__ = ["FACTORIES", "Packed", "SizeArg", "descriptors"]
