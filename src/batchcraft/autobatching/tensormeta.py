"""Metadata reads of plain tensors while calls record: ``W.device``, ``W.shape`` (C core).

With the recording mode on the torch-function stack, torch hands every property read of a plain
tensor to the mode (``handle_torch_function_getter``), and the mode answers with the plain read:
about 1.0 µs a read here against 0.09 µs without a mode. Per-instance code often reads a
parameter's metadata (``self.cell.U_f.weight.device`` once per TreeLSTM instance: 2.1 µs of an
instance's 47).

While a call records, :data:`TENSOR_META` sets a ``_core.TensorMeta`` on ``torch.Tensor`` for each
name of :data:`NAMES`, over ``TensorBase``'s own descriptor. For a plain ``Tensor`` or
``Parameter`` read in a thread whose C recorder's mode is the only mode on the stack, it makes the
plain read with the mode briefly off the stack (what the mode's handler does); every other read
(a subclass, another thread, a mode of the user's, ``DisableTorchFunction``, ``torch.Tensor.device``
on the class) goes to the original descriptor. The names return no tensors, so nothing is
recorded for them in either path.
"""

from __future__ import annotations

import torch

from batchcraft.autobatching import _native
from batchcraft.autobatching.patches import PatchSet, SharedPatch

#: properties of ``TensorBase`` whose value is metadata (no tensor)
NAMES = ("device", "dtype", "shape", "ndim", "is_cuda", "requires_grad", "is_leaf", "layout")


def _patches() -> list:
    make = getattr(_native.core, "TensorMeta", None) if _native.core is not None else None
    if make is None:
        return []
    base = vars(torch._C.TensorBase)
    return [SharedPatch(torch.Tensor, name, make(base[name])) for name in NAMES
            if name in base and name not in vars(torch.Tensor)]


#: enter/exit around a recording call of the C core
TENSOR_META = PatchSet(_patches())

__all__ = ["NAMES", "TENSOR_META"]
