"""In-place writes, ``requires_grad`` changes and tensor hooks inside instance code.

**Functionalisation.** A lazy value is a handle to one recorded output. An in-place update of
it (``y.add_(1)``, ``y[i] = v``, ``y[mask] = 0``, ``x += h``, ``F.relu(y, inplace=True)``) is
recorded as the out-of-place operation, and the handle is re-pointed at the result: every
Python reference to that handle sees the new value, and work recorded before the write keeps
reading the old one, as in eager. A write *through a view* (``x[0].add_(1)``, ``v = x.t();
v.mul_(2)``) writes the updated view back into its base with the inverse of the view
(``select_scatter``, ``slice_scatter``, a functional ``__setitem__``, the inverse permutation)
and re-derives the base's other live views. In-place updates of an instance's own input are
copied back into the caller's tensor after the call (as eager would have changed it). Writes
into *shared* tensors (parameters, tensors captured from outside the instance) with
per-instance values are refused with a clear error.

**Autograd.** ``requires_grad_()`` on a value that does not require grad makes it a leaf
(batched: one leaf tensor whose rows are the instances' values); ``requires_grad`` reads are
exact per signature (inferred with each input's flag); hooks are kept per node and applied to
the instance's row of the batched gradient, so each instance's hook sees its own gradient,
summed over all uses, as in eager.
"""

from __future__ import annotations

import math

import torch

from batchcraft.autobatching.lazy import user_mode_on_top
from batchcraft.autobatching.views import detached_alias
from batchcraft.errors import UnsupportedOperationError

_INPLACE_KW_FUNCS = None


def _inplace_kw_funcs():
    global _INPLACE_KW_FUNCS
    if _INPLACE_KW_FUNCS is None:
        F = torch.nn.functional
        _INPLACE_KW_FUNCS = {getattr(F, n) for n in (
            "relu", "relu6", "elu", "selu", "celu", "leaky_relu", "hardtanh", "threshold", "silu",
            "mish", "hardswish", "hardsigmoid", "rrelu", "dropout", "alpha_dropout", "dropout1d",
            "dropout2d", "dropout3d", "feature_alpha_dropout") if hasattr(F, n)}
    return _INPLACE_KW_FUNCS


def _is_inplace_method(func) -> bool:
    name = getattr(func, "__name__", "")
    if name.startswith("__i") and name.endswith("__") and name[3:-2] in (
            "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
            "matmul"):
        return True
    return name.endswith("_") and not name.endswith("__") and (
        getattr(torch.Tensor, name, None) is func or getattr(torch, name, None) is func)


def writes_first(func, kwargs) -> bool:
    """True when ``func`` (with ``kwargs``) updates its first argument in place."""
    if kwargs and kwargs.get("inplace") is True and func in _inplace_kw_funcs():
        return True
    return func is torch.Tensor.__setitem__ or _is_inplace_method(func)


def is_inplace_call(func, args, kwargs, lazy_type) -> bool:
    """True when ``func(*args, **kwargs)`` updates ``args[0]`` (a lazy value) in place."""
    if not args or type(args[0]) is not lazy_type:
        return False
    if kwargs and kwargs.get("inplace") is True and func in _inplace_kw_funcs():
        return True
    return _is_inplace_method(func)


def _out_of_place(func, kwargs):
    """(function, kwargs) computing the new value of ``args[0]`` without writing it."""
    name = getattr(func, "__name__", "")
    if kwargs and kwargs.get("inplace") is True:
        return func, dict(kwargs, inplace=False)
    if name.startswith("__i") and name.endswith("__"):
        return getattr(torch.Tensor, "__" + name[3:]), kwargs
    special = _SPECIAL.get(name)
    if special is not None:
        return special, kwargs
    base = getattr(torch.Tensor, name[:-1], None) or getattr(torch, name[:-1], None)
    if base is None:
        raise UnsupportedOperationError(
            f"in-place method .{name}() has no out-of-place form batchcraft knows",
            hint=f"write the update out of place, e.g. y = f(y)")
    return base, kwargs


def _copy(x, src, non_blocking=False):
    # a new tensor, not a view of src: under no_grad a view of a src that requires grad would
    # still require grad (its history, not x's: a hostile find, stop 49)
    return src.expand_as(x).to(x.dtype, copy=True)


def _zero(x):
    return torch.zeros_like(x)


def _fill(x, value):
    if isinstance(value, (int, float, bool)):
        return torch.full_like(x, value)
    return value.expand_as(x).to(x.dtype)


def _uniform(x, a=0.0, b=1.0, generator=None):
    return torch.rand_like(x) * (b - a) + a


