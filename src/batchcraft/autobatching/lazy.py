"""Lazy values: placeholders for per-instance tensors whose computation is recorded.

A :class:`LazyTensor` is not a ``torch.Tensor`` (a plain object keeps recording cheap). It
names one output slot of one recorded node of its recorder: ``(rec, node, slot, did)``,
with ``did`` the interned ``(shape, dtype, device)`` descriptor (:mod:`descs`), so shape,
dtype and device are known at record time and instance code may read them freely. Reading a
*value* (``bool``, ``item``, ``int``, indexing a Python list with it) asks the recorder to
materialise it: the instance's fiber waits while pending work runs batched.

Operators, common Tensor methods and ``__torch_function__`` live in the base class: the C
core's ``LazyBase`` when it was built (about 40 ns an operator), else :class:`_PyLazyBase`.
Both send the call to the *active* recorder (``stack.current()``), which checks that the
value is its own. In-place methods and item assignment are functionalised by the recorder
(issue 15): the handle is re-pointed at the out-of-place result.
"""

from __future__ import annotations

import builtins
import copy

import torch

from batchcraft.autobatching import _native, stack
from batchcraft.autobatching.descs import DESCS, SIZES
from batchcraft.autobatching.patches import SharedPatch
from batchcraft.errors import AutobatchError, UnsupportedOperationError

_current = stack.current

#: properties that are permuting views: all dims reversed, or the last two swapped
_PERMUTING_PROPERTIES = {"T": "all", "H": "all", "mT": "last_two", "mH": "last_two"}

#: Tensor methods and operators the base class forwards without ``__getattr__`` (hot paths).
FAST_METHODS = (
    "sigmoid", "tanh", "relu", "exp", "log", "sum", "mean", "view", "reshape", "unsqueeze",
    "squeeze", "transpose", "t", "permute", "contiguous", "float", "to", "clone", "detach",
    "softmax", "log_softmax", "max", "min", "argmax", "expand", "flatten", "chunk", "split",
    "index_select", "narrow", "masked_fill", "matmul", "mm", "abs", "pow", "sqrt", "clamp",
    "add", "sub", "mul", "div", "neg", "type_as", "new_zeros", "new_ones", "new_full",
    "new_tensor", "norm", "select", "gather", "repeat", "long", "int", "double", "bool", "half",
    "expand_as", "view_as", "reshape_as", "amax", "amin", "cumsum",
)
BINARY_OPS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
              "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__pow__", "__rpow__",
              "__matmul__", "__rmatmul__", "__and__", "__or__", "__xor__", "__lt__", "__le__",
              "__gt__", "__ge__", "__eq__", "__ne__", "__getitem__", "__lshift__", "__rshift__")
UNARY_OPS = ("__neg__", "__abs__", "__invert__", "__pos__")
INPLACE_OPS = ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
               "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__")


_tf_len = torch._C._len_torch_function_stack
_tf_at = torch._C._get_function_stack_at
_tf_enabled = torch._C._is_torch_function_mode_enabled


def user_mode_on_top(rec) -> bool:
    """A torch-function mode that instance code entered is innermost (above ``rec``'s own mode,
    torch functions enabled). Methods and operators of lazy values do not pass through torch's
    dispatch, so such a mode would not see them (bug #49): the recorder's ``under_user_mode``
    runs them instead. A block's tracer has no mode: never."""
    n = _tf_len()
    if n <= 1:
        return False
    mode = getattr(rec, "mode", None)
    return mode is not None and _tf_at(n - 1) is not mode and _tf_enabled()


def declined(func) -> TypeError:
    """Eager's error when every handler declined ``func``: torch reaches a lazy value's
    ``__torch_function__`` with a mode of the user's innermost only after that mode returned
    ``NotImplemented`` (bug #57); answering would hide the mode's refusal."""
    name = getattr(func, "__qualname__", None) or repr(func)
    return TypeError(f"Multiple dispatch failed for '{name}'; all __torch_function__ handlers returned "
                     "NotImplemented (a torch-function mode entered in instance code declined it)")


#: the hint of every "lazy value used outside its call" error
ESCAPE_HINT = ("return lazy values from the per-instance function; they come back as tensors. A value "
               "stored on a module or elsewhere by a call that raised can be left lazy where the "
               "call's batched work could not run: assign it again")

