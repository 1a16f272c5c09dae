"""Static blocks: straight-line code scheduled and batched as one unit.

``static_block(fn_or_module)`` marks code without data-dependent control flow
(ACRoBat §4.1, grain-size coarsening). Inside ``autobatch`` a call of the block
is recorded as *one* node. The first call with a given signature traces the
block's body once, at per-instance shapes, into a straight-line program; each
group of block nodes then replays that program on batched values, op by op,
through the same batching rules as ordinary operations. Outside ``autobatch``
the block is an ordinary call.

Rules for block code: no branching on tensor *values* (a clear error is raised);
Python control flow on shapes or on non-tensor arguments is fine, because those
are part of the signature. A module block re-traces when its parameters,
buffers or ``training`` flags change.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from batchcraft.autobatching import recorder as _rec
from batchcraft.autobatching.lazy import LazyTensor
from batchcraft.autobatching.signature import LEAF, SigInfo, flatten, rebuild
from batchcraft.errors import AutobatchError

_current = _rec.current


class _Input:
    """Placeholder node for the j-th tensor argument of a block being traced."""

    __slots__ = ("index", "outs", "depth", "phase", "requires_grad", "name")

    def __init__(self, index):
        self.index = index
        self.outs = None
        self.depth = 0
        self.phase = 0
        self.requires_grad = False
        self.name = f"input{index}"


class _Step:
    """One operation of a traced block program."""

    __slots__ = ("index", "func", "struct", "refs", "shapes", "mask_static", "batched", "n_out",
                 "outs", "depth", "phase", "requires_grad", "name", "owner", "grad", "out_descs", "info")

    def __init__(self, index, func, struct, refs, shapes, batched, n_out, owner, grad):
        self.index = index
        self.func = func
        self.struct = struct
        self.refs = refs
        self.shapes = shapes
        self.batched = batched
        self.n_out = n_out
        self.owner = owner
        self.grad = grad
        self.outs = None
        self.depth = 0
        self.phase = 0
        self.requires_grad = False
        self.name = getattr(func, "__name__", type(func).__name__)


class Program:
    """A traced block: steps in order, plus how to assemble the block's outputs.

    ``direct`` is True when every batched step is transparent (see
    :func:`batchcraft.autobatching.rules.is_transparent`) and the body never read a shape:
    then the block's own function is called on the batched inputs (checked, with the
    step-by-step replay as fallback).
    """

    def __init__(self, steps, out_struct, out_refs, out_descs, direct=False):
        self.steps = steps
        self.out_struct = out_struct
        self.out_refs = out_refs
        self.out_descs = out_descs
        self.direct = direct


class TraceRecorder:
    """Records a block's body at per-instance shapes into a :class:`Program`."""

    def __init__(self, block, parent):
        self.block = block
        self.parent = parent
        self.steps: list[_Step] = []
        self.instance = getattr(parent, "instance", -1)
        self.shape_dependent = False
        self.blocks_checked = getattr(parent, "blocks_checked", set())

    def _ref(self, x):
        if type(x) is LazyTensor:
            nd = x.node
            if type(nd) is _Input:
                return ("in", nd.index), True
            if type(nd) is _Step and nd.owner is self:
                return ("val", nd.index, x.slot), nd.batched
            raise AutobatchError(
                f"static block {self.block.name!r} uses a lazy value that was not passed to it as an argument",
                hint="pass every per-instance tensor the block reads as an argument of the block call",
            )
        return ("const", x), False

    def record(self, func, args, kwargs):
        leaves: list = []
        struct = (flatten(args, leaves), flatten(kwargs, leaves) if kwargs else None)
        refs, descs, shapes, mask = [], [], [], []
        device = None
        for x in leaves:
            ref, batched = self._ref(x)
            refs.append(ref)
            mask.append(batched)
            if type(x) is LazyTensor:
                descs.append(x.desc)
                shapes.append(x.desc[0])
                device = device or x.desc[2]
            else:
                descs.append(("shared", id(x), x.shape, x.dtype, x.device))
                shapes.append(tuple(x.shape))
                device = device or x.device
        grad = torch.is_grad_enabled()
        key = (func, struct, tuple(descs), grad)
        info = _rec._META_CACHE.get(key)
        if info is None:
            if isinstance(func, StaticBlock):
                info = func.trace(struct, leaves, device, key, parent=self)
            else:
                try:
                    info = _rec.infer_outputs(func, struct, leaves, device or torch.device("cpu"))
                except (NotImplementedError, RuntimeError, TypeError) as exc:
                    raise AutobatchError(
                        f"static block {self.block.name!r}: {getattr(func, '__name__', func)} cannot be "
                        f"traced at per-instance shapes ({exc})",
                        hint="operations whose output shape depends on tensor values cannot be in a static block",
                    ) from exc
                info = _rec._META_CACHE[key] = SigInfo(key, *info)
        out_struct, out_descs = info.out_struct, info.out_descs
        step = _Step(len(self.steps), func, struct, refs, shapes, any(mask), len(out_descs), self, grad)
        step.mask_static = tuple(mask)
        step.out_descs = out_descs
        step.info = info
        self.steps.append(step)
        outs = [LazyTensor(step, i, d) for i, d in enumerate(out_descs)]
        return outs[0] if out_struct is LEAF else rebuild(out_struct, iter(outs))

    def materialize(self, x, why):
        raise AutobatchError(
            f"static block {self.block.name!r} tried to {why}; static blocks must not branch on tensor values",
            hint="move the value-dependent branch out of the block, or do not mark this code static_block",
        )

    def leaf(self, value, pyvalue=None):  # pragma: no cover - not used in traces
        return value