def _normal(x, mean=0.0, std=1.0, generator=None):
    return torch.randn_like(x) * std + mean


def _bernoulli(x, p=0.5, generator=None):
    return torch.bernoulli(torch.full_like(x, p) if isinstance(p, (int, float)) else p.expand_as(x))


def _resize(x, *size, memory_format=None):
    """``x.resize_(*size)`` as a pure function: ``x``'s first elements in memory order, as eager
    keeps its storage's, then zeros where eager's new memory is uninitialised (reliability #264:
    before, autograd's out-of-place ``resize``, which cannot change the number of elements)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    n = math.prod(size)
    flat = x.reshape(-1)
    out = flat[:n].clone() if n <= flat.numel() else torch.cat([flat, flat.new_zeros(n - flat.numel())])
    return out.reshape(size) if memory_format is None else out.reshape(size).contiguous(memory_format=memory_format)


_SPECIAL = {"copy_": _copy, "zero_": _zero, "fill_": _fill, "uniform_": _uniform, "normal_": _normal,
            "bernoulli_": _bernoulli, "resize_": _resize}
_METADATA_ONLY = {"unsqueeze_", "squeeze_", "t_", "transpose_", "detach_", "resize_", "as_strided_",
                  "swapaxes_", "swapdims_"}


def setitem_functional(x, key, value):
    """``y = x.clone(); y[key] = value; return y``: ``x[key] = value`` as a pure function."""
    y = x.clone()
    y[key] = value
    return y


def make_leaf(x):
    """``x.detach().requires_grad_()``: the value as a new leaf that requires grad."""
    return x.detach().requires_grad_(True)


def without_history(x):
    """``x``'s value without autograd history, not a view of ``x`` (a leaf after
    ``requires_grad_(False)``)."""
    return x.detach().clone()


def rebind(rec, x, new) -> None:
    """Point handle ``x`` at ``new``'s output and re-derive the live views of ``x``."""
    rec.note_rebind(x)
    x.node, x.slot, x.did = new.node, new.slot, new.did
    views = getattr(rec, "views", None)
    if not views:
        return
    for v in list(views.get(id(x), ())):
        v_obj = v()
        if v_obj is None:
            continue
        rec.view_rederive(v_obj, x)


def write(rec, x, new) -> None:
    """Make handle ``x`` hold ``new`` (a lazy value of x's shape and dtype), through its base."""
    base = rec.view_base(x)
    if base is None:
        rebind(rec, x, new)
        return
    made = rec.is_made_leaf_alias(x)
    detached = rec.is_detach_view(x)
    grad_mode = torch.is_grad_enabled()
    # a leaf that requires grad, written without history: through a detached alias, or through
    # any view under no_grad (``x[1:].mul_(4)``: reliability #96)
    base_is_leaf = rec.is_input_leaf_requiring_grad(base)
    if grad_mode and base_is_leaf and not detached and not made:  # (``x[1:].mul_(4)``: as eager)
        raise RuntimeError("a view of a leaf Variable that requires grad is being used in an in-place operation.")
    leaf = (detached or not grad_mode) and base_is_leaf
    origin = rec.leaf_origin(base) if leaf else None
    if made and rec.requires_grad_of(new):
        # a leaf of its own over a view (``copy.copy(y)``, ``v.requires_grad_()``) written under
        # no_grad: the base gets the values, not the alias's gradient path
        new = rec.record(torch.Tensor.detach, (new,), {})
    new_base = rec.view_scatter(x, base, new)
    if not grad_mode and not detached:
        # under no_grad the base keeps its values' autograd graph (reliability #118, through a view)
        new_base = _with_autograd_of(rec, base, new_base)
    write(rec, base, new_base)  # re-derives x (a live view of base) too; a made leaf stays one
    if leaf:
        # a leaf that requires grad, written without history (``x.data.mul_(2)``): still a leaf
        # for instance code, as in eager (in-place updates of it stay refused outside no_grad)
        rec.note_written_leaf(base, origin)
    if detached and not made:
        # a detached alias written with a value that has autograd history keeps that history
        # (eager's ``a = y.detach(); a.add_(w)``: base's value, new's gradient); written with one
        # that has none (``a.zero_()``), it has none
        if rec.requires_grad_of(new):
            rebind(rec, x, rec.record(detached_alias, (base, new), {}))
        elif rec.requires_grad_of(x):
            rebind(rec, x, rec.record(torch.Tensor.detach, (base,), {}))


