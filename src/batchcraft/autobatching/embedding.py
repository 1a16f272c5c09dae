"""``F.embedding(..., scale_grad_by_freq=True)``: frequencies counted per call, as in eager.

The option divides each table row's gradient by how often its index occurs *in the call*.
Batched, one call covers every instance, so the counts would run across instances and the
gradients come out smaller than eager's (found at stop 35 by the modcalls tests). An instance
that looks up one index per call counts 1 for it, so the option changes nothing there: the call
is recorded without it and batches. An instance that looks up several indices in one call runs
that call on its own values (counted in ``stats.eager_reasons``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from batchcraft.autobatching.descs import DESCS

EMBEDDINGS = (F.embedding, torch.embedding)


def _flag_at(func, args, kwargs):
    """(where scale_grad_by_freq is: ("kw", name) or ("pos", i), its value), index argument."""
    if func is F.embedding:  # (input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        if "scale_grad_by_freq" in kwargs:
            return ("kw", "scale_grad_by_freq"), kwargs["scale_grad_by_freq"], (args[0] if args else kwargs.get("input"))
        if len(args) > 5:
            return ("pos", 5), args[5], args[0]
        return None, False, None
    # torch.embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    if "scale_grad_by_freq" in kwargs:
        return ("kw", "scale_grad_by_freq"), kwargs["scale_grad_by_freq"], (args[1] if len(args) > 1 else kwargs.get("indices"))
    if len(args) > 3:
        return ("pos", 3), args[3], args[1]
    return None, False, None


def one_index_form(func, args, kwargs, lazy_type):
    """``(args, kwargs)`` without the option when every call of the instance looks up one index;
    ``"per_instance"`` when a lazy index has several elements; None when nothing changes."""
    try:
        where, flag, index = _flag_at(func, args, kwargs)
    except (IndexError, TypeError):
        return None  # a malformed call: torch raises its own error
    if not flag or type(index) is not lazy_type:
        return None
    if math.prod(DESCS[index.did][0]) != 1:
        return "per_instance"
    if where[0] == "kw":
        return args, dict(kwargs, scale_grad_by_freq=False)
    new = list(args)
    new[where[1]] = False
    return tuple(new), kwargs


__all__ = ["EMBEDDINGS", "one_index_form"]
