"""Lazy values: placeholders for per-instance tensors whose computation is recorded.

A :class:`LazyTensor` is a plain Python object (not a ``torch.Tensor``
subclass: that keeps recording at a few microseconds per operation). Torch
functions reach the recorder through the recording ``TorchFunctionMode`` or
the class's ``__torch_function__``; Tensor methods and operators are forwarded
here explicitly. Shape, dtype and device are known at record time (inferred per
signature), so instance code may read them freely; reading a *value*
(``bool``, ``item``, ``tolist``, ``int``, indexing Python lists with it) asks
the runtime to materialise it.
"""

from __future__ import annotations

import torch

from batchcraft.errors import AutobatchError, UnsupportedOperationError

_state = None  # set by batchcraft.autobatching.recorder (avoids an import cycle)


def _record(func, args, kwargs=None):
    rec = _state.current()
    if rec is None:
        raise AutobatchError(
            f"a lazy value was used outside batchcraft.autobatch (in {getattr(func, '__name__', func)})",
            hint="return lazy values from the per-instance function; they come back as tensors",
        )
    return rec.record(func, args, kwargs or {})


def _materialize(x, why: str):
    rec = _state.current()
    if rec is None:
        raise AutobatchError(f"cannot {why}: the lazy value escaped its batchcraft.autobatch call")
    return rec.materialize(x, why)


_DESC_IDS: dict = {}


def desc_id(desc: tuple) -> int:
    """Interned small int for a (shape, dtype, device) descriptor: cheap to hash in signatures."""
    i = _DESC_IDS.get(desc)
    if i is None:
        i = _DESC_IDS[desc] = len(_DESC_IDS) + 1
    return i


def _note_shape():
    """Tell a static-block tracer that the block reads shapes (so it cannot be called directly)."""
    rec = _state.current()
    if rec is not None and rec.__class__.__name__ == "TraceRecorder":
        rec.shape_dependent = True