def _check_result(x, new, name):
    from batchcraft.autobatching.descs import DESCS

    shape, dtype, _ = DESCS[x.did]
    nshape, ndtype, _ = DESCS[new.did]
    if tuple(nshape) != tuple(shape):
        raise RuntimeError(f"{name}: output with shape {list(shape)} doesn't match the broadcast shape "
                           f"{list(nshape)}")
    return ndtype != dtype and not torch.can_cast(ndtype, dtype), dtype, ndtype


def inplace(rec, x, func, args, kwargs):
    """Record ``func(x, ...)`` (an in-place update) out of place and re-point ``x``."""
    name = getattr(func, "__name__", str(func))
    rec.check_owner(x, func)
    if name == "requires_grad_":
        set_requires_grad(rec, x, bool(args[1]) if len(args) > 1 else kwargs.get("requires_grad", True))
        return x
    origin = leaf_write_origin(rec, x, metadata=name in _METADATA_ONLY)
    if name == "resize_" and rec.requires_grad_of(x):  # (eager's own check, at the call)
        raise RuntimeError("cannot resize variables that require grad")
    if user_mode_on_top(rec):  # a mode entered inside instance code sees the in-place call (bug #49)
        new, out = rec.under_user_mode(func, args, kwargs, copy_first=True)
        if origin is not None:
            with torch._C.DisableTorchFunction():
                new = _with_autograd_of(rec, x, new)
        repoint(rec, x, new, name)
        note_leaf_written(rec, x, origin)
        return x if out is None else out
    oop, kw = _out_of_place(func, kwargs)
    new = rec.record(oop, args, kw or {})
    if name in _METADATA_ONLY:
        if name == "resize_":
            # eager's views of x keep their storage and x stops being laid out as a view of its
            # base's: neither is re-derived from the resized value
            views = getattr(rec, "views", None)
            if views:
                views.pop(id(x), None)
            x.base = None
        rebind(rec, x, new)
        return x
    if type(new) is not type(x):
        raise UnsupportedOperationError(f"in-place {name} on a lazy value returned {type(new).__name__}")
    bad, dtype, ndtype = _check_result(x, new, name)
    if bad:
        raise RuntimeError(f"result type {ndtype} can't be cast to the desired output type {dtype}")
    if ndtype != dtype:
        new = rec.record(torch.Tensor.to, (new, dtype), {})
    write(rec, x, _with_autograd_of(rec, x, new))
    note_leaf_written(rec, x, origin)
    return x


def leaf_write_origin(rec, x, metadata: bool = False):
    """Eager's rule for an in-place update of ``x``: refused for a leaf that requires grad while
    grad mode is on. Under no_grad it is allowed (reliability #96): returns the leaf (node, slot)
    that ``x`` stands for, for :func:`note_leaf_written` after the write; None when ``x`` is not
    such a leaf."""
    if not rec.is_input_leaf_requiring_grad(x):
        return None
    if torch.is_grad_enabled() or metadata:  # (``x.t_()`` on a leaf: refused, as before)
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    return rec.leaf_origin(x)


def note_leaf_written(rec, x, origin) -> None:
    """After an in-place write under no_grad into leaf ``x`` (``origin``: see
    :func:`leaf_write_origin`): ``x`` holds the new value with the leaf's gradient path at
    identity (``keep_graph``) and stays a leaf that requires grad, as in eager. A leaf over a view
    (``copy.copy``) was re-derived from its base: a leaf already."""
    if origin is not None and rec.view_base(x) is None:
        rec.note_written_leaf(x, origin)


def _with_autograd_of(rec, x, new):
    """``new`` as the in-place result on ``x``: where ``x`` requires grad and ``new`` does not,
    eager's result still requires grad."""
    if not rec.requires_grad_of(x) or rec.requires_grad_of(new):
        return new
    if torch.is_grad_enabled():
        # ``y.zero_()``, ``y.copy_(c)``, ``y.fill_(2)``: the new value, a zero gradient into y's history
        return rec.record(keep_history, (new, x), {})
    # under no_grad eager changes y's values and keeps its autograd node: the new value, y's own
    # gradient path (+ 0); under inference_mode too (y is no inference tensor)
    with torch.inference_mode(False), torch.enable_grad():
        return rec.record(keep_graph, (new, x), {})


def keep_graph(new, old):
    """``new``'s values (exactly: ``+ 0``) with ``old``'s autograd graph behind them at identity
    gradient: an in-place write under ``no_grad`` into a tensor that requires grad."""
    return new.detach() + (old - old.detach())


