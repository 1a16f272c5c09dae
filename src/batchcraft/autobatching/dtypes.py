"""The default dtype (``torch.set_default_dtype``) and autocast's dtypes in static blocks' traces.

A block's trace is a program run at the flush, perhaps after instance code restored the default
dtype it set before the call: a factory step without ``dtype=`` (``torch.zeros(2)``,
``torch.tensor(1.5)``) then made the flush's dtype, not the call's (reliability #271). As with
the default device (devices.py), a trace's factory steps hold the ``dtype=`` eager's call got
(:func:`with_default_dtype`), the default dtype is part of a block's fingerprint (blocks.py), and
:class:`FingerprintSetter` makes ``torch.set_default_dtype`` called while calls record tell the
thread's recorder to check its blocks' fingerprints again. Autocast's dtypes, which a body may read
(``torch.get_autocast_dtype("cpu")``) while autocast is off, are in the fingerprint too, and
``torch.set_autocast_dtype`` is followed the same way (reliability #263).
"""

from __future__ import annotations

import functools

import torch

from batchcraft.autobatching import stack
from batchcraft.autobatching.devices import device_constructors
from batchcraft.autobatching.patches import WrappedAttr


def with_default_dtype(func, args, kwargs: dict) -> dict:
    """``kwargs`` of factory ``func`` with the ``dtype=`` eager's call gets from the default dtype
    (floating and complex results; an int result keeps none): the call is made once on ``meta``
    to see it. Factories are torch's list of them (those ``set_default_device`` reaches) and
    ``torch.normal`` (its ``(mean, std, size)`` form). Anything else, or a call that fails
    there (tensor arguments on another device), is returned unchanged."""
    if "dtype" in kwargs or (func not in device_constructors() and func is not torch.normal):
        return kwargs
    try:
        with torch._C.DisableTorchFunction():
            probe = func(*args, **{**kwargs, "device": "meta"})
    except Exception:  # noqa: BLE001 - eager's own call raises its error at the step
        return kwargs
    if not isinstance(probe, torch.Tensor) or not (probe.dtype.is_floating_point or probe.dtype.is_complex):
        return kwargs
    return {**kwargs, "dtype": probe.dtype}


def _setter(original):
    @functools.wraps(original)
    def setter(*args, **kwargs):
        out = original(*args, **kwargs)
        forget = getattr(stack.current(), "forget_block_checks", None)
        if forget is not None:  # (a recorder of this thread: its blocks compare fingerprints again)
            forget()
        return out
    return setter


class FingerprintSetter(WrappedAttr):
    """``torch.<name>`` (a setter of state in blocks' fingerprints) read as torch's function
    followed by the thread's recorder's ``forget_block_checks``."""

    __slots__ = ()

    def __init__(self, name: str):
        original = getattr(torch, name)
        super().__init__(name, original, _setter(original))


__all__ = ["with_default_dtype", "FingerprintSetter"]
