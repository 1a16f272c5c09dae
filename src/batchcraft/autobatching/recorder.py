"""Recording of per-instance operations: the pure-Python core and the slow paths of both cores.

A recorder owns the graph of one ``autobatch`` call. Every torch call that instance code
makes on a lazy value reaches :meth:`PyRecorder.record` (through the lazy class's
``__torch_function__``, its operators, or the recording mode for calls such as
``torch.tensor(word_id)``). The fast path spells the arguments with interned descriptor ids,
finds the :class:`~batchcraft.autobatching.signature.SigInfo` in one dict lookup and appends
a node: its depth is 1 + the deepest pending input (ACRoBat §4.2, inline depth), and it goes
straight into its (phase, depth, signature) bucket, so scheduling needs no pass over the graph.

The graph is kept in flat per-node lists (signature id, depth, phase, instance, inputs,
location once executed), the layout the C core (:mod:`ccore`) keeps in C arrays; both cores
share :class:`RecorderBase` for everything off the hot path: full signatures, output
inference, concrete and value-dependent calls, leaves, value requests, in-place writes,
hooks. The Python core is the reference the fuzzer compares the C core against.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from weakref import ref as _weakref

import torch

from batchcraft.autobatching import buffers as _buffers
from batchcraft.autobatching import consts
from batchcraft.autobatching import views as _views
from batchcraft.autobatching import cells as _cells
from batchcraft.autobatching import embedding as _embedding
from batchcraft.autobatching import functional as _functional
from batchcraft.autobatching.consts import CONST_FACTORIES, ConstLeaf
from batchcraft.autobatching.descs import DESCS, desc_id
from batchcraft.autobatching.devices import concrete_device, factory_device, with_factory_device
from batchcraft.autobatching.infer import NeedsValues, infer_outputs
from batchcraft.autobatching.lazy import ESCAPE_HINT, LazyTensor
from batchcraft.autobatching.mode import outside_mode as _outside_mode
from batchcraft.autobatching.plan import plan_rows
from batchcraft.autobatching.signature import (SCALAR_TYPES, SIGNATURES, SigInfo, flatten, rebuild,
                                               holds_these_shared, shared_descriptor)
from batchcraft.autobatching.threadstate import op_state
from batchcraft.autobatching.threadstate import under as _under
from batchcraft.autobatching.torchclass import RECORDING_TORCH
from batchcraft.errors import AutobatchError, StepLimitError, UnsupportedOperationError

_Lazy = LazyTensor
_StaticBlock = None  # set below (blocks import this module)
_Tensor = torch.Tensor
_DisableTorchFunction = torch._C.DisableTorchFunction
_inference_enabled = torch.is_inference_mode_enabled
_torch_tensor = torch.tensor
_TENSOR_FROM_DATA = (torch.tensor, torch.as_tensor)  # the same tensor of Python scalars
_PY_SCALARS = (int, float, bool)


def did_of(t: torch.Tensor) -> int:
    """The descriptor id of a concrete tensor."""
    return desc_id((tuple(t.shape), t.dtype, t.device))
_NO_HANDLER = torch._C._disabled_torch_function_impl
_TENSOR_FLOAT = torch.Tensor.__float__


def _has_subclass_handler(x) -> bool:
    """True for a Tensor subclass whose ``__torch_function__`` runs in eager (``Parameter``'s
    does not: its results are plain tensors)."""
    t = type(x)
    return t is not _Tensor and t is not torch.nn.Parameter and isinstance(x, _Tensor) and \
        getattr(t.__torch_function__, "__func__", t.__torch_function__) is not _NO_HANDLER


def _subclass_arg(args):
    """The first argument (or member of a list/tuple argument) that is a Tensor subclass with a
    ``__torch_function__`` of its own, or None."""
    for a in args:
        if type(a) is _Tensor:
            continue
        if type(a) is list or type(a) is tuple:
            for b in a:
                if type(b) is not _Tensor and _has_subclass_handler(b):
                    return b
        elif _has_subclass_handler(a):
            return a
    return None


def _run_with_subclass_handler(func, sub, args, kwargs):
    """``func(*args, **kwargs)`` through the subclass's ``__torch_function__`` (``sub`` is its
    argument; not the recorder's mode, which is not entered again: no lazy argument is involved)."""
    t = type(sub)
    return t.__torch_function__(func, (t,), args, kwargs or {})
_SCALAR_KW = frozenset({"dtype", "device"})
_I64 = 2 ** 63
#: ``torch.tensor([...])`` of at most this many Python scalars of one type is a list leaf
MAX_LIST_LEAF = 64
#: dtypes into which any Python int, float and bool converts without an error (overflow is inf)
_ANY_SCALAR_DTYPES = frozenset({None, torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64})


def converts_safely(t: type, dtype) -> bool:
    """Can ``torch.tensor(v, dtype=dtype)`` of a Python ``t`` (ints within int64) not fail? Leaves
    made without a tensor convert at the flush, where an error would name no instance: eager
    raises at the call for a narrow integer dtype (300 into int8) and for a float into int64
    (nan, inf, 1e30), so those calls take the general path (reliability #256)."""
    if type(dtype) is not torch.dtype and dtype is not None:
        return False
    return dtype in _ANY_SCALAR_DTYPES or (dtype is torch.int64 and t is not float)


def list_of_scalars(v) -> bool:
    """Is ``v`` a list or tuple of 1 to :data:`MAX_LIST_LEAF` Python scalars of one type (ints within
    int64), which ``torch.tensor`` turns into a 1-d tensor without looking at anything else?"""
    if type(v) not in (list, tuple) or not 0 < len(v) <= MAX_LIST_LEAF:
        return False
    t = type(v[0])
    if t not in _PY_SCALARS or any(type(x) is not t for x in v):
        return False
    return t is not int or all(-_I64 <= x < _I64 for x in v)
_CPU = torch.device("cpu")
_Uninitialized = torch.nn.parameter.UninitializedTensorMixin
_NO_BACKWARD = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
_SCALAR_SPECS: dict = {}  # (dtype, device argument) -> (dtype, torch.device, did)


_MethodWrapper = type(torch.Tensor.data.__get__)
# a concrete leaf's autograd facts, read without torch's dispatch (a mode of the user's on top
# would see our reads)
def _is_leaf(t) -> bool:
    with torch._C.DisableTorchFunction():
        return t.is_leaf


def _grad_fn(t):
    with torch._C.DisableTorchFunction():
        return t.grad_fn


def _flat_tensors(x) -> list:
    """The tensors in ``x`` (a tensor, or tuples and lists of them, nested)."""
    if isinstance(x, _Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _flat_tensors(y)]
    return []


def _flat_lazies(args, kwargs) -> list:
    """The values in ``args`` and ``kwargs`` (lists and tuples opened, one level deep)."""
    out = []
    for a in (*args, *kwargs.values()):
        if type(a) is list or type(a) is tuple:
            out.extend(a)
        else:
            out.append(a)
    return out


def _aliases_input(out, args) -> bool:
    """``out`` shares storage with a tensor argument (a view of it, ``detach()`` of it, or the
    tensor itself)."""
    if any(out is a for a in args):
        return True
    if not any(isinstance(a, _Tensor) for a in args):
        return False  # (a factory: no storage read to compare with)
    try:
        ptr = out.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (e.g. meta, sparse)
        return False
    if ptr == 0:  # an empty storage shares no memory
        return False
    for a in args:
        if isinstance(a, _Tensor):
            try:
                if a.untyped_storage().data_ptr() == ptr:
                    return True
            except (RuntimeError, NotImplementedError):
                pass
    return False


def _mask(flags) -> int:
    return sum(1 << s for s, r in enumerate(flags) if r)


def _refuse(func):
    if func in _NO_BACKWARD:
        raise UnsupportedOperationError(
            f"{getattr(func, '__qualname__', func)} inside instance code is not supported: the "
            f"instances' work has not run yet and runs batched, in one autograd graph",
            hint="return the loss from the per-instance function and call backward() on the "
                 "(summed) results after the autobatch call")