def _call(func, args, kwargs):
    rec = _active()
    if user_mode_on_top(rec):
        return rec.under_user_mode(func, args, kwargs)
    return rec.record(func, args, kwargs)


def _active():
    rec = _current()
    if rec is None:
        raise AutobatchError(
            "a lazy value was used outside batchcraft.autobatch",
            hint=ESCAPE_HINT)
    return rec


class _PyLazyBase:
    """Pure-Python operators of lazy values (used when the C core was not built)."""

    __slots__ = ("rec", "node", "slot", "did", "base", "__weakref__")

    def __init__(self, rec, node: int, slot: int, did: int):
        self.rec = rec
        self.node = node
        self.slot = slot
        self.did = did
        self.base = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        rec = _active()
        if user_mode_on_top(rec):
            raise declined(func)
        return rec.record(func, args, kwargs or {})


def _py_method(func):
    def meth(self, *args, **kwargs):
        return _call(func, (self, *args), kwargs)

    meth.__name__ = func.__name__
    return meth


def _py_binary(func):
    def op(self, other):
        return _call(func, (self, other), {})

    op.__name__ = func.__name__
    return op


def _py_unary(func):
    def op(self):
        return _call(func, (self,), {})

    op.__name__ = func.__name__
    return op


def _py_inplace(name):
    func = getattr(torch.Tensor, name)

    def op(self, other):
        return _active().inplace(self, func, (self, other), {})

    op.__name__ = name
    return op


for _n in BINARY_OPS:
    setattr(_PyLazyBase, _n, _py_binary(getattr(torch.Tensor, _n)))
for _n in UNARY_OPS:
    setattr(_PyLazyBase, _n, _py_unary(getattr(torch.Tensor, _n)))
for _n in FAST_METHODS:
    setattr(_PyLazyBase, _n, _py_method(getattr(torch.Tensor, _n)))
for _n in INPLACE_OPS:
    setattr(_PyLazyBase, _n, _py_inplace(_n))

if _native.core is not None:
    _Base = _native.core.LazyBase
else:
    _Base = _PyLazyBase


