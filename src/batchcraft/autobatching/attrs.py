"""Submodule and parameter reads in C while a call records (``fast_attributes=True``, C core).

``nn.Module`` keeps submodules, parameters and buffers in dicts that ordinary attribute lookup
does not search, so every ``self.cell`` in instance code ends in ``nn.Module.__getattr__``, a
Python function: 1.5-1.7 µs a read on this machine, two per TreeLSTM node. While a call records,
:class:`FastModuleGetattr` sets ``nn.Module.__getattr__`` to the C core's ``ModuleGetattr``, which
does the same lookups in the same order on the live dicts (``_parameters``, ``_buffers``,
``_modules``) and raises the same ``AttributeError``: 0.9 µs a read. Nothing is copied or cached,
so every way of changing a module during the call (``functional_call``, ``del``, ``add_module``,
writes into ``_parameters``) is seen exactly as in eager. Subclasses with their own
``__getattr__`` are unaffected (theirs comes first in the MRO; ``super().__getattr__`` reaches
the C one). Nested and concurrent calls share one installation, removed when the last ends.

An earlier version copied the entries into each module's ``__dict__`` (0.1 µs a read); a
helper's hostile tests showed it silently wrong under ``torch.func.functional_call`` (which writes
``_parameters`` directly) and after ``del``, ``add_module`` or ``torch.save`` during the call.
"""

from __future__ import annotations

import threading

from torch import nn

from batchcraft.autobatching import _native

_ORIGINAL = nn.Module.__getattr__
_lock = threading.Lock()
_depth = 0
_FAST = _native.core.ModuleGetattr() if _native.core is not None else None


class FastModuleGetattr:
    """Context manager: ``nn.Module.__getattr__`` is the C version while it is open."""

    __slots__ = ()

    def __enter__(self) -> "FastModuleGetattr":
        global _depth
        if _FAST is None:
            return self
        with _lock:
            if _depth == 0 and nn.Module.__dict__.get("__getattr__") is _ORIGINAL:
                nn.Module.__getattr__ = _FAST
            _depth += 1
        return self

    def __exit__(self, *exc) -> bool:
        global _depth
        if _FAST is None:
            return False
        with _lock:
            _depth -= 1
            if _depth == 0 and nn.Module.__dict__.get("__getattr__") is _FAST:
                nn.Module.__getattr__ = _ORIGINAL
        return False


__all__ = ["FastModuleGetattr"]
