"""The C recording core: :class:`CRecorder` = the C graph (``_core.Recorder``) + the shared slow paths.

The C part (``_core.c``) records lazy operators and methods, ``__torch_function__`` calls,
factory calls seen by its mode (``torch.tensor(word_id)``) and static-block calls without a
Python frame per operation, and plans gathers without per-node Python. Everything it does not
know (a signature seen for the first time, unusual arguments, autocast, errors) comes here:
:class:`~batchcraft.autobatching.recorder.RecorderBase` is shared with the Python core, and the
signature then found is registered with the C table so the next call of the same spelling stays
in C. The Python core remains the reference the fuzzer compares this one against.
"""

from __future__ import annotations

import os
import types

import torch

from batchcraft.autobatching import _native, consts, statereaders
from batchcraft.autobatching.consts import CONST_FACTORIES, ConstLeaf
from batchcraft.autobatching.descs import DESCS, desc_id
from batchcraft.autobatching.devices import device_constructors
from batchcraft.autobatching.gather import stack_leaves, to_device
from batchcraft.autobatching.lazy import ESCAPE_HINT
from batchcraft.autobatching.patches import ModuleClassPatch
from batchcraft.autobatching.recorder import RecorderBase, did_of, scalar_spec
from batchcraft.autobatching.signature import SIGNATURES, rebuild
from batchcraft.autobatching.torchclass import RECORDING_TORCH, RecordingTorch
from batchcraft.errors import AutobatchError

_c = _native.core


def _escape(func):
    raise AutobatchError(
        f"a lazy value was used outside batchcraft.autobatch (in {getattr(func, '__name__', func)})",
        hint=ESCAPE_HINT)