def scalar_spec(v, dtype, device):
    """(dtype, device, did) of ``torch.tensor(v, dtype=, device=)`` for a Python scalar ``v``."""
    if dtype is None:
        t = type(v)
        dtype = torch.int64 if t is int else (torch.bool if t is bool else torch.get_default_dtype())
    spec = _SCALAR_SPECS.get((dtype, device))
    if spec is None:
        dev = _CPU if device is None else concrete_device(device)  # "cuda" -> cuda:0, as its tensors say
        spec = _SCALAR_SPECS[(dtype, device)] = (dtype, dev, desc_id(((), dtype, dev)))
    return spec


#: operations that return their (non-bool) input object itself
_IDENTITY = frozenset({torch.positive, torch.Tensor.positive, torch.Tensor.__pos__})


class _PendingGradFn:
    """``grad_fn`` of a lazy value that requires grad: its node has not run yet."""

    name = "pending (batchcraft: runs batched later)"

    def __repr__(self):
        return "<batchcraft pending grad_fn>"


PENDING_GRAD_FN = _PendingGradFn()


_item = torch.Tensor.item


_NOT_INDEX = (int, bool, float, complex, str, bytes, type(None), slice, type(Ellipsis), torch.dtype, torch.device)


def _index_object(a) -> bool:
    """An int-like object of the user's (``__index__``, no ``__torch_function__``): torch's parser
    reads it as an int through ``__index__``."""
    t = type(a)
    return t not in _NOT_INDEX and hasattr(t, "__index__") and not hasattr(t, "__torch_function__")


def _has_index_object(args, kwargs) -> bool:
    for a in (*args, *(kwargs.values() if kwargs else ())):
        if _index_object(a) or (type(a) in (list, tuple) and any(_index_object(b) for b in a)):
            return True
    return False


def _read_indexes(x):
    """``x`` (args tuple, kwargs dict, a size list) with int-like objects read as ints now, in
    instance code, as eager's parser reads them at the call: their ``__index__`` may need a value
    (a wait). Recorded as opaque constants, they were read at output inference instead, where no
    value can be waited for (a hostile find, stop 49)."""
    if type(x) is dict:
        return {k: _read_indexes(v) if type(v) in (list, tuple) else (
            operator.index(v) if _index_object(v) else v) for k, v in x.items()}
    return type(x)(operator.index(a) if _index_object(a) else (
        _read_indexes(a) if type(a) in (list, tuple) else a) for a in x)