class StaticBlock:
    """A callable marked as a static block; see :func:`static_block`."""

    def __init__(self, fn, module: nn.Module | None = None, name: str | None = None):
        self.fn = fn
        self.module = module
        self.name = name or getattr(fn, "__qualname__", None) or type(module).__name__
        self.__name__ = self.name
        self._programs: dict = {}
        self._fingerprint = None
        functools.update_wrapper(self, fn, updated=()) if not isinstance(fn, nn.Module) else None

    def __call__(self, *args, **kwargs):
        rec = _current()
        if rec is None:
            return self.fn(*args, **kwargs)
        return self.record_in(rec, args, kwargs)

    def record_in(self, rec, args, kwargs):
        """Record one call of the block with the active recorder ``rec``."""
        if self not in rec.blocks_checked:
            self._check_fingerprint()
            rec.blocks_checked.add(self)
        # without lazy arguments the recorder runs the block now and makes its outputs leaves
        return rec.record(self, args, kwargs)

    def __get__(self, obj, objtype=None):  # decorating a method
        if obj is None:
            return self
        return functools.partial(self.__call__, obj)

    def _fingerprint_now(self):
        if self.module is None:
            return None
        tensors = tuple((id(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)
                        for t in list(self.module.parameters()) + list(self.module.buffers()))
        return tensors + tuple(m.training for m in self.module.modules())

    def _check_fingerprint(self) -> None:
        fp = self._fingerprint_now()
        if fp != self._fingerprint:
            for key in self._programs:
                _rec._META_CACHE.pop(key, None)
            for fkey in [k for k in _rec._FAST_CACHE if k[0] is self]:
                del _rec._FAST_CACHE[fkey]
            self._programs.clear()
            self._fingerprint = fp

    def program(self, key) -> Program:
        return self._programs[key]

    def trace(self, struct, leaves, device, key, parent=None):
        """Trace the body at per-instance shapes; cache and return (out_struct, out_descs)."""
        tracer = TraceRecorder(self, parent if parent is not None else _rec.current())
        placeholders = []
        j = 0
        for x in leaves:
            if type(x) is LazyTensor:
                placeholders.append(LazyTensor(_Input(j), 0, x.desc))
            else:
                placeholders.append(x)
            j += 1
        it = iter(placeholders)
        args = rebuild(struct[0], it)
        kwargs = rebuild(struct[1], it) if struct[1] is not None else {}
        _rec.push(tracer)
        try:
            out = self.fn(*args, **kwargs)
        finally:
            _rec.pop()
        out_leaves: list = []
        out_struct = flatten(out, out_leaves)
        out_refs, out_descs = [], []
        for x in out_leaves:
            if type(x) is LazyTensor:
                out_refs.append(tracer._ref(x)[0])
                out_descs.append(x.desc)
            elif isinstance(x, torch.Tensor):
                out_refs.append(("const", x))
                out_descs.append((tuple(x.shape), x.dtype, device))
            else:
                raise AutobatchError(f"static block {self.name!r} returned a non-tensor inside its outputs "
                                     f"({type(x).__name__})")
        direct = not tracer.shape_dependent and all(_step_transparent(st) for st in tracer.steps) \
            and all(r[0] != "const" for r in out_refs)
        if isinstance(self.module, _RNN_CELLS) and all(
                len(x.desc[0]) == 1 for x in leaves if type(x) is LazyTensor):
            # these cells read input.dim() but accept a batch of 1-D inputs as written
            direct = all(r[0] != "const" for r in out_refs)
        prog = Program(tracer.steps, out_struct, out_refs, out_descs, direct)
        self._programs[key] = prog
        info = _rec._META_CACHE[key] = SigInfo(key, out_struct, tuple(out_descs), prog)
        return info


_RNN_CELLS = (nn.LSTMCell, nn.GRUCell, nn.RNNCell)


def _step_transparent(step) -> bool:
    if not step.batched:
        return True
    if isinstance(step.func, StaticBlock):
        return step.info.program is not None and step.info.program.direct
    from batchcraft.autobatching.rules import is_transparent

    return is_transparent(step.func, step.struct, step.mask_static, step.shapes)


class _BlockModuleMixin:
    """Makes ``module(...)`` a static-block call (used by ``static_block`` on modules)."""


def static_block(obj):
    """Mark a function, an ``nn.Module`` instance or an ``nn.Module`` class as a static block.

    A static block contains no control flow that depends on tensor values. Inside
    :func:`batchcraft.autobatch` each call is one scheduled node, and the calls of all
    instances with the same signature run as one batched replay of the block (ACRoBat
    §4.1, grain-size coarsening). Outside ``autobatch`` the block runs as usual.

    Args:
        obj: a function, a module instance, or a module class (decorator use).
    Returns:
        The same kind of object: a callable block, or a module whose calls are block calls
        (its parameters and ``state_dict`` keys are unchanged).
    Raises:
        TypeError: ``obj`` is not callable.
    Example:
        >>> cell = static_block(torch.nn.Linear(4, 4))  # per instance: x (4,) -> (4,)
    """
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        orig_call = obj.__call__

        def __call__(self, *args, **kwargs):
            blk = self.__dict__.get("_batchcraft_block")
            if blk is None:
                blk = StaticBlock(functools.partial(orig_call, self), module=self, name=type(self).__name__)
                object.__setattr__(self, "_batchcraft_block", blk)
            rec = _current()
            if rec is None:
                return blk.fn(*args, **kwargs)
            return blk.record_in(rec, args, kwargs)  # the hot path: no extra call frame

        return type(obj.__name__, (obj,), {"__call__": __call__, "__module__": obj.__module__,
                                           "__qualname__": obj.__qualname__, "__doc__": obj.__doc__})
    if isinstance(obj, nn.Module):
        blk = StaticBlock(nn.Module.__call__.__get__(obj), module=obj, name=type(obj).__name__)
        obj.__dict__["_batchcraft_block"] = blk
        cls = _block_class(type(obj))
        obj.__class__ = cls
        return obj
    if callable(obj):
        return StaticBlock(obj)
    raise TypeError(f"static_block: expected a function or an nn.Module, got {type(obj).__name__}")


def _restore_block_module(cls, state):
    """Unpickle a module made a static block by ``static_block(instance)``."""
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return static_block(obj)


@functools.lru_cache(maxsize=None)
def _block_class(cls):
    def __call__(self, *args, **kwargs):
        blk = self.__dict__["_batchcraft_block"]
        rec = _current()
        if rec is None:
            return blk.fn(*args, **kwargs)
        return blk.record_in(rec, args, kwargs)

    def __reduce_ex__(self, protocol):
        # pickle (torch.save, deepcopy, spawn) as the original class, made a block again on load
        state = {k: v for k, v in self.__dict__.items() if k != "_batchcraft_block"}
        return (_restore_block_module, (cls, state))

    return type(cls.__name__, (cls,), {"__call__": __call__, "__reduce_ex__": __reduce_ex__,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "_batchcraft_static": True})