class LazyTensor:
    """A per-instance tensor inside ``batchcraft.autobatch``: one output slot of a recorded node.

    Attributes:
        node: the recorded operation (or leaf) that produces it.
        slot (int): which output of that operation.
        desc (tuple): ``(shape, dtype, device)`` of the per-instance value.
    """

    __slots__ = ("node", "slot", "desc", "did", "__weakref__")

    def __init__(self, node, slot: int, desc: tuple, did: int | None = None):
        self.node = node
        self.slot = slot
        self.desc = desc
        self.did = desc_id(desc) if did is None else did

    # -- metadata: known at record time, free to read --------------------------------------
    @property
    def shape(self) -> torch.Size:
        _note_shape()
        return torch.Size(self.desc[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.desc[1]

    @property
    def device(self) -> torch.device:
        return self.desc[2]

    @property
    def ndim(self) -> int:
        _note_shape()
        return len(self.desc[0])

    @property
    def is_cuda(self) -> bool:
        return self.desc[2].type == "cuda"

    @property
    def requires_grad(self) -> bool:
        return self.node.requires_grad

    @property
    def is_floating_point_(self):  # pragma: no cover - alias guard
        return self.desc[1].is_floating_point

    def is_floating_point(self) -> bool:
        return self.desc[1].is_floating_point

    def size(self, dim: int | None = None):
        _note_shape()
        shape = self.desc[0]
        return torch.Size(shape) if dim is None else shape[dim]

    def dim(self) -> int:
        _note_shape()
        return len(self.desc[0])

    def numel(self) -> int:
        _note_shape()
        n = 1
        for d in self.desc[0]:
            n *= d
        return n

    def __len__(self) -> int:
        _note_shape()
        if not self.desc[0]:
            raise TypeError("len() of a 0-d tensor")
        return self.desc[0][0]

    def __repr__(self) -> str:
        op = getattr(self.node, "name", "?")
        return f"LazyTensor(shape={tuple(self.desc[0])}, dtype={self.desc[1]}, op={op})"

    __hash__ = object.__hash__

    # -- torch functions ---------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _record(func, args, kwargs)

    # -- value access: needs concrete values -------------------------------------------------
    def __bool__(self):
        return bool(_materialize(self, "use a tensor as a Python bool"))

    def item(self):
        return _materialize(self, "call .item()").item()

    def tolist(self):
        return _materialize(self, "call .tolist()").tolist()

    def __int__(self):
        return int(_materialize(self, "convert a tensor to int"))

    def __float__(self):
        return float(_materialize(self, "convert a tensor to float"))

    def __index__(self):
        return _materialize(self, "use a tensor as a Python index").__index__()

    def numpy(self):
        return _materialize(self, "call .numpy()").numpy()

    def __iter__(self):
        _note_shape()
        if not self.desc[0]:
            raise TypeError("iteration over a 0-d tensor")
        return iter([self[i] for i in range(self.desc[0][0])])

    # -- in-place updates are not supported on lazy values -----------------------------------
    def __setitem__(self, key, value):
        raise UnsupportedOperationError(
            "in-place assignment x[...] = v on a lazy value is not supported inside batchcraft.autobatch",
            hint="build the tensor out of place, e.g. with torch.where, torch.cat or index_put",
        )

    def __getattr__(self, name: str):
        # Tensor methods not spelled out below: forward to the recorder.
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "requires_grad_":
            raise UnsupportedOperationError(
                ".requires_grad_() on a lazy value is not supported inside batchcraft.autobatch",
                hint="make the tensor require grad before the call and pass it in the instance "
                     "(or capture it from outside); results are differentiable as usual",
            )
        if name.endswith("_") and not name.endswith("__") and hasattr(torch.Tensor, name):
            raise UnsupportedOperationError(
                f"in-place method .{name}() on a lazy value is not supported inside batchcraft.autobatch",
                hint=f"use the out-of-place form .{name[:-1]}()",
            )
        method = getattr(torch.Tensor, name, None)
        if method is None:
            raise AttributeError(f"'LazyTensor' (a Tensor inside batchcraft.autobatch) has no attribute {name!r}")
        if not callable(method):
            # properties such as .T, .mT, .H: compute through the recorder
            prop = getattr(torch.Tensor, name)
            if isinstance(prop, property) or hasattr(prop, "__get__"):
                return _record(prop.__get__, (self,))
            raise AttributeError(name)

        def bound(*args, **kwargs):
            return _record(method, (self, *args), kwargs)

        bound.__name__ = name
        return bound


def _binary(name):
    method = getattr(torch.Tensor, name)

    def op(self, other):
        return _record(method, (self, other))

    op.__name__ = name
    return op


def _unary(name):
    method = getattr(torch.Tensor, name)

    def op(self):
        return _record(method, (self,))

    op.__name__ = name
    return op


for _n in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
           "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__pow__", "__rpow__",
           "__matmul__", "__rmatmul__", "__and__", "__or__", "__xor__", "__lt__", "__le__",
           "__gt__", "__ge__", "__eq__", "__ne__", "__getitem__", "__lshift__", "__rshift__"):
    setattr(LazyTensor, _n, _binary(_n))
for _n in ("__neg__", "__abs__", "__invert__", "__pos__"):
    setattr(LazyTensor, _n, _unary(_n))
for _n in ("sigmoid", "tanh", "relu", "exp", "log", "sum", "mean", "view", "reshape", "unsqueeze",
           "squeeze", "transpose", "t", "permute", "contiguous", "float", "to", "clone", "detach",
           "softmax", "log_softmax", "max", "min", "argmax", "expand", "flatten", "chunk", "split",
           "index_select", "narrow", "masked_fill", "matmul", "mm", "abs", "pow", "sqrt", "clamp",
           "add", "sub", "mul", "div", "neg", "type_as", "new_zeros", "new_ones", "new_full",
           "new_tensor", "norm", "select", "gather", "repeat", "long", "int", "double", "bool", "half"):
    _m = getattr(torch.Tensor, _n)

    def _make(m):
        def meth(self, *args, **kwargs):
            return _record(m, (self, *args), kwargs)

        meth.__name__ = m.__name__
        return meth

    setattr(LazyTensor, _n, _make(_m))