class RecorderBase:
    """What both cores share: the slow paths of recording, and value requests.

    Subclasses provide the graph: ``append(info, leaves, lens)``, ``add_leaf(value, pyvalue,
    did, rg)``, ``node_sid``, ``node_inputs``, ``location``, ``rg_bit``, ``take_buckets``,
    ``plan_group``, ``place`` and ``n_pending``.
    """

    core = "?"
    lazy_type = LazyTensor
    is_tracer = False  # a static block's tracer (blocks.BlockTracer) says True

    def setup(self, runtime, options) -> None:
        self.runtime = runtime
        self.options = options
        self.caller_inference = _inference_enabled()  # (set again as the call begins: Runtime.__call__)
        self.instance = -1
        self.phase = 0
        self.inst_steps = 0
        self.max_steps = options.max_steps
        self.max_pending = options.max_pending
        self.eager_ops = 0
        self.blocks_checked: set = set()
        self.buffers: list = []
        # first buffer -> outputs, of groups whose nodes share rows (a deduplicated group places
        # every node at its distinct input's row): a value handed out gets rows of its own first
        self.shared_rows: dict = {}
        self.scalar_rows: dict = {}  # buffer index -> (rows as Python scalars, floating): scalar()
        self.made_views: dict = {}  # id -> view of a shared tensor made by instance code this call
        self.hooks: dict = {}
        self.writebacks: list = []
        self.deferred: list = []
        self.counter_read = None  # the last float() of a tensor from outside the instance (buffers.py)
        # (node, slot) of a handle that holds a leaf requiring grad written without history
        # (``x.data.mul_(2)``, an in-place update under no_grad) -> (node, slot) of that leaf
        self.written_leaves: dict = {}
        # (node, slot) of a handle whose written leaf then stopped requiring grad
        # (``x.requires_grad_(False)``) -> (node, slot) of that leaf
        self.unflagged_leaves: dict = {}
        self.grad_flags: dict = {}  # id(caller's tensor) -> (tensor, requires_grad) set after the call
        self.keepalive: list = []
        self.input_leaves: dict = {}
        self.own_values: dict = {}  # node -> the tensor its output 0 is (a made leaf: execute.py)
        self.hooked: set = set()
        # a DeviceContext below the recording mode (torch.set_default_device): factory calls
        # of instance code get its device= as in eager (devices.py)
        self.device_changed = False  # instance code called torch.set_default_device
        self.set_factory_device(factory_device())

    def set_factory_device(self, device) -> None:
        """The device factory calls without ``device=`` use from now on (None: torch's own)."""
        self.factory_device = device

    # -- protocol used by lazy values --------------------------------------------------------
    def note_shape(self) -> None:
        """A lazy value's shape was read (only block tracing cares)."""

    def node_name(self, node: int) -> str:
        sid = self.node_sid(node)
        return "leaf" if sid == 0 else SIGNATURES.by_sid[sid].name

    def requires_grad_of(self, x) -> bool:
        return bool(self.rg_bit(x.node, x.slot))

    def leaf_origin(self, x):
        """(node, slot) of the leaf that handle ``x`` (a leaf requiring grad) stands for: its own
        unless it holds a written leaf (see :meth:`note_written_leaf`)."""
        key = (x.node, x.slot)
        return self.written_leaves.get(key, key)

    def note_written_leaf(self, x, origin) -> None:
        """Handle ``x`` now holds the leaf ``origin`` (node, slot) that requires grad, written
        without autograd history (through ``.data``/``detach()``, or in place under no_grad): its
        value is the new one, its gradient goes to ``origin`` at identity; it stays a leaf for
        :meth:`is_leaf_of`, in-place checks and ``requires_grad_``."""
        self.written_leaves[(x.node, x.slot)] = origin

    def input_tensor_of(self, origin):
        """The caller's tensor behind leaf ``origin`` (node, slot), or None (a leaf made by
        instance code)."""
        node, slot = origin
        if slot != 0 or self.node_sid(node) != 0:
            return None
        return self.input_leaves.get(node)

    def set_grad_flag_after(self, tensor, value: bool) -> None:
        """``tensor.requires_grad_(value)`` on a caller's tensor, done after the call's write-back
        (its batched leaf keeps the flag it was recorded with)."""
        self.grad_flags[id(tensor)] = (tensor, value)

    def is_leaf_of(self, x) -> bool:
        if (x.node, x.slot) in self.written_leaves:
            return True
        if self.node_sid(x.node) == 0:
            # a tensor made by a concrete call of instance code (``w * 2``, w a parameter) has
            # autograd history: not a leaf, as in eager
            return not self.rg_bit(x.node, x.slot) or _is_leaf(self.leaf_value(x.node))
        return not self.rg_bit(x.node, x.slot) or self._made_leaf(x)

    def _made_leaf(self, x) -> bool:
        sid = self.node_sid(x.node)
        return sid != 0 and SIGNATURES.by_sid[sid].func is _functional.make_leaf

    def grad_fn_of(self, x):
        if self.node_sid(x.node) == 0:
            return _grad_fn(self.leaf_value(x.node)) if self.rg_bit(x.node, x.slot) else None
        return None if self.is_leaf_of(x) else PENDING_GRAD_FN

    def set_requires_grad(self, x, value: bool) -> None:
        _functional.set_requires_grad(self, x, value)

    def register_hook(self, x, hook):
        return _functional.register_hook(self, x, hook)

    def inplace(self, x, func, args, kwargs):
        return _functional.inplace(self, x, func, args, kwargs)

    def forget_block_checks(self) -> None:
        """Static blocks check their module's fingerprint again at their next call (a module's
        ``train()``/``eval()`` inside instance code)."""
        self.blocks_checked.clear()

    def setitem(self, x, key, value) -> None:
        _functional.setitem(self, x, key, value)

    # -- a mode of the user's entered inside instance code (bug #49) ----------------------------
    def under_user_mode(self, func, args, kwargs, *, copy_first: bool = False):
        """``func(*args, **kwargs)``, a Tensor method or operator called on lazy values while a
        torch-function mode that instance code entered is innermost (``lazy.user_mode_on_top``).

        Run on the instance's concrete values, through torch's dispatch, so the mode sees the
        call as in eager (a ``torch.Tensor`` method, real tensors; lazy values are not tensors,
        and ``torch.Tensor.relu(lazy)`` would fail inside the mode). The lazy arguments are
        waited for (a value request); what the call returns becomes a per-instance value again
        through the recording mode below. Counted in ``stats.fallback_reasons``.

        ``copy_first`` (an in-place method or ``__setitem__``): the first argument is a copy of
        the instance's value (the batched buffer is not written), and ``(copy, result)`` is
        returned as per-instance values (``result`` is None when the call returned the copy, as
        in-place methods do) for ``functional.inplace`` to re-point the handle at.
        """
        name = getattr(func, "__name__", None) or repr(func)
        self.runtime.stats.note_fallback(f"{name}: under a torch-function mode entered inside instance code "
                                         f"(run on the instance's values, as eager)")
        why = f"call {name} under a torch-function mode entered inside instance code"

        def concrete(a):
            if type(a) is _Lazy:
                return self.materialize(a, why)
            if type(a) is list or type(a) is tuple:
                return type(a)(concrete(b) for b in a)
            return a

        cargs = tuple(concrete(a) for a in args)
        ckwargs = {k: concrete(v) for k, v in kwargs.items()}
        if not copy_first:
            with _outside_mode(self):  # the mode's handler sees tensors as results (bug #56)
                out = func(*cargs, **ckwargs)
            with torch._C.DisableTorchFunction():
                ins = _flat_tensors(cargs)
                view = any(_aliases_input(t, ins) for t in _flat_tensors(out))
                if not view:
                    return self._leaves_of(out)
            # a view (``y[0]``, ``.T``, ``chunk``): the mode saw the call; the recorded view keeps
            # the aliasing (a later in-place update of its base reaches it, as in eager)
            return self.record(func, args, kwargs)
        args, kwargs = cargs, ckwargs
        with torch._C.DisableTorchFunction():  # the copy is ours: no mode sees it
            first = args[0].clone()
        with _outside_mode(self):
            out = func(first, *args[1:], **kwargs)
        with torch._C.DisableTorchFunction():  # nor our bookkeeping (shape, dtype reads)
            if out is first:
                return self.leaf(first), None
            return self.leaf(first), self._leaves_of(out)

    def for_handler(self, func, args, kwargs, frame=None):
        """A torch call seen by the recording mode from a ``__torch_function__`` frame (the C
        core's pre-check, ``mode.handler_mode`` decides): inside a mode of the user's handler,
        ``func(*args)`` on lazy values runs on the instance's values and returns tensors, which
        the handler may inspect or transform as in eager (bug #56; ``isinstance(out, Tensor)``
        was False on a lazy result, and a halving mode left it whole). An in-place call writes a
        copy of the instance's value and re-points the lazy value at it. Otherwise (no mode of the
        user's, ``out=``, no lazy argument) the usual :meth:`mode_call`. Counted in ``stats.fallback_reasons``. ``frame``:
        where the caller search starts (default: the caller's, as from the C mode).
        """
        import sys

        from batchcraft.autobatching.mode import handler_mode

        name = getattr(func, "__name__", None) or repr(func)
        writes = kwargs.get("inplace") is True or (name.endswith("_") and not name.endswith("__"))
        if (handler_mode(frame or sys._getframe(1)) is None or "out" in kwargs
                or (writes and not (args and type(args[0]) is _Lazy))
                or not any(type(a) is _Lazy for a in _flat_lazies(args, kwargs))):
            return self.mode_call(func, args, kwargs)
        self.runtime.stats.note_fallback(f"{name}: called by a torch-function mode's handler in instance code "
                                         f"(run on the instance's values, as eager)")
        why = f"call {name} from a torch-function mode's handler in instance code"

        def concrete(a):
            if type(a) is _Lazy:
                return self.materialize(a, why)
            if type(a) is list or type(a) is tuple:
                return type(a)(concrete(b) for b in a)
            return a

        cargs = tuple(concrete(a) for a in args)
        ckwargs = {k: concrete(v) for k, v in kwargs.items()}
        if not writes:
            with _outside_mode(self):  # not recorded: the handler gets what eager gives it
                return func(*cargs, **ckwargs)
        # an in-place call (``torch.sigmoid_(h)``, ``F.relu(h, inplace=True)``): on a copy of the
        # instance's value (the batched buffer is not written), the lazy value re-pointed at it;
        # the handler gets the copy where eager gives it ``h`` itself
        x = args[0]
        if self.is_input_leaf_requiring_grad(x):
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        with torch._C.DisableTorchFunction():
            first = cargs[0].clone()
        with _outside_mode(self):
            out = func(first, *cargs[1:], **ckwargs)
        _functional.repoint(self, x, self.leaf(first), name)
        return out

    def _leaves_of(self, out):
        """``out`` (a call's concrete result) with its tensors as per-instance leaves."""
        if isinstance(out, _Tensor):
            return self.leaf(out)
        if isinstance(out, (tuple, list)) and any(isinstance(o, _Tensor) for o in out):
            leaves: list = []
            st = flatten(out, leaves, self.lazy_type)
            return rebuild(st, iter([self.leaf(t) if isinstance(t, _Tensor) else t for t in leaves]))
        return out

    # -- factory calls seen by the recording mode ---------------------------------------------
    def mode_call(self, func, args, kwargs):
        """A torch call seen by the recording mode (any arguments)."""
        if self.factory_device is not None:
            kwargs = with_factory_device(func, kwargs, self.factory_device)
        if self.caller_inference != _inference_enabled():
            # leaves without a tensor are made at the flush, in the caller's inference mode: in
            # another one, the call makes its tensor now, as eager's (reliability #266, #267)
            return self.record(func, args, kwargs or {})
        if (func in _TENSOR_FROM_DATA and len(args) == 1 and type(args[0]) in _PY_SCALARS
                and (not kwargs or kwargs.keys() <= _SCALAR_KW)
                and (type(args[0]) is not int or -_I64 <= args[0] < _I64)  # else: fails now, here
                and converts_safely(type(args[0]), kwargs.get("dtype"))):
            return self.scalar_leaf(args[0], kwargs.get("dtype"), kwargs.get("device"))
        if (func in _TENSOR_FROM_DATA and len(args) == 1 and (not kwargs or kwargs.keys() <= _SCALAR_KW)
                and list_of_scalars(args[0])):
            dt = kwargs.get("dtype") if kwargs else None
            if converts_safely(type(args[0][0]), dt):
                return self.list_leaf(tuple(args[0]), dt, kwargs.get("device") if kwargs else None)
        if func in CONST_FACTORIES:
            k = consts.key(func, args, kwargs)
            if k is not None:
                return self.const_leaf(func, args, kwargs, k)
        return self.record(func, args, kwargs or {})

    def list_leaf(self, values: tuple, dtype=None, device=None):
        """``torch.tensor([word_id])``: a leaf of shape ``(len(values),)`` whose tensor is made only
        if needed; the leaves of one descriptor become one tensor (``gather.stack_leaves``). Before,
        each call ran the general path and made its tensor (about 7 µs)."""
        dt, dev, _ = scalar_spec(values[0], dtype, device)
        did = desc_id(((len(values),), dt, dev))
        node = self.add_leaf(None, values, did, False)
        return _Lazy(self, node, 0, did)

    def const_leaf(self, func, args, kwargs, k):
        """A constant factory's call (``consts.py``, key ``k``): a leaf standing for a copy of the
        call's template, or, when no template is kept, a leaf of the tensor made now."""
        did, value = consts.template(func, args, kwargs, k, did_of)
        if did is None:
            return self.leaf(value)
        node = self.add_leaf(None, value, did, False)
        return _Lazy(self, node, 0, did)

    def scalar_leaf(self, v, dtype=None, device=None):
        """``torch.tensor(v)`` for a Python scalar: a leaf whose tensor is made only if needed."""
        dt, dev, did = scalar_spec(v, dtype, device)
        node = self.add_leaf(None, v, did, False)
        return _Lazy(self, node, 0, did)

    def input_leaf(self, value: torch.Tensor):
        """A tensor of the instance itself (in-place updates of it are copied back after the call)."""
        x = self.leaf(value)
        self.input_leaves[x.node] = value
        return x

    def leaf(self, value: torch.Tensor, pyvalue=None):
        """A per-instance concrete tensor (an instance input or a tensor made by instance code)."""
        with _DisableTorchFunction():  # (under the recording mode each metadata read is a recorded call)
            did = desc_id((tuple(value.shape), value.dtype, value.device))
            rg = bool(value.requires_grad)
        node = self.add_leaf(value, pyvalue, did, rg)
        return _Lazy(self, node, 0, did)

    # -- the general path --------------------------------------------------------------------
    def check_owner(self, x, func) -> None:
        if x.rec is not self:
            name = getattr(func, "__name__", func)
            if getattr(x.rec, "is_tracer", False) and not getattr(self, "is_tracer", False):
                raise AutobatchError(f"a value traced inside a static block escaped the block (in {name})",
                                     hint="return every value the rest of the instance needs from the block")
            if getattr(self, "is_tracer", False):
                raise AutobatchError(
                    f"static block {self.block.name!r} uses a lazy value that was not passed to it as an "
                    f"argument (in {name})",
                    hint="pass every per-instance tensor the block reads as an argument of the block call")
            raise AutobatchError(f"a lazy value escaped its batchcraft.autobatch call (in {name})",
                                 hint=ESCAPE_HINT)

    def record_general(self, func, args, kwargs):
        """Record any call: flatten the arguments, build the full signature, infer outputs."""
        return self.general(func, args, kwargs)[0]

    def general(self, func, args, kwargs):
        """:meth:`record_general`, also returning the SigInfo used (None: no node was recorded)."""
        if func.__class__ is not _StaticBlock and _has_index_object(args, kwargs):
            args, kwargs = _read_indexes(args), _read_indexes(kwargs) if kwargs else kwargs
        if type(func) is _MethodWrapper and len(args) == 1 and not kwargs and type(args[0]) is not self.lazy_type:
            # a property of a tensor from outside the instance (``weight.device`` in a model's
            # forward, once per instance): nothing to record, nothing written
            return self.run_concrete(func, args, kwargs), None
        if type(func) is _MethodWrapper and len(args) == 2 and not kwargs and type(args[0]) is not self.lazy_type \
                and type(args[1]) is self.lazy_type and getattr(func, "__name__", "") == "__set__" \
                and not getattr(self, "is_tracer", False) and not isinstance(args[0], _Uninitialized):
            # an attribute of a shared tensor set to a per-instance value (``W.grad = g``): eager
            # stores this instance's value now, so it is computed now (its fiber waits) and set;
            # recorded, the write was never run (hostile helper, stop 40)
            value = self.materialize(args[1], "set an attribute of a shared tensor to a per-instance value")
            if value._base is not None:  # a row of a batched buffer: the attribute gets a tensor of its own
                value = value.clone()
            return self.run_concrete(func, (args[0], value), kwargs), None
        _refuse(func)
        if func in _IDENTITY and len(args) == 1 and not kwargs and type(args[0]) is self.lazy_type \
                and args[0].rec is self and DESCS[args[0].did][1] is not torch.bool:
            # torch.positive returns its input itself (not a copy, not a view): with its autograd
            # history also under no_grad, as in eager (a fuzzer find, reliability #70)
            return args[0], None
        if kwargs and kwargs.get("out") is not None:
            raise UnsupportedOperationError(
                f"{getattr(func, '__name__', func)}(..., out=...) inside batchcraft.autobatch is not supported",
                hint="use the result of the out-of-place call instead")
        if _functional.is_inplace_call(func, args, kwargs, self.lazy_type):
            return self.inplace(args[0], func, args, kwargs), None
        if func in _buffers.BATCH_NORMS:
            out = _buffers.record_batch_norm(self, args, kwargs)
            if out is not NotImplemented:
                return out, None
        if func in _buffers.INSTANCE_NORMS:
            out = _buffers.record_instance_norm(self, args, kwargs)
            if out is not NotImplemented:
                return out, None
        if func in _cells.CELL_FUNCS:
            out = _cells.record_cell(self, func, args, kwargs)
            if out is not NotImplemented:
                return out, None
        if func in _embedding.EMBEDDINGS:
            form = _embedding.one_index_form(func, args, kwargs or {}, self.lazy_type)
            if form == "per_instance":  # gradient scaled by frequencies within this instance's call
                leaves = []
                struct = (flatten(args, leaves, self.lazy_type), flatten(kwargs, leaves, self.lazy_type) if kwargs else None)
                return self.run_on_values(func, struct, leaves, NeedsValues("scale_grad_by_freq")), None
            if form is not None:
                args, kwargs = form
        leaves: list = []
        struct = (flatten(args, leaves, self.lazy_type), flatten(kwargs, leaves, self.lazy_type) if kwargs else None)
        lazy_type = self.lazy_type
        if not any(type(x) is lazy_type for x in leaves):
            if args and isinstance(args[0], _Tensor) and _functional.writes_first(func, kwargs):
                self.before_shared_write(args[0])
            return self.run_concrete(func, args, kwargs), None
        lazies = []
        specs = []
        dkey = []
        block = func.__class__ is _StaticBlock  # blocks key their inputs' requires_grad (see SigInfo)
        for x in leaves:
            if type(x) is self.lazy_type:
                self.check_owner(x, func)
                lazies.append(x)
                rg = self.rg_bit(x.node, x.slot)
                specs.append(("lazy", x.did, bool(rg)))
                dkey.append(x.did * 2 + rg if block else x.did)
            else:
                if isinstance(x, _Uninitialized):
                    raise UnsupportedOperationError(
                        f"{getattr(func, '__name__', func)} on an uninitialized parameter inside batchcraft.autobatch "
                        f"(an nn.Lazy* module's first forward)",
                        hint="run one eager forward of the module before the autobatch call, so that its "
                             "parameters exist")
                specs.append(("shared", x))
                with torch._C.DisableTorchFunction():  # reading a tensor's metadata under the mode records it
                    dkey.append(shared_descriptor(x, self.made_views))
        if _functional.is_inplace_call(func, args, kwargs, _Tensor) or (args and isinstance(args[0], _Tensor)
                                                                         and _functional.writes_first(func, kwargs)):
            raise UnsupportedOperationError(
                f"in-place {getattr(func, '__name__', func)} writes per-instance values into a shared tensor "
                f"(a parameter or a tensor captured from outside the instance)",
                hint="compute a new tensor instead (y = x + v); to change a shared tensor, do it after the call")
        state = op_state()
        key = (func, struct, tuple(dkey), state)
        info = SIGNATURES.get(key)
        if info is None:
            nv = SIGNATURES.needs_values(key)
            if nv is not None:  # (inferred before: it needs values)
                return self.run_on_values(func, struct, leaves, nv), None
            try:
                info = self.new_signature(key, func, struct, leaves, specs, state)
            except NeedsValues as nv:
                if not block:
                    SIGNATURES.note_needs_values(key, nv, tuple(x for x in leaves if type(x) is not lazy_type))
                return self.run_on_values(func, struct, leaves, nv), None
        if info.n_out == 0:
            return rebuild(info.out_struct, iter(())), None
        out = self.append(info, lazies, None)
        return out, (info if holds_these_shared(info, leaves) else None)

    def new_signature(self, key, func, struct, leaves, specs, state):
        from batchcraft.autobatching.blocks import StaticBlock

        if isinstance(func, StaticBlock):
            return func.trace(key, struct, leaves, specs, state, self)
        # requires_grad of the outputs as a function of the inputs' flags (which are not part of the
        # key, so that instances whose inputs differ only in requires_grad still batch together):
        # the outputs' flags with no per-instance input requiring grad, then with each one alone
        base = [("lazy", s[1], False) if s[0] == "lazy" else s for s in specs]
        out_struct, out_dids, out_rg = infer_outputs(func, struct, base, state, self.lazy_type)
        lazy_pos = [i for i, s in enumerate(specs) if s[0] == "lazy"]
        deps = [0] * len(lazy_pos)
        if not state[1] and out_dids:  # (under no_grad too: views keep requires_grad, as in eager)
            if len(lazy_pos) <= 6:
                for j, i in enumerate(lazy_pos):
                    one = list(base)
                    one[i] = ("lazy", specs[i][1], True)
                    deps[j] = _mask(infer_outputs(func, struct, one, state, self.lazy_type)[2])
            else:
                every = [("lazy", s[1], True) if s[0] == "lazy" else s for s in specs]
                deps = [_mask(infer_outputs(func, struct, every, state, self.lazy_type)[2])] * len(lazy_pos)

        def make(sid):
            info = SigInfo(sid, key, func, struct, leaves, self.lazy_type, state[0], state, out_struct, out_dids,
                           out_rg)
            info.rg_dep = tuple(deps)
            info.dep_any = any(deps)
            return info

        return SIGNATURES.add(key, make)

    def before_shared_write(self, t) -> None:
        """A write into shared tensor ``t`` with no per-instance value runs at once (as
        ``num_batches_tracked.add_(1)`` must); reads of ``t`` recorded before it must execute
        first, so pending work runs now if some signature reads ``t`` (reliability #44).

        Exact when instances do not interleave; with value waits, another instance's read
        recorded before this write still sees the old value (eager: instances run one after
        another), as for module state (``modstate.py``).
        """
        if not self.n_pending:
            return
        with torch._C.DisableTorchFunction():
            read = SIGNATURES.may_be_read(t)
        if read:
            self.runtime.stats.syncs += 1
            self.runtime.flush()

    def run_concrete(self, func, args, kwargs):
        """A call without lazy arguments: run it now; tensors it returns become per-instance leaves."""
        if isinstance(func, _StaticBlock):  # (no import statement here: on 3.11 each costs a formatted error)
            func = func.fn
        with torch._C.DisableTorchFunction():
            sub = _subclass_arg(args) if args else None
            if sub is not None:
                # a Tensor subclass with its own __torch_function__ (captured from outside the
                # instance): its handler runs, as in eager, and returns its type (reliability #93)
                out = _run_with_subclass_handler(func, sub, args, kwargs)
            else:
                out = func(*args, **kwargs)
            if func is _TENSOR_FLOAT:  # nn.BatchNorm(momentum=None): 1 / float(num_batches_tracked)
                self.counter_read = (self.instance, out)
            if type(func) is _MethodWrapper or (isinstance(out, _Tensor) and _aliases_input(out, args)):
                # a property (.data, .T, .grad) or a view of a tensor from outside the instance
                # aliases shared state: it stays shared (writes into it reach that tensor, as in eager)
                if isinstance(out, _Tensor) and (out._base is not None or (
                        type(func) is not _MethodWrapper and not out.requires_grad
                        and not any(out is a for a in args))):
                    # a view, or an alias made by this call (``w.detach()``): keyed by what it
                    # reads (shared_descriptor); a property may hand back an older tensor (.grad)
                    self.made_views[id(out)] = out
                return out
        if isinstance(out, _Tensor):
            scalar = (func is _torch_tensor and args and type(args[0]) in _PY_SCALARS and not out.requires_grad)
            return self.leaf(out, args[0] if scalar else None)
        if isinstance(out, (tuple, list)) and any(isinstance(o, _Tensor) for o in out):
            with torch._C.DisableTorchFunction():
                if any(_aliases_input(t, args) for t in _flat_tensors(out)):
                    return out
            return self._leaves_of(out)
        return out

    def run_on_values(self, func, struct, leaves, nv):
        """An op whose output shape depends on values (nonzero, unique, ...): run it eagerly.

        Its lazy inputs are materialised (the fiber waits until they are computed); the op runs
        for this instance on the values, is counted in ``eager_ops``, and its outputs become
        leaves (with their autograd history: gradients flow back into the batched work).
        """
        name = getattr(func, "__name__", repr(func))
        values = [self.materialize(x, f"run {name} (output shape depends on values)")
                  if type(x) is self.lazy_type else x for x in leaves]
        it = iter(values)
        a = rebuild(struct[0], it)
        k = rebuild(struct[1], it) if struct[1] is not None else {}
        self.eager_ops += 1
        self.runtime.stats.note_eager(name)
        with torch._C.DisableTorchFunction():
            try:
                out = func(*a, **k)
            except Exception as exc:
                raise exc from nv.cause
        out_leaves: list = []
        st = flatten(out, out_leaves, self.lazy_type)
        return rebuild(st, iter([self.leaf(t) if isinstance(t, _Tensor) else t for t in out_leaves]))

    def step_limit(self):
        raise StepLimitError(f"exceeded max_steps={self.max_steps} "
                             f"(operations + synchronisations) without finishing",
                             hint="raise max_steps, or check the instance's loop condition")

    # -- values -------------------------------------------------------------------------------
    def value_of(self, node: int, slot: int):
        """The concrete value of an executed node's output (a row of a batched result)."""
        if slot == 0 and node in self.own_values:
            return self.own_values[node]
        buf, row = self.location(node)
        if buf in self.shared_rows:
            buf, row = self._own_rows(node, buf, row)
        t = self.buffers[buf + slot]
        if not self.rg_bit(node, slot):
            # the batched result requires grad if any instance's does; this one's may not
            v = t[row]
            return v.detach() if v.requires_grad else v
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            return t[row]
        # the row keeps its autograd history (read under the caller's no_grad or inference mode:
        # a group recorded under inference_mode(False) in it, reliability #258)
        with torch.inference_mode(False), torch.enable_grad():
            return t[row]

    def _own_rows(self, node: int, buf: int, row: int):
        """Move ``node``'s outputs from rows it shares with other nodes to rows of its own (copies),
        before the first concrete value of it is handed out: instance code or the caller may
        write into that value (``.numpy()``, an in-place op on an output), which must change this
        node's value only, as in eager. Later readers, batched ones too, read the copies."""
        new = len(self.buffers)
        for s in range(self.shared_rows[buf]):
            self.buffers.append(self.buffers[buf + s][row:row + 1].clone())
        self.place([node], new, 0)
        return new, 0

    def scalar(self, x, why: str, to):
        """``to(value of x)`` for a Python scalar conversion (``bool``, ``float``, ``.item()``,
        ``int`` of an integer tensor), the wait of data-dependent control flow.

        After a flush every waiting instance reads its row of the same batched results: the
        first read converts a whole result with one ``tolist()`` and the others index that list,
        instead of one row view and one ``item()`` each (about 1 µs an instance and wait, issue
        14). The lists are dropped at the next flush. Anything else (a leaf, a row of more than one element,
        a complex value, ``int`` of a float) takes :meth:`materialize`'s path."""
        if x.rec is self:
            node = x.node
            if self.node_sid(node) != 0:
                if not self.is_done(node):
                    self.runtime.wait_for(x, why)
                buf, row = self.location(node)
                key = buf + x.slot
                rows = self.scalar_rows.get(key)
                if rows is None:
                    t = self.buffers[key]
                    with torch._C.DisableTorchFunction():  # metadata reads under the mode would record
                        if t.dim() == 0 or t.numel() != t.shape[0] or t.is_complex():
                            rows = False  # rows of more than one element: torch's conversion raises
                        else:
                            rows = (t.reshape(-1).tolist(), t.is_floating_point())
                    self.scalar_rows[key] = rows
                if rows and (to is not int or not rows[1]):
                    v = rows[0][row]
                    return v if to is _item else to(v)
        v = self.materialize(x, why)
        with torch._C.DisableTorchFunction():
            return to(v) if to is not _item else v.item()

    def materialize(self, x, why: str) -> torch.Tensor:
        """Concrete value of ``x``; runs pending work first if needed (its fiber waits here)."""
        if x.rec is not self:
            if getattr(x.rec, "is_tracer", False) or getattr(self, "is_tracer", False):
                return x.rec.materialize(x, why)
            raise AutobatchError(f"cannot {why}: the lazy value escaped its batchcraft.autobatch call")
        node = x.node
        if self.node_sid(node) == 0:
            return self.leaf_value(node)
        if not self.is_done(node):
            self.runtime.wait_for(x, why)
        with torch._C.DisableTorchFunction():
            return self.value_of(node, x.slot)

    def computed(self, x) -> bool:
        """Has lazy value ``x`` a value now (a leaf, or a node whose batched work ran)?"""
        return self.node_sid(x.node) == 0 or self.is_done(x.node)

    def resolve(self, x, memo: dict | None = None):
        """Output of the call for lazy value ``x`` (after the final flush).

        ``memo`` ((node, slot) -> tensor) holds what one instance's outputs resolved to: a view
        whose base is resolved too (an output, an input, a leaf) is that view of the base's tensor,
        so that they alias as in eager (``return y, y[:2]``, ``return x[1:]`` of an input;
        reliability #261). Before, each output was a row of its own batched result.
        """
        if memo is None:
            return self._resolve_one(x, None)
        key = (x.node, x.slot)
        got = memo.get(key)
        if got is None:
            if x.base is not None and not self.is_made_leaf_alias(x):
                got = self._concrete_view(x, self.resolve(x.base, memo))
            elif self.node_sid(x.node) != 0 and (x.node, x.slot) not in self.written_leaves:
                got = self._shared_view(x)
            if got is None:
                got = self._resolve_one(x, memo)
            memo[key] = got
        return got

    def data_ptr_of(self, x) -> int:
        """``x.data_ptr()``: a view's address points into its base's value (views of one value,
        and of an instance's input, as in eager); anything else, its own value's (a wait)."""
        with torch._C.DisableTorchFunction():
            return self._viewed(x).data_ptr()

    def _viewed(self, x):
        """``x``'s value, for a view computed from its base's as the view call (aliasing it)."""
        if x.base is not None and not self.is_made_leaf_alias(x):
            v = self._concrete_view(x, self._viewed(x.base))
            if v is not None:
                return v
        return self.materialize(x, "call .data_ptr()")

    def _shared_view(self, v):
        """``v``'s value as the view call of a tensor from outside the instance that made it
        (``E[i]``, ``W.t()``), so that it aliases that tensor as eager's does; None otherwise."""
        info = SIGNATURES.by_sid[self.node_sid(v.node)]
        if not info.leaf_kinds or info.leaf_kinds[0] or info.func not in _views.VIEW_FUNCS:
            return None
        leaves = self.node_leaves(v.node)
        if not _views.is_view_call(info.func, info.struct, leaves):
            return None
        for j, t in enumerate(leaves):
            if type(t) is self.lazy_type:
                if not self.computed(t):
                    return None
                leaves[j] = self.materialize(t, "read a view's index")
        return self._call_view(info, v.slot, leaves)

    def _call_view(self, info, slot, leaves):
        it = iter(leaves)
        args = rebuild(info.struct[0], it)
        kwargs = rebuild(info.struct[1], it) if info.struct[1] is not None else {}
        with torch._C.DisableTorchFunction(), _under(info.state):
            out = info.func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            flat: list = []
            flatten(out, flat, self.lazy_type)
            out = flat[slot]
        return out

    def _concrete_view(self, v, base):
        """View ``v``'s operation applied to tensor ``base``, the value of ``v.base``: None unless
        ``v``'s node is a view call of that value (an in-place ``t_()`` or ``resize_()`` re-points
        ``v`` at another call). Its other lazy arguments (``t[i]``) are read as values."""
        if not isinstance(base, torch.Tensor) or self.node_sid(v.node) == 0:
            return None
        info = SIGNATURES.by_sid[self.node_sid(v.node)]
        ins = self.replay_inputs(v.node)
        if not info.view or not ins or (ins[0].node, ins[0].slot) != (v.base.node, v.base.slot):
            return None
        leaves = self.node_leaves(v.node, first=base)
        for j, t in enumerate(leaves):
            if j and type(t) is self.lazy_type:
                if not self.computed(t):
                    return None
                leaves[j] = self.materialize(t, "read a view's index")
        return self._call_view(info, v.slot, leaves)

    def _resolve_one(self, x, memo):
        node = x.node
        origin = self.written_leaves.get((node, x.slot))
        if origin is not None and origin[1] == 0 and node != origin[0]:
            # a leaf written without history (under no_grad, through .data): eager's is the same
            # tensor, still a leaf, now holding the new values; its gradient already goes to it
            # (reliability #273; before, a row of the written value, not a leaf, without .grad)
            o = origin[0]
            leaf = self.leaf_value(o) if self.node_sid(o) == 0 else self.own_values.get(o)
            if leaf is not None and self.is_done(node):
                with torch.no_grad():
                    leaf.copy_(self.value_of(node, x.slot))
                return leaf
        if self.node_sid(node) == 0:
            return self.leaf_value(node)
        if not self.is_done(node):  # pragma: no cover - the final flush runs everything
            raise AutobatchError(f"internal error: output node {node} was not computed")
        return self.value_of(node, x.slot)

    # -- views, writes, hooks (see functional.py) -------------------------------------------
    def register_view(self, out, base) -> None:
        out.base = base
        views = self.views
        lst = views.get(id(base))
        if lst is None:
            lst = views[id(base)] = []
        lst.append(_weakref(out))

    def view_base(self, x):
        return x.base

    def node_leaves(self, node: int, first=None) -> list:
        """A node's tensor arguments in its signature's leaf order (``first`` replaces leaf 0)."""
        info = SIGNATURES.by_sid[self.node_sid(node)]
        lazies = iter(self.replay_inputs(node))
        out = [next(lazies) if k else sh for k, sh in zip(info.leaf_kinds, info.shared)]
        if first is not None:
            out[0] = first
        return out

    def view_scatter(self, x, base, new):
        if self.is_made_leaf_alias(x):  # written through the view under it
            return self.view_scatter(self._made_leaf_view(x), base, new)
        info = SIGNATURES.by_sid[self.node_sid(x.node)]
        leaves = self.node_leaves(x.node, first=base)
        return _views.view_scatter(self, info.func, info.struct, leaves, x.slot, base, new, DESCS[base.did][0])

    def is_detach_view(self, x) -> bool:
        """True when ``x`` is a detached alias of its base (``y.detach()``, also given
        ``requires_grad_()``: ``copy.copy``)."""
        if self.is_made_leaf_alias(x):
            return _views.is_detach_view(SIGNATURES.by_sid[self.node_sid(self._made_leaf_view(x).node)].func)
        return x.base is not None and _views.is_detach_view(SIGNATURES.by_sid[self.node_sid(x.node)].func)

    def view_of(self, v, base):
        """View ``v``'s operation applied to ``base`` instead of its own base (a new lazy value)."""
        if self.is_made_leaf_alias(v):  # the view under it, then a leaf of its own again
            under = self.view_of(self._made_leaf_view(v), base)
            with torch.inference_mode(False), torch.enable_grad():  # (see functional.set_requires_grad)
                return self.record(_functional.make_leaf, (under,), {})
        info = SIGNATURES.by_sid[self.node_sid(v.node)]
        it = iter(self.node_leaves(v.node, first=base))
        args = rebuild(info.struct[0], it)
        kwargs = rebuild(info.struct[1], it) if info.struct[1] is not None else {}
        out = self.record(info.func, args, kwargs)
        if not isinstance(out, self.lazy_type):
            flat: list = []
            flatten(out, flat, self.lazy_type)
            out = flat[v.slot]
        return out

    def view_rederive(self, v, base) -> None:
        _functional.rebind(self, v, self.view_of(v, base))

    def note_rebind(self, x) -> None:
        """``x`` is about to be re-pointed: remember instance inputs for the write-back."""
        t = self.input_leaves.get(x.node)
        if t is not None and self.node_sid(x.node) == 0:
            self.writebacks.append((self.instance, t, x))

    def is_input_leaf_requiring_grad(self, x) -> bool:
        """``x`` is a leaf tensor that requires grad (an in-place update of it is an error while
        grad mode is on, as in eager): an input or a tensor made by instance code, a value given
        ``requires_grad_()`` (also ``copy.copy`` of a value that requires grad), a written leaf;
        a concrete call's result with autograd history is not (reliability #53)."""
        if (x.node, x.slot) in self.written_leaves:
            return True
        if not self.rg_bit(x.node, x.slot):
            return False
        if self.node_sid(x.node) == 0:
            return _is_leaf(self.leaf_value(x.node))
        return self._made_leaf(x)

    def is_made_leaf_alias(self, x) -> bool:
        """``x`` is a view given ``requires_grad_()`` (``v = y[0]; v.requires_grad_()``; ``copy.copy``
        of a value that requires grad: ``y.detach().requires_grad_()``): a leaf of its own that
        shares its base's values."""
        return x.base is not None and self._made_leaf(x)

    def _made_leaf_view(self, x):
        """The view under made leaf alias ``x`` (a handle to make_leaf's input)."""
        return self.replay_inputs(x.node)[0]

    def attach_hooks(self, nodes) -> None:
        """Hook the rows of executed ``nodes`` that have hooks (see ``functional.register_hook``)."""
        hooks = self.hooks
        for nd in nodes:
            entries = hooks.get(nd)
            if not entries:
                continue
            buf, row = self.location(nd)
            for slot in sorted({s for s, _ in entries}):
                if (nd, slot) in self.hooked:
                    continue
                self.hooked.add((nd, slot))
                own = self.own_values.get(nd) if slot == 0 else None
                if own is not None:  # a leaf of the instance's own: hooked as eager hooks it (#297)
                    own.register_hook(_functional.leaf_hook(entries, slot))
                    continue
                t = self.buffers[buf + slot]
                t.register_hook(_functional.row_hook(row, entries, slot))

    def replay_inputs(self, node: int):
        """The lazy input handles of a recorded node (for per-instance replays)."""
        return [_Lazy(self, p, s, self._out_did(p, s)) for p, s in self.node_inputs(node)]

    def _out_did(self, node: int, slot: int) -> int:
        sid = self.node_sid(node)
        if sid == 0:
            return self.leaf_did(node)
        return SIGNATURES.by_sid[sid].out_dids[slot]


