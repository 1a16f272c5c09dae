"""Descriptors of per-instance values: (shape, dtype, device), interned to small ints.

Signatures and lazy values carry the small int (``did``), so that keys hash and compare
as integers; :data:`DESCS` maps it back. The C core copies ``did`` without looking inside.
"""

from __future__ import annotations

import threading

import torch

DESCS: list = [None]     # did -> (shape tuple, dtype, device); 0 is unused
SIZES: list = [None]     # did -> torch.Size, made once
_IDS: dict = {}
_LOCK = threading.Lock()  # threads must never draw the same id


def desc_id(desc: tuple) -> int:
    """Interned small int (>= 1) for a ``(shape, dtype, device)`` descriptor."""
    i = _IDS.get(desc)
    if i is None:
        shape, dtype, device = desc
        desc = (tuple(int(d) for d in shape), dtype, device)
        with _LOCK:
            i = _IDS.get(desc)
            if i is None:
                DESCS.append(desc)
                SIZES.append(torch.Size(desc[0]))
                i = _IDS[desc] = len(DESCS) - 1
    return i


def describe(t: torch.Tensor) -> tuple:
    """Descriptor of a concrete tensor."""
    return (tuple(t.shape), t.dtype, t.device)


def is_int_scalar(shape, dtype, with_bool: bool = True) -> bool:
    """Whether values of ``shape`` and ``dtype`` are 0-d integers (what eager may read as an int:
    a size, a dim, an index; ``with_bool=False`` leaves out bool, which indexes as a mask)."""
    return not shape and not (dtype.is_floating_point or dtype.is_complex) and (with_bool or dtype is not torch.bool)


def row_bytes(dids) -> int:
    """Bytes of one row of the outputs with descriptor ids ``dids``."""
    total = 0
    for did in dids:
        shape, dtype, _ = DESCS[did]
        n = 1
        for d in shape:
            n *= d
        total += n * dtype.itemsize
    return total
