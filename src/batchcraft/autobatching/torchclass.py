"""``torch``'s module class while calls record, on both cores.

A module's attribute reads see data descriptors of its class before its own dict, so while a
call records ``torch`` is given a ``ModuleType`` subclass (:class:`patches.ModuleClassPatch`)
whose descriptors read:

* ``torch.zeros``, ``ones``, ``empty``, ``rand``, ``randn``: sizes given one by one, the first a
  lazy value, passed on as one tuple (sizeargs.py);
* ``torch.set_default_dtype``, ``torch.set_autocast_dtype``: followed by a fingerprint check of
  the thread's blocks (dtypes.py).

The C core's class (``ccore.FAST_FACTORIES``) derives from :class:`RecordingTorch` and adds its
fast functions. Values set on ``torch`` meanwhile are read as set.
"""

from __future__ import annotations

import types

import torch

from batchcraft.autobatching import sizeargs
from batchcraft.autobatching.dtypes import FingerprintSetter
from batchcraft.autobatching.patches import ModuleClassPatch

RecordingTorch = type("module", (types.ModuleType,), {
    "__slots__": (), "__module__": __name__, **sizeargs.descriptors(),
    **{name: FingerprintSetter(name) for name in ("set_default_dtype", "set_autocast_dtype")}})

#: the patch of the calls that do not take the C core's fast class
RECORDING_TORCH = ModuleClassPatch(torch, RecordingTorch)

__all__ = ["RecordingTorch", "RECORDING_TORCH"]