class PyRecorder(RecorderBase):
    """The pure-Python core: the graph in per-node Python lists."""

    core = "python"

    def __init__(self, runtime, options):
        self.setup(runtime, options)
        self.sid: list = []       # signature id (0: leaf)
        self.depth: list = []
        self.nphase: list = []
        self.inst: list = []
        self.rgbits: list = []    # bit s: output s requires grad
        self.ins: list = []       # tuple of (node, slot) per node; ragged members after the singles
        self.lens: list = []      # None, or the lengths of the ragged list arguments
        self.views: dict = {}     # id(base) -> weakrefs of its views (see functional.py)
        self.loc_buf: list = []   # -1 while pending; else the buffer id of output 0
        self.loc_row: list = []
        self.leaves: dict = {}    # leaf node -> [tensor or None, python scalar or None, did]
        self.pending_leaves: dict = defaultdict(list)  # did -> leaf nodes without a location
        self.buckets: dict = defaultdict(list)
        self.n_pending = 0
        self.ops_recorded = 0
        self.fast_calls = RECORDING_TORCH  # torch's class while the call records (torchclass.py)
        from batchcraft.autobatching.mode import RecordingMode

        self.mode = RecordingMode(self)

    # -- graph --------------------------------------------------------------------------------
    def node_sid(self, node):
        return self.sid[node]

    def node_inst(self, node):
        return self.inst[node]

    def node_inputs(self, node):
        return self.ins[node]

    def node_lens(self, node):
        return self.lens[node]

    def rg_bit(self, node, slot):
        return (self.rgbits[node] >> slot) & 1

    def set_rg_bit(self, node, slot, value):
        if value:
            self.rgbits[node] |= 1 << slot
        else:
            self.rgbits[node] &= ~(1 << slot)

    def is_done(self, node):
        return self.loc_buf[node] >= 0

    def location(self, node):
        return self.loc_buf[node], self.loc_row[node]

    def leaf_did(self, node):
        return self.leaves[node][2]

    def leaf_set_requires_grad(self, node, value: bool) -> None:
        t = self.leaf_value(node)
        t.requires_grad_(value)
        self.leaves[node][1] = None  # a scalar leaf now batches by stacking (keeps autograd)
        self.set_rg_bit(node, 0, t.requires_grad)

    def leaf_value(self, node):
        rec = self.leaves[node]
        if rec[0] is None and type(rec[1]) is ConstLeaf:
            rec[0], rec[1] = rec[1].tensor(), None  # (its own copy: it may be written in place)
        elif rec[0] is None:
            dtype, dev, _ = scalar_spec(rec[1], DESCS[rec[2]][1], DESCS[rec[2]][2])
            with torch._C.DisableTorchFunction():
                rec[0] = torch.tensor(rec[1], dtype=dtype, device=dev)
        return rec[0]

    def add_leaf(self, value, pyvalue, did, rg):
        node = len(self.sid)
        self.sid.append(0)
        self.depth.append(0)
        self.nphase.append(-1)
        self.inst.append(self.instance)
        self.rgbits.append(1 if rg else 0)
        self.ins.append(())
        self.lens.append(None)
        self.loc_buf.append(-1)
        self.loc_row.append(-1)
        self.leaves[node] = [value, pyvalue, did]
        self.pending_leaves[did].append(node)
        return node

    # -- the hot path --------------------------------------------------------------------------
    def record(self, func, args, kwargs):
        if not kwargs:
            key = [func]
            leaves = []
            rgbits = self.rgbits
            rgk = 0
            for a in args:
                t = type(a)
                if t is _Lazy:
                    if a.rec is not self:
                        break
                    rgk = rgk * 2 + ((rgbits[a.node] >> a.slot) & 1)
                    leaves.append(a)
                    key.append(a.did)
                elif t is list or t is tuple:
                    ids = [t]
                    for b in a:
                        if type(b) is not _Lazy or b.rec is not self:
                            break
                        rgk = rgk * 2 + ((rgbits[b.node] >> b.slot) & 1)
                        leaves.append(b)
                        ids.append(b.did)
                    else:
                        key.append(tuple(ids))
                        continue
                    break
                elif t is float:
                    key.append((float, a.hex()))
                elif t in SCALAR_TYPES:
                    key.append((t, a))
                elif isinstance(a, _Tensor):
                    key.append((_Tensor, id(a), a.requires_grad))
                else:
                    break
            else:
                if leaves:
                    fkey = (tuple(key), rgk if func.__class__ is _StaticBlock else 0, op_state())
                    info = SIGNATURES.fast_get(fkey)
                    if info is not None and info.validated:
                        return self.append(info, leaves, None)
                    out, info = self.general(func, args, kwargs)
                    if info is not None:
                        SIGNATURES.fast_put(fkey, info)
                    return out
        return self.record_general(func, args, kwargs)

    def append(self, info, leaves, lens):
        """Append a node of signature ``info`` with lazy inputs ``leaves``; return its outputs."""
        depth = 0
        phase = self.phase
        nphase, ndepth, loc_buf = self.nphase, self.depth, self.loc_buf
        ins = []
        bits = info.rg_mask
        deps = info.rg_dep if info.dep_any else None
        rgbits = self.rgbits
        for j, x in enumerate(leaves):
            p = x.node
            ins.append((p, x.slot))
            if deps is not None and (rgbits[p] >> x.slot) & 1:
                bits |= deps[j]
            if loc_buf[p] < 0 and self.sid[p] != 0:
                ph = nphase[p]
                if ph > phase:  # an input from a later phase (values shared across instances)
                    phase, depth = ph, ndepth[p]
                elif ph == phase and ndepth[p] > depth:
                    depth = ndepth[p]
        if self.max_steps is not None:
            self.inst_steps += 1
            if self.inst_steps > self.max_steps:
                self.step_limit()
        node = len(self.sid)
        self.sid.append(info.sid)
        self.depth.append(depth + 1)
        self.nphase.append(phase)
        self.inst.append(self.instance)
        self.rgbits.append(bits)
        self.ins.append(tuple(ins))
        self.lens.append(lens)
        self.loc_buf.append(-1)
        self.loc_row.append(-1)
        self.buckets[(phase, depth + 1, info.sid)].append(node)
        self.n_pending += 1
        self.ops_recorded += 1
        if self.max_pending is not None and self.n_pending >= self.max_pending:
            self.runtime.pending_limit()
        if info.single:
            out = _Lazy(self, node, 0, info.out_dids[0])
            if info.view:
                self.register_view(out, leaves[0])
            return out
        outs = [_Lazy(self, node, i, d) for i, d in enumerate(info.out_dids)]
        if info.view:
            for o in outs:
                self.register_view(o, leaves[0])
        if info.flat_tuple:
            return tuple(outs)
        return rebuild(info.out_struct, iter(outs))

    # -- execution support ---------------------------------------------------------------------
    def take_buckets(self):
        """Remove and return the pending buckets: ``[((phase, depth, sid), nodes), ...]``."""
        b, self.buckets = self.buckets, defaultdict(list)
        self.n_pending = 0
        return list(b.items())

    def materialize_leaves(self, did: int) -> None:
        """Give every pending leaf with descriptor ``did`` a row of one new buffer."""
        nodes = self.pending_leaves.pop(did, None)
        if not nodes:
            return
        from batchcraft.autobatching.gather import stack_leaves

        vals = [self.leaves[nd] for nd in nodes]
        t = stack_leaves(vals, DESCS[did], self.leaf_value, nodes)
        buf = len(self.buffers)
        self.buffers.append(t)
        for r, nd in enumerate(nodes):
            self.loc_buf[nd] = buf
            self.loc_row[nd] = r

    def _refs_rows(self, refs):
        bufs, rows = [], []
        loc_buf, loc_row = self.loc_buf, self.loc_row
        for p, s in refs:
            b = loc_buf[p]
            if b < 0:
                self.materialize_leaves(self.leaves[p][2])
                b = loc_buf[p]
            bufs.append(b + s)
            rows.append(loc_row[p])
        return bufs, rows

    def plan_group(self, nodes, n_single: int, n_ragged: int):
        """Where each input of the group's nodes is: one plan per input slot (see :mod:`plan`)."""
        plans = []
        ins = self.ins
        for j in range(n_single):
            bufs, rows = self._refs_rows([ins[nd][j] for nd in nodes])
            plans.append(plan_rows(bufs, rows))
        for r in range(n_ragged):
            refs, seg, cnt = [], [], []
            for i, nd in enumerate(nodes):
                lens = self.lens[nd]
                off = n_single + sum(lens[:r])
                refs.extend(ins[nd][off:off + lens[r]])
                seg.extend([i] * lens[r])
                cnt.append(lens[r])
            bufs, rows = self._refs_rows(refs)
            plans.append((plan_rows(bufs, rows), seg, cnt))
        return plans

    def plan_slots(self, nodes, slots):
        """Plans of the single input ``slots`` of ``nodes`` (their producers must be computed)."""
        ins = self.ins
        plans = []
        for j in slots:
            bufs, rows = self._refs_rows([ins[nd][j] for nd in nodes])
            if min(bufs) < 0:  # pragma: no cover - the hoisting planner checked the depths
                raise RuntimeError("batchcraft: hoisted input not computed")
            plans.append(plan_rows(bufs, rows))
        return plans

    def input_depths(self, nodes, n_single: int):
        """``(min depth of nodes, [deepest pending producer of each single slot])``."""
        mind = min(self.depth[nd] for nd in nodes)
        deep = [0] * n_single
        for nd in nodes:
            for j, (p, _) in enumerate(self.ins[nd][:n_single]):
                if self.loc_buf[p] >= 0 or self.sid[p] == 0 or self.nphase[p] < self.nphase[nd]:
                    continue
                d = 2 ** 31 if self.nphase[p] > self.nphase[nd] else self.depth[p]
                if d > deep[j]:
                    deep[j] = d
        return mind, deep

    def order_by_input(self, nodes, j: int):
        """``nodes`` sorted by where their ``j``-th input lives (buffer, row); None when they already
        are or an input has no location yet (the C core's ``order_by_input``)."""
        keys = []
        for nd in nodes:
            p, slot = self.ins[nd][j]
            if self.loc_buf[p] < 0:
                return None
            keys.append((self.loc_buf[p] + slot, self.loc_row[p], nd))
        if all(a[:2] <= b[:2] for a, b in zip(keys, keys[1:])):
            return None
        return [k[2] for k in sorted(keys)]

    def order_by_consumers(self, groups, eligible) -> int:
        """Reorder, in place, each ``groups[g]`` with ``eligible[g]`` so that its rows are in the
        order later groups read them (the C core's ``order_by_consumers``; see :mod:`order`).

        ``groups`` are node lists in execution order. Going from the last group to the first, an
        eligible group takes first the nodes that later groups read through single (non-list)
        arguments, consumer group by consumer group in execution order, each slot by slot in its
        consumers' node order; then the nodes nothing later reads, in their old order. Returns the number of
        groups whose order changed.
        """
        owner: dict = {}
        for g, nodes in enumerate(groups):
            if eligible[g]:
                for nd in nodes:
                    owner[nd] = g
        if not owner:
            return 0
        requests: dict = {}  # producer group -> [(consumer group, node), ...], consumers descending
        ins, lens = self.ins, self.lens
        changed = 0
        for g in range(len(groups) - 1, -1, -1):
            nodes = groups[g]
            if eligible[g] and g in requests:
                reqs = requests.pop(g)
                order, seen = [], set()
                end = len(reqs)
                while end > 0:  # chunks of one consumer group, in execution order
                    start = end - 1
                    while start > 0 and reqs[start - 1][0] == reqs[end - 1][0]:
                        start -= 1
                    for _, p in reqs[start:end]:
                        if p not in seen:
                            seen.add(p)
                            order.append(p)
                    end = start
                order.extend(nd for nd in nodes if nd not in seen)
                if order != nodes:
                    nodes[:] = order
                    changed += 1
            singles = []
            for nd in nodes:
                ln = lens[nd]
                singles.append(ins[nd][:len(ins[nd]) - sum(ln)] if ln else ins[nd])
            for j in range(max(map(len, singles), default=0)):  # slot by slot, each in node order
                for single in singles:
                    if j < len(single):
                        o = owner.get(single[j][0])
                        if o is not None and o < g:
                            requests.setdefault(o, []).append((g, single[j][0]))
        return changed

    def place(self, nodes, buf: int, base) -> None:
        """The outputs of ``nodes`` are rows ``base, base+1, ...`` of buffers ``buf, buf+1, ...``;
        ``base`` may instead be int64 bytes, one row per node (a deduplicated group's rows)."""
        loc_buf, loc_row = self.loc_buf, self.loc_row
        if type(base) is not int:
            rows = memoryview(base).cast("B").cast("q")
            if len(rows) != len(nodes):
                raise ValueError("place: one int64 row per node expected")
            for nd, r in zip(nodes, rows):
                loc_buf[nd] = buf
                loc_row[nd] = r
            return
        for r, nd in enumerate(nodes):
            loc_buf[nd] = buf
            loc_row[nd] = base + r

    def group_instances(self, nodes):
        return [self.inst[nd] for nd in nodes]

    def group_lens(self, nodes):
        return [self.lens[nd] for nd in nodes]


def _late_imports():
    global _StaticBlock
    from batchcraft.autobatching.blocks import StaticBlock

    _StaticBlock = StaticBlock


_late_imports()

__all__ = ["RecorderBase", "PyRecorder", "scalar_spec", "PENDING_GRAD_FN"]