class LazyTensor(_Base):
    """A per-instance tensor inside ``batchcraft.autobatch``: one output of a recorded node.

    Attributes:
        rec: the recorder that owns the node.
        node (int): the node's index in that recorder's graph.
        slot (int): which output of the node.
        did (int): descriptor id; ``desc`` is ``(shape, dtype, device)``.
        base: the lazy value this one is a view of (None if it is not a view).
    """

    __slots__ = ()

    # -- metadata: known at record time ------------------------------------------------------
    @property
    def desc(self) -> tuple:
        return DESCS[self.did]

    @property
    def shape(self) -> torch.Size:
        self.rec.note_shape()
        return SIZES[self.did]

    @property
    def dtype(self) -> torch.dtype:
        return DESCS[self.did][1]

    @property
    def device(self) -> torch.device:
        return DESCS[self.did][2]

    @property
    def ndim(self) -> int:
        self.rec.note_shape()
        return len(DESCS[self.did][0])

    @property
    def is_cuda(self) -> bool:
        return DESCS[self.did][2].type == "cuda"

    @property
    def is_meta(self) -> bool:
        return DESCS[self.did][2].type == "meta"

    @property
    def layout(self):
        return torch.strided

    @property
    def data(self):
        """``y.data``: an alias of the value without autograd history, as ``y.detach()`` (writes
        through it reach ``y``: views.py)."""
        return self.detach()

    @property
    def requires_grad(self) -> bool:
        return self.rec.requires_grad_of(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.rec.set_requires_grad(self, bool(value))

    @property
    def is_leaf(self) -> bool:
        return self.rec.is_leaf_of(self)

    @property
    def grad_fn(self):
        return self.rec.grad_fn_of(self)

    @property
    def grad(self):
        return None

    def requires_grad_(self, requires_grad: bool = True):
        self.rec.set_requires_grad(self, bool(requires_grad))
        return self

    @property
    def _is_param(self) -> bool:  # read by ``isinstance(x, nn.Parameter)``
        return False

    @_is_param.setter
    def _is_param(self, value) -> None:
        # nn.Parameter(per-instance value): a module built inside instance code would keep a
        # lazy value after the call, and its parameters would get no .grad
        raise UnsupportedOperationError(
            "nn.Parameter made inside instance code under batchcraft.autobatch (a module built, or a "
            "lazy module initialised, there: its parameters would be per-instance values)",
            hint="build the module before the autobatch call (for nn.Lazy* modules, run one eager "
                 "forward first) and call it inside the instance code")

    def register_hook(self, hook):
        return self.rec.register_hook(self, hook)

    def is_floating_point(self) -> bool:
        return DESCS[self.did][1].is_floating_point

    def is_complex(self) -> bool:
        return DESCS[self.did][1].is_complex

    def size(self, dim: int | None = None):
        self.rec.note_shape()
        s = SIZES[self.did]
        return s if dim is None else s[dim]

    def dim(self) -> int:
        self.rec.note_shape()
        return len(DESCS[self.did][0])

    def numel(self) -> int:
        self.rec.note_shape()
        n = 1
        for d in DESCS[self.did][0]:
            n *= d
        return n

    nelement = numel

    def element_size(self) -> int:
        return DESCS[self.did][1].itemsize

    def __len__(self) -> int:
        self.rec.note_shape()
        shape = DESCS[self.did][0]
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]

    def __repr__(self) -> str:
        shape, dtype, _ = DESCS[self.did]
        return f"LazyTensor(shape={tuple(shape)}, dtype={dtype}, op={self.rec.node_name(self.node)})"

    __hash__ = object.__hash__

    # -- value access: needs concrete values --------------------------------------------------
    def _convert(self, why: str, to):
        """``to(value)`` of the concrete value. With only the recorder's mode active, torch
        functions are off: converting a plain tensor is nothing to record (through the mode it
        cost a signature lookup and a concrete call at every wait). A mode of the user's, pushed
        inside the instance, still sees the conversion, as in eager."""
        v = self.rec.materialize(self, why)
        if torch._C._len_torch_function_stack() > 1:
            return to(v)
        with torch._C.DisableTorchFunction():
            return to(v)

    def __str__(self):
        """``str(x)``, ``print(x)``: the value, as eager prints it (a value wait). While a static
        block is traced there is no value yet: the lazy description (a debugging print inside a
        block keeps working)."""
        if self.rec.is_tracer:
            return repr(self)
        return self._convert("convert a tensor to str", torch.Tensor.__str__)

    def __format__(self, spec):
        """f-strings and ``format``: a 0-d value formats as its Python number (``f"{x:.2f}"``),
        anything else as ``str``, as ``torch.Tensor.__format__`` does (a value wait)."""
        if self.rec.is_tracer:
            return format(repr(self), spec)
        return self._convert("format a tensor", lambda v: torch.Tensor.__format__(v, spec))

    def __bool__(self):
        if torch._C._len_torch_function_stack() > 1:
            return self._convert("use a tensor as a Python bool", bool)
        return self.rec.scalar(self, "use a tensor as a Python bool", bool)

    def item(self):
        if torch._C._len_torch_function_stack() > 1:
            return self._convert("call .item()", torch.Tensor.item)
        return self.rec.scalar(self, "call .item()", torch.Tensor.item)

    def tolist(self):
        return self._convert("call .tolist()", torch.Tensor.tolist)

    def __int__(self):
        if torch._C._len_torch_function_stack() > 1:
            return self._convert("convert a tensor to int", int)
        return self.rec.scalar(self, "convert a tensor to int", int)

    def __float__(self):
        if torch._C._len_torch_function_stack() > 1:
            return self._convert("convert a tensor to float", float)
        return self.rec.scalar(self, "convert a tensor to float", float)

    def __index__(self):
        return self._convert("use a tensor as a Python index", torch.Tensor.__index__)

    def numpy(self):
        return self._convert("call .numpy()", torch.Tensor.numpy)

    def data_ptr(self):
        """The address of the value's first element (a value wait): values have addresses of their
        own and views point into their base's, as in eager (before, the placeholder's 0:
        reliability #276). An in-place update gives a value a new address (values are
        functional), where eager's stays."""
        return self.rec.data_ptr_of(self) if hasattr(self.rec, "data_ptr_of") else \
            self._convert("call .data_ptr()", torch.Tensor.data_ptr)

    # -- copy module: as torch.Tensor's protocol does (reliability #67) -------------------------
    def __copy__(self):
        """``copy.copy``: a tensor sharing this one's storage, without autograd history (as
        ``copy.copy`` of a tensor, which rebuilds it from its storage)."""
        out = self.detach()
        return out.requires_grad_(True) if self.requires_grad else out

    def __deepcopy__(self, memo):
        """``copy.deepcopy``: a new leaf with this value (and its ``requires_grad``); like
        eager, refused for a value computed with autograd history."""
        if id(self) in memo:
            return memo[id(self)]
        if self.base is not None and not self.requires_grad and self.base.is_leaf:
            # a view: the same view of its base's copy, so that copies of views of one value share
            # one new storage, as eager's deep copy of their storage does
            out = self.rec.view_of(self, copy.deepcopy(self.base, memo))
            memo[id(self)] = out
            return out
        if not self.is_leaf:
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment.  If you were attempting to deepcopy a module, this may "
                               "be because of a torch.nn.utils.weight_norm usage, see "
                               "https://github.com/pytorch/pytorch/pull/103001")
        out = self.detach().clone()
        if self.requires_grad:
            out.requires_grad_(True)
        memo[id(self)] = out
        return out

    def __iter__(self):
        self.rec.note_shape()
        shape = DESCS[self.did][0]
        if not shape:
            raise TypeError("iteration over a 0-d tensor")
        # as torch.Tensor.__iter__: one unbind (one recorded op, views of self) instead of a
        # getitem per row, which instances of different lengths could not share
        return iter(self.unbind(0))

    # -- in-place updates: functionalised by the recorder ------------------------------------
    def __setitem__(self, key, value):
        _active().setitem(self, key, value)

    def __getattr__(self, name: str):
        # Tensor methods not spelled out in the base class go through the recorder.
        if name.startswith("__"):
            raise AttributeError(name)
        method = getattr(torch.Tensor, name, None)
        if method is None:
            raise AttributeError(f"'LazyTensor' (a Tensor inside batchcraft.autobatch) has no attribute {name!r}")
        if name.endswith("_") and not name.endswith("__"):
            def inplace(*args, **kwargs):
                return _active().inplace(self, method, (self, *args), kwargs)

            inplace.__name__ = name
            return inplace
        if not callable(method):
            # .T and .mT (.H and .mH of a real value) as the view calls they are, so that writes
            # through them reach this value (a hostile find, stop 49: recorded as the property,
            # not a view, they were lost)
            swap = _PERMUTING_PROPERTIES.get(name)
            if swap is not None and (name in ("T", "mT") or not self.dtype.is_complex) \
                    and not user_mode_on_top(self.rec):  # (a mode of the user's sees the property)
                if swap == "last_two":
                    return self.transpose(-2, -1)
                return self.permute(*reversed(range(self.dim()))) if self.dim() != 2 else self.t()
            # other properties: computed through the recorder
            if hasattr(method, "__get__"):
                return _call(method.__get__, (self,), {})
            raise AttributeError(name)

        def bound(*args, **kwargs):
            return _call(method, (self, *args), kwargs)

        bound.__name__ = name
        return bound


if _native.core is not None:
    # the C base creates instances of this class and forwards these methods by table
    _native.core.setup_lazy(LazyTensor, {n: getattr(torch.Tensor, n) for n in FAST_METHODS + BINARY_OPS + UNARY_OPS},
                            {n: getattr(torch.Tensor, n) for n in INPLACE_OPS})



_builtin_print = builtins.print


def _print(*args, **kwargs):
    """``print`` while a call records: the arguments are converted before anything is written.
    ``print`` writes each argument after converting it, and ``str()`` of a pending value waits
    (other instances run meanwhile): ``print("loss", x, "end")`` would interleave the lines of
    different instances (a hostile find, stop 35). The text written is the same."""
    if any(type(a) is LazyTensor for a in args):
        args = [a if type(a) is str else str(a) for a in args]
    return _builtin_print(*args, **kwargs)


#: enter/exit around a recording call (runtime.py)
ATOMIC_PRINT = SharedPatch(builtins, "print", _print)

__all__ = ["LazyTensor", "FAST_METHODS", "user_mode_on_top", "ATOMIC_PRINT"]