def _setup() -> None:
    from batchcraft.autobatching.blocks import StaticBlock
    from batchcraft.autobatching.mode import OWN_DIR, TORCH_DIR

    float_dids = {dt: desc_id(((), dt, torch.device("cpu")))
                  for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
    _c.setup(dict(
        Tensor=torch._C.TensorBase, dtype=torch.dtype, tensor=torch.tensor, as_tensor=torch.as_tensor, is_grad_enabled=torch.is_grad_enabled,
        set_grad_enabled=torch._C._set_grad_enabled,
        any_autocast=getattr(torch._C, "_is_any_autocast_enabled", lambda: torch.is_autocast_enabled()),
        is_inference=torch.is_inference_mode_enabled, tf_push=torch._C._push_on_torch_function_stack,
        tf_pop=torch._C._pop_torch_function_stack, get_default_dtype=torch.get_default_dtype, rebuild=rebuild,
        escape=_escape, StaticBlock=StaticBlock, float_dids=float_dids,
        int_did=desc_id(((), torch.int64, torch.device("cpu"))), cpu_device=torch.device("cpu"),
        int64_dtype=torch.int64, bool_dtype=torch.bool,
        # torch.tensor(python scalar, dtype=...) made in C: dtypes that hold any Python scalar as
        # eager would (narrow integer dtypes can overflow: they take the Python path, which raises)
        scalar_dids={dt: desc_id(((), dt, torch.device("cpu")))
                     for dt in (torch.int64, torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64)},
        bool_did=desc_id(((), torch.bool, torch.device("cpu"))),
        list_did=lambda elem, n: desc_id(((n,),) + DESCS[elem][1:]),  # torch.tensor([...]) leaves
        tf_mode_enabled=torch._C._is_torch_function_mode_enabled, tf_len=torch._C._len_torch_function_stack,
        tf_at=torch._C._get_function_stack_at, tf_enabled=torch._C._is_torch_function_enabled,
        const_factories=tuple(CONST_FACTORIES), torch_dir=TORCH_DIR, own_dir=OWN_DIR, plain_tensor=torch.Tensor,
        parameter=torch.nn.Parameter, method_wrapper=type(torch.Tensor.data.__get__)))
    SIGNATURES.on_clear(_c.clear_signatures)
    consts.on_clear(_c.clear_const_cache)
    if os.environ.get("BATCHCRAFT_STATE_READERS", "1") != "0":  # (0: torch's builtins answer, as before)
        statereaders.install(_c)


_setup()

#: torch functions that instance code calls on lazy values often (elementwise, reductions, joins):
#: read by the recording thread, each is a ``_core.FastFn`` that records the call as the mode would
#: (about 0.7 µs less a call). Factories are not here: the mode treats them specially.
FAST_TORCH_FUNCTIONS = (
    "sigmoid", "tanh", "relu", "exp", "log", "abs", "sqrt", "neg", "clamp", "add", "sub", "mul", "div", "matmul",
    "mm", "bmm", "dot", "sum", "mean", "amax", "amin", "max", "min", "argmax", "softmax", "log_softmax", "cat",
    "stack", "squeeze", "unsqueeze", "flatten", "reshape", "transpose", "where", "maximum", "minimum")
#: constant factories (consts.py) read the same way: a call with no tensor argument is the cached
#: template's leaf without torch's dispatch to the mode (about 1 µs less a call)
FAST_CONST_FACTORIES = ("zeros", "ones", "full", "arange", "eye")


def _recording_torch_class() -> type:
    """``torch``'s class while calls record: ``torch.tensor`` and :data:`FAST_TORCH_FUNCTIONS` as
    :class:`_core.RecordingAttr` descriptors."""
    # torch's own cache of factory functions, filled before any read can see fast_tensor
    device_constructors()
    attrs = {"__slots__": (), "__module__": "batchcraft.autobatching.ccore",
             "tensor": _c.RecordingAttr("tensor", torch.tensor, _c.fast_tensor)}
    for name in FAST_TORCH_FUNCTIONS + FAST_CONST_FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None and type(fn) is types.BuiltinFunctionType:  # torch's C bindings only
            # (sizes as varargs where the fast function does not apply: the base class's descriptor)
            attrs[name] = _c.RecordingAttr(name, fn, _c.FastFn(fn), vars(RecordingTorch).get(name))
    return type("module", (RecordingTorch,), attrs)  # (its descriptors: torchclass.py)


#: While calls record (``fast_factories=True``, the default), ``torch``'s class is a ModuleType
#: subclass whose ``tensor`` descriptor reads as the C core's ``fast_tensor`` in a thread whose
#: recorder's mode is the innermost torch-function mode, and as the module's own entry for every
#: other reader (other threads, a mode of the user's on top, values set meanwhile). torch
#: dispatches a factory call to the innermost mode through Python-level machinery (about 1 µs
#: per ``torch.tensor(word_id)`` here); ``fast_tensor`` makes the same scalar leaf directly and
#: otherwise calls the real ``torch.tensor`` (non-scalar calls, ``DisableTorchFunction``).
FAST_FACTORIES = ModuleClassPatch(torch, _recording_torch_class())


class CRecorder(_c.Recorder, RecorderBase):
    """The recorder of one call with the graph in C arrays (see the module docstring)."""

    core = "c"

    def __init__(self, runtime, options):
        self.setup(runtime, options)
        self.ragged_on = 1 if options.ragged else 0
        self.leaf_cache: dict = {}
        self.mode = _c.Mode(self)
        self.fast_factories = 1 if options.fast_factories and self.factory_device is None else 0
        self.fast_calls = FAST_FACTORIES if options.fast_factories else RECORDING_TORCH

    def forget_block_checks(self) -> None:
        RecorderBase.forget_block_checks(self)
        self.clear_checked()  # the C fast path's own set and its last entries (record_block)

    def set_factory_device(self, device) -> None:
        # a default device applies: factory calls go to mode_call, which adds device= (the C
        # paths make CPU leaves), torch.tensor(scalar) on it once per dtype (then in C)
        self.factory_device = device
        if device is not None:
            self.fast_factories = 0  # the mode's path adds device= as torch's DeviceContext would
        self.factory_funcs = device_constructors() if device is not None else None

    # -- signatures into the C table ---------------------------------------------------------------
    def _sig_entry(self, info):
        """What the C table keeps of a SigInfo (None: outputs without tensors are not cached)."""
        if info.n_out == 0:
            return None
        desc = info.stats_key
        if desc is None:
            kind = 0 if info.single else (1 if info.flat_tuple else 2)
            desc = info.stats_key = (kind, info.sid, info.out_dids, info.rg_mask, tuple(info.rg_dep), int(info.view),
                                     int(bool(info.ragged)), info.out_struct)
        return desc

    def append(self, info, leaves, lens):
        return self.append_desc(self._sig_entry(info), leaves, lens, leaves[0] if info.view else None)

    # -- leaves --------------------------------------------------------------------------------------
    def leaf_value(self, node):
        rec = self.leaf_record(node)
        if rec[0] is None and type(rec[1]) is ConstLeaf:
            t = rec[1].tensor()  # (its own copy: it may be written in place)
            self.set_leaf(node, t, None)
            return t
        if rec[0] is None:
            dtype, dev, _ = scalar_spec(rec[1], DESCS[rec[2]][1], DESCS[rec[2]][2])
            with torch._C.DisableTorchFunction():
                t = torch.tensor(rec[1], dtype=dtype, device=dev)
            self.set_leaf(node, t, rec[1])
            return t
        return rec[0]

    def leaf_set_requires_grad(self, node, value: bool) -> None:
        t = self.leaf_value(node)
        t.requires_grad_(value)
        self.set_leaf(node, t, None)  # a scalar leaf now batches by stacking (keeps autograd)
        self.set_rg_bit(node, 0, t.requires_grad)

    def materialize_leaves(self, did: int) -> None:
        """Give every pending leaf with descriptor ``did`` a row of one new buffer."""
        shape, dtype, device = DESCS[did]
        if not shape:
            scalars = self.take_scalar_values(did)  # torch.tensor(python scalar) leaves: one buffer from C
            if scalars is not None:
                nodes, values, is_float = scalars
                t = torch.frombuffer(values, dtype=torch.float64 if is_float else torch.int64)
                if t.dtype != dtype:
                    if dtype.is_floating_point or dtype.is_complex or dtype is torch.bool:
                        t = t.to(dtype=dtype)
                    else:  # a narrower integer: eager's range check (a cast would wrap 300 to 44 in int8)
                        t = torch.tensor(t.tolist(), dtype=dtype)
                t = to_device(t, device)
                buf = len(self.buffers)
                self.buffers.append(t)
                self.place(nodes, buf, 0)
                return
        nodes = self.take_pending_leaves(did)
        if not nodes:
            return
        records = [self.leaf_record(nd) for nd in nodes]
        t = stack_leaves(records, DESCS[did], self.leaf_value, nodes)
        buf = len(self.buffers)
        self.buffers.append(t)
        self.place(nodes, buf, 0)

    def mode_call(self, func, args, kwargs):
        return RecorderBase.mode_call(self, func, args, kwargs)

    def const_entry(self, func, args, kwargs):
        """For the core's cache of constant factories' calls: ``(did, ConstLeaf)`` of the call
        (consts.py), or, when it keeps no template, the call's value itself (a leaf of the tensor
        made now, or what the mode's path gives)."""
        k = consts.key(func, args, kwargs)
        if k is None:
            return RecorderBase.mode_call(self, func, args, kwargs)
        did, value = consts.template(func, args, kwargs, k, did_of)
        return (did, value) if did is not None else self.leaf(value)

    def scalar_leaf(self, v, dtype=None, device=None):
        if dtype is None and device is None:
            out = self.mode_scalar(v)
            if out is not None:
                return out
        out = RecorderBase.scalar_leaf(self, v, dtype, device)
        if device is not None:
            # the C path makes the next torch.tensor(scalar) on this device without Python
            dt, _, did = scalar_spec(v, dtype, device)
            try:
                self.dev_dids.setdefault(device, {})[dt] = did
            except TypeError:  # an unhashable device argument: the Python path stays
                pass
        return out

    def group_lens(self, nodes):
        return [self.node_lens(nd) for nd in nodes]


__all__ = ["CRecorder"]
