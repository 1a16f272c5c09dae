"""View operations and their inverses, for writes through views (see :mod:`functional`).

A lazy value made by a view operation (basic indexing, ``select``, ``narrow``, ``unsqueeze``,
``squeeze``, ``view``, ``t``, ``transpose``, ``permute``, ``diagonal``, ``unbind``/``split``/
``chunk`` members, ``detach``) remembers its base. Writing into it computes the base's new value with the
inverse of the view, so the base (and its other views) change as they do in eager.
Operations that copy in eager (advanced indexing, ``reshape``/``flatten`` of non-contiguous
values, ``clone``) are not views.
"""

from __future__ import annotations

import torch

from batchcraft.autobatching.descs import DESCS, is_int_scalar
from batchcraft.autobatching.signature import LEAF, rebuild

T = torch.Tensor


def _is_basic(struct) -> bool:
    """An index structure without tensors (ints, slices, None, Ellipsis, bools)."""
    if struct is LEAF:
        return False
    if type(struct) is tuple:
        return all(_is_basic(s) for s in struct if type(s) is tuple or s is LEAF)
    return True


def _int_scalar_index(t) -> bool:
    """A lazy value or tensor that indexes as an int (``x[i]``: eager's ``select``)."""
    did = getattr(t, "did", None)
    shape, dtype = DESCS[did][:2] if did is not None else (tuple(t.shape), t.dtype)
    return is_int_scalar(shape, dtype, with_bool=False)


def detached_alias(base, history):
    """A detached alias of ``base`` after a write that carried autograd history: ``base``'s value
    (exactly: ``+ 0``) with ``history``'s gradient. Eager's ``a = y.detach(); a.add_(w)`` leaves
    ``a`` with the write's history and ``y`` with its own; later writes into ``y`` change ``a``'s
    value, not its history (reliability #95)."""
    return base.detach() + (history - history.detach())


VIEW_FUNCS = {T.__getitem__, T.select, torch.select, T.narrow, torch.narrow, T.unsqueeze, torch.unsqueeze,
              T.squeeze, torch.squeeze, T.view, T.view_as, T.t, torch.t, T.transpose, torch.transpose,
              T.permute, torch.permute, T.diagonal, torch.diagonal, T.unbind, torch.unbind, T.split,
              torch.split, T.chunk, torch.chunk, T.swapaxes, torch.swapaxes, T.movedim, torch.movedim,
              T.expand, T.expand_as, T.detach, torch.detach, detached_alias}


def is_detach_view(func) -> bool:
    """True for the detached aliases (``detach`` and :func:`detached_alias`)."""
    return func is T.detach or func is torch.detach or func is detached_alias


def is_view_call(func, struct, leaves=None) -> bool:
    """True when ``func`` with argument structure ``struct`` (tensor arguments ``leaves``) returns
    a view of its first argument."""
    if func not in VIEW_FUNCS:
        return False
    args = struct[0][1]
    if not args or args[0] is not LEAF:
        return False
    if func is T.__getitem__:
        if len(args) == 2 and args[1] is LEAF and leaves is not None and len(leaves) == 2:
            return _int_scalar_index(leaves[1])  # x[i], i a 0-d integer: eager's select, a view
        return len(args) == 2 and _is_basic(args[1])
    return struct[1] is None or all(s is not LEAF for s in struct[1][2])


def _args(struct, leaves):
    it = iter(leaves)
    args = list(rebuild(struct[0], it))
    kwargs = rebuild(struct[1], it) if struct[1] is not None else {}
    return args, kwargs


def _dim(args, kwargs, pos, name="dim", default=None):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


def view_scatter(rec, func, struct, leaves, slot, base, new_view, shape):
    """The base's new value after ``new_view`` was written into view ``func(base, ...)[slot]``.

    ``leaves`` are the view call's tensor arguments with ``base`` first; ``shape`` is the
    base's per-instance shape. Returns a lazy value (recorded by recorder ``rec``).
    """
    args, kwargs = _args(struct, leaves)
    args[0] = base
    if func is T.__getitem__:
        from batchcraft.autobatching.functional import setitem_functional

        return rec.record(setitem_functional, (base, args[1], new_view), {})
    if func in (T.select, torch.select):
        return torch.select_scatter(base, new_view, _dim(args, kwargs, 1), _dim(args, kwargs, 2, "index"))
    if func in (T.narrow, torch.narrow):
        d, start, length = _dim(args, kwargs, 1), _dim(args, kwargs, 2, "start"), _dim(args, kwargs, 3, "length")
        return torch.slice_scatter(base, new_view, d, start, start + length)
    if func in (T.unsqueeze, torch.unsqueeze, T.squeeze, torch.squeeze, T.view, T.view_as, T.expand, T.expand_as):
        if func in (T.expand, T.expand_as):
            raise RuntimeError("unsupported operation: more than one element of the written-to tensor refers "
                               "to a single memory location (an expanded view)")
        return new_view.reshape(shape)
    if func in (T.detach, torch.detach, detached_alias):
        # eager's write through a detached alias changes the base's values and leaves its
        # autograd history as it was: the new value, with the base's gradient path (+ 0); the
        # alias's own history is kept by functional.write (detached_alias)
        # (also under no_grad: the base keeps its graph there too)
        value = new_view.detach() if new_view.requires_grad else new_view
        if not base.requires_grad:
            return value
        with torch.enable_grad():
            return value + (base - base.detach())
    # the inverse of a permuting view is laid out as the view: the base, written in place in
    # eager, keeps its own (contiguous) layout, which later .view() calls need (reliability #259)
    if func in (T.t, torch.t):
        return new_view.t().contiguous() if len(shape) == 2 else new_view
    if func in (T.transpose, torch.transpose, T.swapaxes, torch.swapaxes):
        return new_view.transpose(_dim(args, kwargs, 1, "dim0"), _dim(args, kwargs, 2, "dim1")).contiguous()
    if func in (T.permute, torch.permute):
        dims = args[1:] if "dims" not in kwargs else [kwargs["dims"]]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        rank = len(shape)
        inv = [0] * rank
        for i, d in enumerate(dims):
            inv[d % rank] = i
        return new_view.permute(*inv).contiguous()
    if func in (T.movedim, torch.movedim):
        src, dst = _dim(args, kwargs, 1, "source"), _dim(args, kwargs, 2, "destination")
        return new_view.movedim(dst, src).contiguous()
    if func in (T.diagonal, torch.diagonal):
        return torch.diagonal_scatter(base, new_view, _dim(args, kwargs, 1, "offset", 0),
                                      _dim(args, kwargs, 2, "dim1", 0), _dim(args, kwargs, 3, "dim2", 1))
    if func in (T.unbind, torch.unbind):
        return torch.select_scatter(base, new_view, _dim(args, kwargs, 1, default=0), slot)
    if func in (T.split, torch.split, T.chunk, torch.chunk):
        d = _dim(args, kwargs, 2, default=0)
        size = shape[d]
        if func in (T.chunk, torch.chunk):
            k = _dim(args, kwargs, 1, "chunks")
            step = -(-size // k)
            starts = list(range(0, size, step))
        else:
            sz = _dim(args, kwargs, 1, "split_size_or_sections")
            if isinstance(sz, int):
                starts = list(range(0, size, sz))
            else:
                starts, acc = [], 0
                for s in sz:
                    starts.append(acc)
                    acc += s
        start = starts[slot]
        return torch.slice_scatter(base, new_view, d, start, start + new_view.shape[d])
    raise RuntimeError(f"in-place write through a view made by {getattr(func, '__name__', func)} is not supported")