def keep_history(new, old):
    """``new``'s values with ``old``'s autograd graph behind them at zero gradient (an in-place
    overwrite of a tensor that requires grad, as eager's ``zero_``/``fill_``/``copy_``); a
    ``where`` rather than an arithmetic trick: exact values, no NaN from infinite ``old``."""
    return torch.where(torch.ones_like(new, dtype=torch.bool), new, old)


def repoint(rec, x, new, name: str) -> None:
    """``x`` (lazy) re-pointed at ``new``, the result of the in-place ``name`` run for a mode of
    the user's on the instance's values (bugs #49, #56); its views follow unless only metadata
    changed. Not seen by any mode: the re-pointing is ours."""
    with torch._C.DisableTorchFunction():
        (rebind if name in _METADATA_ONLY else write)(rec, x, new)


def setitem(rec, x, key, value) -> None:
    """``x[key] = value`` on a lazy value: a functional ``__setitem__`` and a re-pointed handle."""
    rec.check_owner(x, setitem)
    origin = leaf_write_origin(rec, x)
    if user_mode_on_top(rec):  # bug #49, as in inplace()
        new, _ = rec.under_user_mode(torch.Tensor.__setitem__, (x, key, value), {}, copy_first=True)
        with torch._C.DisableTorchFunction():
            write(rec, x, new if origin is None else _with_autograd_of(rec, x, new))
        note_leaf_written(rec, x, origin)
        return
    new = rec.record(setitem_functional, (x, key, value), {})
    write(rec, x, _with_autograd_of(rec, x, new))
    note_leaf_written(rec, x, origin)



def set_requires_grad(rec, x, value: bool) -> None:
    """``x.requires_grad_(value)`` / ``x.requires_grad = value`` with eager's rules."""
    rec.check_owner(x, set_requires_grad)
    if rec.node_sid(x.node) == 0 and (x.node, x.slot) not in rec.written_leaves:
        rec.leaf_set_requires_grad(x.node, value)
        return
    if rec.requires_grad_of(x):
        if value:
            return
        if not rec.is_input_leaf_requiring_grad(x):
            raise RuntimeError("you can only change requires_grad flags of leaf variables. If you want to use "
                               "a computed variable in a subgraph that doesn't require differentiation use "
                               "var_no_grad = var.detach().")
        _unflag_leaf(rec, x)
        return
    if not value:
        return
    origin = rec.unflagged_leaves.get((x.node, x.slot))
    if origin is not None:
        _reflag_leaf(rec, x, origin)
        return
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise RuntimeError("only Tensors of floating point and complex dtype can require gradients")
    # recorded with grad mode on: the same leaf as under no_grad (as in eager), and a group run
    # under no_grad lost the flag for later work (``with no_grad: y.requires_grad_()``)
    with torch.inference_mode(False), torch.enable_grad():
        new = rec.record(make_leaf, (x,), {})
    rebind(rec, x, new)


def _unflag_leaf(rec, x) -> None:
    """``x.requires_grad_(False)`` on a leaf that is not a plain leaf node (reliability #121): a
    written leaf (``x.data.mul_(2)`` first), a value given ``requires_grad_()``, ``copy.copy`` of
    one that requires grad. ``x`` keeps its value without autograd history; a caller's tensor
    behind it stops requiring grad after the call (its batched leaf keeps the flag it was
    recorded with: work recorded before reads it as eager's did)."""
    made_alias = rec.is_made_leaf_alias(x)
    origin = rec.leaf_origin(x)
    if made_alias:  # the view under it again, re-derived from its base (still an alias of it)
        new = rec.view_of(rec._made_leaf_view(x), rec.view_base(x))
    else:
        new = rec.record(without_history, (x,), {})
    rebind(rec, x, new)
    if made_alias:
        return
    rec.unflagged_leaves[(x.node, x.slot)] = origin
    t = rec.input_tensor_of(origin)
    if t is not None:
        rec.set_grad_flag_after(t, False)


def _reflag_leaf(rec, x, origin) -> None:
    """``x.requires_grad_(True)`` after :func:`_unflag_leaf`: the leaf ``origin`` again, with
    ``x``'s current value (its gradient goes to ``origin``, as eager's goes to the same tensor)."""
    node, slot = origin
    leaf = rec.lazy_type(rec, node, slot, rec._out_did(node, slot))
    with torch.enable_grad():
        new = rec.record(keep_graph, (x, leaf), {})
    rebind(rec, x, new)
    rec.note_written_leaf(x, origin)
    t = rec.input_tensor_of(origin)
    if t is not None:
        rec.set_grad_flag_after(t, True)


