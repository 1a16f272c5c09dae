"""Submodule and parameter reads in C while a call records (``fast_attributes=True``, C core).

``nn.Module`` keeps submodules, parameters and buffers in dicts that ordinary attribute lookup
does not search, so every ``self.cell`` in instance code ends in ``nn.Module.__getattr__``, a
Python function: 1.5-1.7 µs a read on this machine, two per TreeLSTM node. While a call records,
:data:`FAST_MODULE_GETATTR` (a :class:`~batchcraft.autobatching.patches.SharedPatch`) sets ``nn.Module.__getattr__`` to the C core's ``ModuleGetattr``, which
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

from torch import nn

from batchcraft.autobatching import _native
from batchcraft.autobatching.patches import SharedPatch

#: enter/exit around a recording call (a no-op without the C core)
FAST_MODULE_GETATTR = SharedPatch(nn.Module, "__getattr__",
                                  _native.core.ModuleGetattr() if _native.core is not None else None)

__all__ = ["FAST_MODULE_GETATTR"]