class HookHandle:
    """Returned by ``register_hook`` on a lazy value; ``remove()`` as in torch."""

    def __init__(self, entries, entry, inner=None):
        self._entries = entries
        self._entry = entry
        self._inner = inner

    def remove(self) -> None:
        if self._inner is not None:
            self._inner.remove()
        elif self._entry in self._entries:
            self._entries.remove(self._entry)


def register_hook(rec, x, hook):
    """A hook on lazy value ``x``: called with this instance's gradient of ``x`` (its shape)."""
    rec.check_owner(x, register_hook)
    if not rec.requires_grad_of(x):
        raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
    if rec.node_sid(x.node) == 0:
        h = rec.leaf_value(x.node).register_hook(hook)  # a real tensor: eager's semantics as is
        return HookHandle(None, None, h)
    entries = rec.hooks.setdefault(x.node, [])
    entry = (x.slot, hook)
    entries.append(entry)
    if rec.is_done(x.node):  # already computed (after a sync): hook its row of the result now
        rec.attach_hooks([x.node])
    return HookHandle(entries, entry)


def leaf_hook(entries: list, slot: int):
    """A hook on an instance's own leaf (a value given ``requires_grad_()``: execute.py) that
    applies the hooks of ``entries`` for output ``slot``, before its ``.grad`` accumulates."""

    def h(grad):
        new = None
        for s, fn in list(entries):
            if s == slot:
                r = fn(grad if new is None else new)
                if r is not None:
                    new = r
        return new

    return h


def row_hook(row: int, entries: list, slot: int):
    """A hook on a batched gradient that applies the hooks of ``entries`` for output ``slot``
    (this instance's, read when the hook fires so that ``remove()`` still works) to row ``row``."""

    def h(grad):
        g_row = grad[row]
        new = None
        for s, fn in list(entries):
            if s != slot:
                continue
            r = fn(g_row if new is None else new)
            if r is not None:
                new = r
        if new is None:
            return None
        out = grad.clone()
        out[row] = new
        return out

    return h


__all__ = ["is_inplace_call", "inplace", "setitem", "set_requires_grad", "register_hook", "make_leaf", "leaf_hook",
           "setitem_functional", "write", "row_hook", "HookHandle"]


# -- custom autograd.Function calls --------------------------------------------------------------
#
# ``MyFunction.apply(lazy)`` does not go through ``__torch_function__``: torch would run the
# forward on lazy values with grad disabled and lose the function's backward. While any
# ``autobatch`` call runs, ``torch.autograd.Function.apply`` is wrapped: with lazy arguments (and a
# recorder active in this thread) the call is recorded as one operation, ``FunctionApply(cls)``;
# otherwise the original runs unchanged. A forward that reads values runs per instance on concrete
# rows (counted in eager_ops); one without a vmap rule runs per instance when batched (counted in
# fallbacks); either way with its own backward, as in eager.

import threading as _threading

_apply_lock = _threading.Lock()
_apply_users = 0
_orig_apply = None
_APPLIES: dict = {}


class FunctionApply:
    """``cls.apply`` as a recordable operation (one object per autograd.Function class)."""

    __slots__ = ("cls", "__name__", "__weakref__")

    def __init__(self, cls):
        self.cls = cls
        self.__name__ = f"{cls.__name__}.apply"

    def __call__(self, *args, **kwargs):
        return _orig_apply.__func__(self.cls, *args, **kwargs)

    def __repr__(self):
        return f"<autograd.Function {self.cls.__qualname__}.apply>"


def _apply_wrapper(cls, *args, **kwargs):
    from batchcraft.autobatching import stack
    from batchcraft.autobatching.lazy import LazyTensor

    rec = stack.current()
    if rec is not None and any(type(a) is LazyTensor for a in args) or (
            rec is not None and any(type(v) is LazyTensor for v in kwargs.values())):
        fa = _APPLIES.get(cls)
        if fa is None:
            fa = _APPLIES[cls] = FunctionApply(cls)
        return rec.record(fa, args, kwargs)
    return _orig_apply.__func__(cls, *args, **kwargs)


def intercept_function_apply(on: bool) -> None:
    """Count one more (``on``) or one fewer user of the ``Function.apply`` wrapper."""
    global _apply_users, _orig_apply
    Function = torch.autograd.Function
    with _apply_lock:
        if on:
            if _apply_users == 0:
                _orig_apply = Function.__dict__["apply"]
                Function.apply = classmethod(_apply_wrapper)
            _apply_users += 1
        else:
            _apply_users -= 1
            if _apply_users == 0 and _orig_apply is not None:
                Function.apply = _orig_apply
