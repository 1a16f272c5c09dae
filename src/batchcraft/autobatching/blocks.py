"""Static blocks: straight-line code scheduled and batched as one unit.

``static_block(fn_or_module)`` marks code without data-dependent control flow (ACRoBat §4.1,
grain-size coarsening). Inside ``autobatch`` a call of the block is recorded as *one* node.
The first call with a given signature traces the body once, at per-instance shapes, into a
:class:`~batchcraft.autobatching.program.Program` (:class:`BlockTracer`); every group of
block nodes then runs that program on batched values as one lowered function (:mod:`lower`).

List arguments (a node's children) are keyed as *empty* or *non-empty* when the block's trace
is ragged-safe (:mod:`ragged`): nodes with any number of children then run as one group.
Otherwise a list's length is part of the signature. Rules for block code: no branching on
tensor values (such a block runs unblocked, counted); Python control flow on shapes or non-tensor
arguments is fine, because those are part of the signature. A block re-traces when its fingerprint changes: the
parameters, buffers and ``training`` flags of its module (a function block: of the modules it
reaches, ``reach.py``), the tensors it captures outside modules, and the fingerprints of the
blocks its traces called.

A body that writes state outliving the call (a train-mode batch norm's running statistics, a
buffer updated in place) or updates one of its values in place cannot be a program replayed once
per group: such writes must happen once per instance, in instance order. Its trace stops at the
first such call (:class:`_SharedWrite`, before the write runs) and the block then runs unblocked,
as ordinary instance code, until its fingerprint changes (counted in ``stats.fallback_reasons``).
A body whose trace fails on placeholders (a branch on a value, an output shape that depends on
values, or an operation that fails at these shapes: :class:`_ValuesNeeded`) runs unblocked too,
until the next call.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.modules.module as _nn_module
from torch import nn

from batchcraft.autobatching import _native, buffers as _buffers, cells as _cells, embedding as _embedding, stack
from batchcraft.autobatching.descs import DESCS
from batchcraft.autobatching.devices import with_factory_device
from batchcraft.autobatching.dtypes import with_default_dtype
from batchcraft.autobatching.functional import is_inplace_call, writes_first
from batchcraft.autobatching.infer import NeedsValues, infer_outputs
from batchcraft.autobatching.reach import reach
from batchcraft.autobatching.lazy import LazyTensor, user_mode_on_top
from batchcraft.autobatching.program import Program, Step
from batchcraft.autobatching.signature import (LEAF, RAGGED, SCALAR_TYPES, SIGNATURES, Opaque, SigInfo, flatten,
                                               rebuild, shared_descriptor)
from batchcraft.autobatching.threadstate import autocast_dtypes, op_state
from batchcraft.errors import AutobatchError

_current = stack.current
_SET_GRAD_ENABLED = torch._C._set_grad_enabled
_PROPERTY = type(torch.Tensor.data.__get__)  # what torch hands a mode for ``t.device``, ``t.shape``
_Lazy = LazyTensor


#: a module's hook dicts (torch.nn.Module) and the global ones: part of a block's fingerprint
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks")


class _SharedWrite(Exception):
    """Raised while a block is traced: its body writes state that outlives the call (a module's
    running statistics, a counter buffer) or updates a value in place. A program replayed once
    per group would apply such writes once per group, not once per instance in instance order,
    so the block runs unblocked instead (:meth:`StaticBlock.run_unblocked`)."""


class _ValuesNeeded(_SharedWrite):
    """Raised while a block is traced: the body needs values the placeholders do not have (a
    branch on a tensor value, an output shape that depends on values, ``x[x > 0]``), or an
    operation fails at the instance's shapes.
    Unlike other writes, this one is retried at the next call (the failure may be one bad input's)."""


def _first_line(exc, limit: int = 160) -> str:
    """The first line of ``exc``'s message, at most ``limit`` characters (for a fallback reason)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _shared_write(func, args, kwargs):
    """Why ``func(*args, **kwargs)`` cannot be part of a block's program, or None."""
    if func in _buffers.BATCH_NORMS:
        b = _buffers.parse_batch_norm(args, kwargs)
        if b is not None and b["training"] and (b["running_mean"] is not None or b["running_var"] is not None):
            return "a train-mode batch norm updates running statistics"
    if func in _buffers.INSTANCE_NORMS:
        b = _buffers.parse_instance_norm(args, kwargs)
        if b is not None and b["use_input_stats"] and (b["running_mean"] is not None or b["running_var"] is not None):
            return "an instance norm with input statistics updates running statistics"
    name = getattr(func, "__name__", func)
    if args and isinstance(args[0], torch.Tensor) and writes_first(func, kwargs):
        return f"{name} writes a tensor shared by all instances in place"
    if kwargs and kwargs.get("out") is not None:
        return f"{name}(..., out=...) writes its out= tensor"
    if args and type(args[0]) is _Lazy and is_inplace_call(func, args, kwargs, _Lazy):
        return f"in-place {name}"
    return None


class TracedList(list):
    """A block's list argument while the block is traced for ragged execution.

    ``bool()`` (empty or not) is part of the signature and allowed; reading its length or its
    members one by one makes the trace not ragged-safe (the block then keys lists by length).
    """

    __slots__ = ("tracer",)

    def _touch(self):
        self.tracer.ragged_unsafe = "the block reads a list argument's length or members"

    def __bool__(self):
        return list.__len__(self) > 0

    def __len__(self):
        self._touch()
        return list.__len__(self)

    def __iter__(self):
        self._touch()
        return list.__iter__(self)

    def __getitem__(self, i):
        self._touch()
        return list.__getitem__(self, i)

    def __reversed__(self):
        self._touch()
        return list.__reversed__(self)


#: modules given as arguments whose state one block's fingerprint follows (each is checked at every
#: call; traces keyed by further ones are not re-checked: README)
MAX_ARG_MODULES = 64


def _may_hold_modules(a) -> bool:
    """An argument worth walking for modules: not a value, a tensor, a scalar or a list of values
    (a TracedList is never iterated here: that would mark the trace ragged-unsafe)."""
    if type(a) is _Lazy or type(a) is TracedList or isinstance(a, (torch.Tensor, int, float, bool, str, type(None))):
        return False
    if type(a) is list or type(a) is tuple:
        return not all(type(b) is _Lazy for b in a)
    return True


def _forget(table: dict, key, _ref) -> None:
    table.pop(key, None)


def _snapshot(m) -> tuple:
    """What a traced body could store on module ``m``: its attributes, buffers, and the contents
    of the lists, dicts and plain objects among its attributes (``self.history.append(h)``)."""
    inner = []
    for v in m.__dict__.values():
        if type(v) is list:
            inner.append((v, list(v)))
        elif type(v) is dict:
            inner.append((v, dict(v)))
        elif not isinstance(v, (nn.Module, torch.Tensor, type)) and type(v).__module__ not in ("builtins", "torch") \
                and isinstance(getattr(v, "__dict__", None), dict):
            inner.append((v, dict(vars(v))))
    return m, dict(m.__dict__), dict(m._buffers), inner


def _holds(value, tracer) -> bool:
    return type(value) is _Lazy and value.rec is tracer


def _restore_module_state(saved, tracer):
    """Undo what a traced body stored on modules (``self.ema = 0.9 * self.ema + 0.1 * h``,
    ``self.history.append(h)``): the trace's lazy values must not stay there. Returns where the
    first one was stored, or None."""
    assigned = None
    for m, attrs, buffers, inner in saved:
        for store, before in ((m.__dict__, attrs), (m._buffers, buffers)):
            for k, v in list(store.items()):
                if _holds(v, tracer) or (before.get(k) is not v and type(v) in (list, tuple, dict)
                                         and any(_holds(e, tracer) for e in (v.values() if type(v) is dict else v))):
                    # a value, or a new container holding one (``self.hist = self.hist + [h]``)
                    assigned = assigned or f"{type(m).__name__}.{k}"
                    if k in before:
                        store[k] = before[k]
                    else:
                        del store[k]
        for obj, before in inner:
            if type(obj) is list:
                if any(_holds(v, tracer) for v in obj):
                    assigned = assigned or f"into a list of {type(m).__name__}"
                    obj[:] = before
            else:
                d = obj if type(obj) is dict else vars(obj)
                if any(_holds(v, tracer) for v in d.values()):
                    assigned = assigned or f"into {type(obj).__name__} of {type(m).__name__}"
                    d.clear()
                    d.update(before)
    return assigned


class BlockTracer:
    """Records a block's body at per-instance shapes into a :class:`Program`.

    Its lazy values (the block's inputs and the outputs of its steps) are indexed by
    ``self.values``: ``("in", j)``, ``("ragged", r)`` (one entry per ragged list, shared by its
    members) or ``("val", k, s)``, with their descriptor ids and ``requires_grad`` flags.
    """

    is_tracer = True
    lazy_type = LazyTensor

    def __init__(self, block, parent):
        self.block = block
        self.parent = parent
        self.steps: list[Step] = []
        self.values: list = []   # node id -> (ref, did, rg)
        self.shape_dependent = False
        self.ragged_unsafe = None
        self.instance = getattr(parent, "instance", -1)
        self.blocks_checked = getattr(parent, "blocks_checked", set())
        self.options = getattr(parent, "options", None)
        self.factory_device = getattr(parent, "factory_device", None)
        self.nested_blocks: set = set()  # blocks called by this body: part of its fingerprint
        self.const_ids: set = set()  # ids of tensors from outside the block its steps read
        self.entry_state = op_state()  # grad mode, inference mode, autocast where the body starts

    # -- lazy protocol ---------------------------------------------------------------------------
    def note_shape(self, x=None) -> None:
        self.shape_dependent = True

    def node_name(self, node) -> str:
        ref = self.values[node][0]
        return ref[0] if ref[0] != "val" else self.steps[ref[1]].name

    def requires_grad_of(self, x) -> bool:
        return bool(self.values[x.node][2][x.slot] if self.values[x.node][0][0] == "val" else self.values[x.node][2])

    def is_leaf_of(self, x) -> bool:
        return not self.requires_grad_of(x)

    def grad_fn_of(self, x):
        return None

    def set_requires_grad(self, x, value):
        raise AutobatchError(f"static block {self.block.name!r}: requires_grad_() inside a static block is not supported",
                             hint="change requires_grad outside the block")

    def register_hook(self, x, hook):
        raise AutobatchError(f"static block {self.block.name!r}: register_hook inside a static block is not supported",
                             hint="register the hook on the block's output, outside the block")

    def inplace(self, x, func, args, kwargs):
        raise _SharedWrite(f"in-place .{getattr(func, '__name__', func)}()")

    def setitem(self, x, key, value):
        raise _SharedWrite("item assignment")

    def scalar(self, x, why, to):
        return self.materialize(x, why)

    def materialize(self, x, why):
        # a branch on a value (``if x.sum() > 0``), ``.item()``: the trace has no values. Run
        # unblocked, the body gets the instance's values and works as in eager (counted)
        raise _ValuesNeeded(f"it needs a tensor's value to {why} (move value-dependent branches out of the "
                            f"block to keep it batched)")

    def mode_call(self, func, args, kwargs):
        kwargs = kwargs or {}
        if self.factory_device is not None:
            kwargs = with_factory_device(func, kwargs, self.factory_device)
        # the step keeps the dtype the default gave the call: the program runs at the flush,
        # maybe under another default (reliability #271; the default is in the fingerprint)
        kwargs = with_default_dtype(func, args, kwargs)
        return self.record(func, args, kwargs)

    def for_handler(self, func, args, kwargs, frame=None):
        """A torch call from a ``__torch_function__`` frame (see ``RecorderBase.for_handler``):
        a mode of the user's handler inside a block would see traced values, not tensors."""
        import sys

        from batchcraft.autobatching.mode import handler_mode

        mode = handler_mode(frame or sys._getframe(1))
        if mode is not None:
            raise AutobatchError(f"static block {self.block.name!r}: a torch-function mode "
                                 f"({type(mode).__name__}) entered inside a static block is not supported",
                                 hint="enter the mode outside the block, or do not mark this code static_block")
        return self.mode_call(func, args, kwargs)

    def check_owner(self, x, func):
        if x.rec is not self:
            raise AutobatchError(
                f"static block {self.block.name!r} uses a lazy value that was not passed to it as an argument "
                f"(in {getattr(func, '__name__', func)})",
                hint="pass every per-instance tensor the block reads as an argument of the block call")

    # -- values ----------------------------------------------------------------------------------
    def new_value(self, ref, did, rg):
        self.values.append((ref, did, rg))
        return len(self.values) - 1

    def placeholder(self, ref, did, rg):
        node = self.new_value(ref, did, rg)
        return _Lazy(self, node, 0, did)

    def _ref(self, x):
        entry = self.values[x.node]
        ref = entry[0]
        if ref[0] == "val":
            return ("val", ref[1], x.slot)
        return ref

    # -- recording ---------------------------------------------------------------------------------
    def record(self, func, args, kwargs):
        if func is _SET_GRAD_ENABLED:
            # ``with torch.no_grad():`` reaches the mode as this call: recorded, it would not switch
            # anything, and a program runs all its steps under the call's grad mode anyway
            raise _SharedWrite("it changes grad mode, inference mode or autocast inside its body")
        why = _shared_write(func, args, kwargs)
        if why is not None:
            raise _SharedWrite(why)
        if type(func) is _PROPERTY and len(args) == 1 and not kwargs and type(args[0]) is not _Lazy:
            # a fact of a captured tensor (``W.device``): read from the tensor itself, not inferred
            # on a meta copy (it said "meta"; hostile helper, stop 40). The block's fingerprint
            # holds the captured tensors' metadata, so a change retraces it.
            with torch._C.DisableTorchFunction():
                out = func(*args)
            if not isinstance(out, torch.Tensor):
                if isinstance(args[0], torch.Tensor):
                    self.const_ids.add(id(args[0]))  # (its metadata joins the fingerprint)
                return out
        if func in _cells.CELL_FUNCS:
            out = _cells.record_cell(self, func, args, kwargs)
            if out is not NotImplemented:
                return out
        if func in _embedding.EMBEDDINGS:
            form = _embedding.one_index_form(func, args, kwargs or {}, _Lazy)
            if form == "per_instance":
                raise _SharedWrite("embedding with scale_grad_by_freq over several indices per call")
            if form is not None:
                args, kwargs = form
        leaves: list = []
        struct = (flatten(args, leaves, _Lazy), flatten(kwargs, leaves, _Lazy) if kwargs else None)
        refs, dids, batched, specs = [], [], [], []
        for x in leaves:
            if type(x) is _Lazy:
                self.check_owner(x, func)
                ref = self._ref(x)
                rg = self.requires_grad_of(x)
                refs.append(ref)
                dids.append(x.did)
                batched.append(True)
                specs.append(("lazy", x.did, rg))
            else:
                if isinstance(x, torch.Tensor):
                    self.const_ids.add(id(x))
                refs.append(("const", x))
                dids.append(None)
                batched.append(False)
                specs.append(("shared", x))
        state = op_state()
        if state != self.entry_state:
            # a program runs all its steps under the call's state: a body that switches grad mode,
            # inference mode or autocast (``with torch.no_grad():`` around some of its steps) runs
            # unblocked, each operation recorded with the state it ran in
            raise _SharedWrite("it changes grad mode, inference mode or autocast inside its body")
        nested = None
        if isinstance(func, StaticBlock) and any(batched):
            nested = func.nested_info(struct, leaves, specs, state, self)
            out_struct, out_dids, out_rg = nested.out_struct, nested.out_dids, nested.out_rg
        else:
            if isinstance(func, StaticBlock):
                func = func.fn
            try:
                out_struct, out_dids, out_rg = infer_outputs(func, struct, specs, state, _Lazy)
            except NeedsValues as exc:
                # an output shape that depends on values (``x[x > 0]``), or an operation that fails
                # at these shapes: placeholders cannot tell which. Run unblocked, the operation
                # runs on the instance's values: it works, or raises torch's own error (#242)
                raise _ValuesNeeded(f"{getattr(func, '__name__', func)} cannot run on placeholders of the "
                                   f"per-instance shapes: its output shape depends on values, or it fails at "
                                   f"these shapes; torch says: {_first_line(exc, 100)}") from exc
        if not out_dids:
            return rebuild(out_struct, iter(()))
        k = len(self.steps)
        step = Step(k, func, struct, refs, dids, batched, out_struct, out_dids, out_rg, state, nested)
        self.steps.append(step)
        node = self.new_value(("val", k), None, out_rg)
        outs = [_Lazy(self, node, s, d) for s, d in enumerate(out_dids)]
        return outs[0] if out_struct is LEAF else rebuild(out_struct, iter(outs))


class StaticBlock:
    """A callable marked as a static block; see :func:`static_block`."""

    def __init__(self, fn, module: nn.Module | None = None, name: str | None = None):
        self.fn = fn
        self.module = module
        self.name = name or getattr(fn, "__qualname__", None) or type(module).__name__
        self.__name__ = self.name
        self._fingerprint = None
        self.ragged_ok: dict = {}   # list-argument pattern -> bool (None: not traced yet)
        self.unblocked: str | None = None  # why the body runs unblocked (_SharedWrite), None: it does not
        self.retrace = False  # unblocked by _ValuesNeeded: traced again at the next call's first use
        self.nested: set = set()  # blocks its traces called (their changes trace this block again)
        self.const_ids: set = set()  # ids of module buffers its traces read (held by the traces)
        self.arg_modules: dict = {}  # id -> weakref: modules its traces got as arguments (a method's self)
        if not isinstance(fn, nn.Module):
            functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        rec = _current()
        if rec is None:
            return self.fn(*args, **kwargs)
        return self.record_in(rec, args, kwargs)

    def __get__(self, obj, objtype=None):  # decorating a method
        if obj is None:
            return self
        return functools.partial(self.__call__, obj)

    def __repr__(self) -> str:
        return f"<static block {self.name}>"

    # -- recording ---------------------------------------------------------------------------------
    def record_in(self, rec, args, kwargs):
        """Record one call of the block with the active recorder ``rec``."""
        if user_mode_on_top(rec):
            # the block's operations run batched, where a mode of the user's would not see them;
            # refused whether the block was traced before or not (reliability #170)
            mode = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
            raise AutobatchError(f"static block {self.name!r}: called under a torch-function mode "
                                 f"({type(mode).__name__}) entered in instance code, which is not supported",
                                 hint="call the block's code without static_block under the mode (its calls "
                                      "then run per instance, seen by the mode), or enter the mode around the "
                                      "autobatched call (the instances then run one at a time)")
        if self not in rec.blocks_checked:
            self._check_fingerprint()
            rec.blocks_checked.add(self)
        if getattr(rec, "is_tracer", False):
            rec.nested_blocks.add(self)
            if self.unblocked is not None:  # inside another block's trace: that block runs unblocked too
                return self.fn(*args, **kwargs)
            return rec.record(self, args, kwargs)
        return self._record_slow(rec, args, kwargs)[0]

    def _record_slow(self, rec, args, kwargs):
        """Record one call off the C fast path: ``(outputs, SigInfo or None, ragged or None)``."""
        if self.unblocked is None:
            try:
                opts = rec.options
                if opts is not None and opts.ragged and not kwargs:
                    res = self._record_ragged(rec, args)
                    if res is not NotImplemented:
                        return res[0], res[1], True
                # without lazy arguments the recorder runs the block now and makes its outputs leaves
                out, info = rec.general(self, args, kwargs)
                return out, info, (False if info is not None else None)
            except _SharedWrite as exc:
                self.unblocked = str(exc)
                self.retrace = isinstance(exc, _ValuesNeeded)
        return self.run_unblocked(rec, args, kwargs), None, None

    def run_unblocked(self, rec, args, kwargs):
        """Run the body as ordinary instance code, recorded operation by operation.

        For a body that writes state outliving the call (``_SharedWrite``): train-mode
        ``BatchNorm`` updates its running statistics and ``num_batches_tracked`` once per
        instance, in instance order, as in eager; in-place updates of values follow the usual
        rules. Counted in ``stats.fallback_reasons``; the block is traced again when its
        module's parameters, buffers or ``training`` flags change.
        """
        runtime = getattr(rec, "runtime", None)
        if runtime is not None:
            runtime.stats.note_fallback(f"static block {self.name}: runs unblocked, operation by operation "
                                        f"({self.unblocked})")
        return self.fn(*args, **kwargs)

    def _record_ragged(self, rec, args):
        """Record with list arguments keyed empty / non-empty (NotImplemented: not applicable)."""
        pattern, leaves_single, lists = [], [], []
        for a in args:
            t = type(a)
            if t is list and a and all(type(b) is _Lazy for b in a):
                did = a[0].did
                if any(b.did != did for b in a):
                    return NotImplemented
                pattern.append((RAGGED, True, did * 2 + rec.rg_bit(a[0].node, a[0].slot)))
                if any(rec.rg_bit(b.node, b.slot) != rec.rg_bit(a[0].node, a[0].slot) for b in a):
                    return NotImplemented
                lists.append(a)
            elif t is list and not a:
                pattern.append((RAGGED, False, 0))
                lists.append(a)
            elif t is _Lazy:
                pattern.append(a.did * 2 + rec.rg_bit(a.node, a.slot))
                leaves_single.append(a)
            elif t is float:
                pattern.append((float, a.hex()))
            elif t in SCALAR_TYPES:
                pattern.append((t, a))
            elif t is not tuple and t is not dict and not isinstance(a, (torch.Tensor, list)):
                # an object by identity, as the general path keys it: a decorated method's ``self``
                # (its module state is in the block's fingerprint, ``_note_arg_modules``)
                pattern.append((Opaque, Opaque(a)))
            else:
                return NotImplemented
        if not any(p[1] for p in pattern if type(p) is tuple and p and p[0] is RAGGED):
            return NotImplemented  # no non-empty list: the ordinary path (lists of length 0 key the same)
        for a in leaves_single:
            rec.check_owner(a, self)
        for lst in lists:
            for b in lst:
                rec.check_owner(b, self)
        # lists with equal lengths in this node share a length class (and segment ids)
        lens = [len(lst) for lst in lists if lst]
        classes, first_of = [], {}
        for ln in lens:
            classes.append(first_of.setdefault(ln, len(first_of)))
        state = op_state()
        key = (self, tuple(pattern), tuple(classes), state)
        info = SIGNATURES.get(key)
        if info is None:
            if self.ragged_ok.get((tuple(pattern), tuple(classes))) is False:
                return NotImplemented
            info = self._trace_ragged(key, args, pattern, classes, state, rec)
            if info is None:
                self.ragged_ok[(tuple(pattern), tuple(classes))] = False
                return NotImplemented
        members = [b for lst in lists if lst for b in lst]
        return rec.append(info, leaves_single + members, tuple(lens)), info

    def nested_info(self, struct, leaves, specs, state, tracer):
        """SigInfo of a block called inside another block's trace (per-length lists)."""
        dkey = tuple(s[1] * 2 + s[2] if s[0] == "lazy" else shared_descriptor(s[1]) for s in specs)
        key = (self, struct, dkey, state)
        info = SIGNATURES.get(key)
        if info is None:
            info = self.trace(key, struct, leaves, specs, state, tracer)
        return info

    def _check_fingerprint(self) -> None:
        """At the block's first call in a recording (both cores): its traces are dropped when what
        they depend on changed, and a body unblocked by a trace that needed values is traced again
        (the failure may have been one call's input: it must not slow every later call)."""
        if self.retrace:
            self.unblocked, self.retrace = None, False
        with torch._C.DisableTorchFunction():  # plain reads of parameters: not through the recorder's mode
            fp = self._fingerprint_now()
        if fp != self._fingerprint:
            SIGNATURES.drop_func(self)
            self.ragged_ok.clear()
            self.unblocked = None
            self.const_ids = set()  # (its traces, which held those tensors, are dropped)
            with torch._C.DisableTorchFunction():
                self._fingerprint = self._fingerprint_now()

    def reached_modules(self) -> list:
        """The modules whose state the block's traces may read: its module and those its
        ``forward`` reaches, or for a function block those the function reaches (``reach.py``),
        and the modules its traces got as arguments (a decorated method's ``self``)."""
        return self._reached()[0]

    def _reached(self):
        args = [m for m in (r() for r in list(self.arg_modules.values())) if m is not None]
        if self.module is not None:
            modules, tensors = reach(type(self.module).forward)
            return [self.module] + modules + args, tensors
        modules, tensors = reach(self.fn)
        return modules + args, tensors

    def _modules_fingerprint(self, modules, tensors) -> list:
        """Parameters, buffers and ``training`` flags of ``modules`` and their submodules, and
        the identity and metadata of captured ``tensors``."""
        # tensors captured outside modules (a global ``W`` re-bound or switched to requires_grad)
        parts = [(id(t), t.shape, t.dtype, t.device, t.requires_grad) for t in tensors]
        seen = set()
        const_ids = self.const_ids
        todo = list(reversed(modules))
        while todo:  # every module and submodule once, depth first (Module.modules() without its names)
            m = todo.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            d = m.__dict__
            parts.append(m.training)
            # hooks run inside the traces: one added or removed between calls means a new trace
            # (reliability #185); their handles' ids are unique
            for a in _HOOK_DICTS:
                h = d.get(a)
                if h:
                    parts.append((a, tuple(h)))
            for t in d["_parameters"].values():
                if t is not None:
                    parts.append((id(t), t.shape, t.dtype, t.device, t.requires_grad))
            # a buffer counts by identity only where a trace read it: instance code may assign
            # a new one every call (``self.ema = ...``) that no trace reads
            for t in d["_buffers"].values():
                if t is not None:
                    parts.append((id(t) if id(t) in const_ids else 0, t.shape, t.dtype, t.device, t.requires_grad))
            subs = d["_modules"]
            if subs:
                todo.extend(c for c in reversed(subs.values()) if c is not None)
        return parts

    def _fingerprint_now(self, visiting=None):
        """What the block's traces depend on beside their arguments: the parameters, buffers and
        ``training`` flags of its module (a function block: of the modules it reaches, see
        ``reach.py``), the tensors it captures outside modules, the fingerprints of the blocks its
        traces called, the default device, the default dtype and autocast's dtypes (traces hold
        the ``device=`` and ``dtype=`` their factory calls got: devices.py, dtypes.py)."""
        fdev = getattr(_current(), "factory_device", None)
        visiting = visiting if visiting is not None else set()
        visiting.add(self)
        modules, tensors = self._reached()
        parts = self._modules_fingerprint(modules, tensors)
        nested = tuple(b._fingerprint_now(visiting) for b in list(self.nested) if b not in visiting)
        glob = tuple(tuple(d) for d in (getattr(_nn_module, a, None) for a in _GLOBAL_HOOK_DICTS) if d is not None)
        return tuple(parts) + nested + (fdev, torch.get_default_dtype(), autocast_dtypes(), glob)

    # -- tracing -----------------------------------------------------------------------------------
    def _run_body(self, tracer, args, kwargs):
        stack.push(tracer)
        # tracing runs a random factory's call once (torch.rand(8)): the CPU generator is put back,
        # so a first call draws what later calls with the same seed draw
        rng = torch.get_rng_state()
        self._note_arg_modules(args, kwargs)
        saved = [_snapshot(m) for root in self.reached_modules() for m in root.modules()]
        assigned = None
        try:
            out = self.fn(*args, **kwargs)
        finally:
            torch.set_rng_state(rng)
            stack.pop()
            assigned = _restore_module_state(saved, tracer)
            if not (tracer.nested_blocks <= self.nested and tracer.const_ids <= self.const_ids):
                # a block called, or a buffer read, for the first time: part of the fingerprint now
                self.nested |= tracer.nested_blocks
                self.const_ids |= tracer.const_ids
                with torch._C.DisableTorchFunction():
                    self._fingerprint = self._fingerprint_now()
        if assigned is not None:
            raise _SharedWrite(f"stores a value ({assigned})")
        return out

    def _note_arg_modules(self, args, kwargs) -> None:
        """Modules among the arguments of a call being traced (``step(model, x)``, a decorated
        method's ``self``): their state is part of the fingerprint from now on."""
        others = [a for a in list(args) + list(kwargs.values()) if _may_hold_modules(a)]
        for a in (reach(others)[0] if others else ()):  # also in containers and objects among them
            if id(a) not in self.arg_modules and len(self.arg_modules) < MAX_ARG_MODULES:
                self.arg_modules[id(a)] = weakref.ref(a, functools.partial(_forget, self.arg_modules, id(a)))

    def _finish(self, tracer, out, key, ragged_dids=(), classes=(), rec=None, n_in=None):
        out_leaves: list = []
        out_struct = flatten(out, out_leaves, _Lazy)
        out_refs, out_dids, out_rg = [], [], []
        for x in out_leaves:
            if type(x) is _Lazy:
                tracer.check_owner(x, self)
                out_refs.append(tracer._ref(x))
                out_dids.append(x.did)
                out_rg.append(tracer.requires_grad_of(x))
            elif isinstance(x, torch.Tensor):
                out_refs.append(("const", x))
                dev = DESCS[tracer.values[0][1]][2] if tracer.values and tracer.values[0][1] else x.device
                from batchcraft.autobatching.descs import desc_id

                out_dids.append(desc_id((tuple(x.shape), x.dtype, dev)))
                out_rg.append(bool(x.requires_grad))
            else:
                raise AutobatchError(f"static block {self.name!r} returned a non-tensor inside its outputs "
                                     f"({type(x).__name__})")
        n_single = n_in if n_in is not None else sum(1 for v in tracer.values if v[0][0] == "in")
        prog = Program(tracer.steps, out_refs, out_struct, out_dids, out_rg, n_single, len(ragged_dids), classes,
                       tracer.shape_dependent, name=self.name)
        return prog

    def trace(self, key, struct, leaves, specs, state, rec):
        """Trace the body at per-instance shapes (lists by length); register and return its SigInfo."""
        tracer = BlockTracer(self, rec)
        placeholders, j = [], 0
        for x, spec in zip(leaves, specs):
            if spec[0] == "lazy":
                placeholders.append(tracer.placeholder(("in", j), spec[1], spec[2]))
                j += 1
            else:
                placeholders.append(x)
        it = iter(placeholders)
        args = rebuild(struct[0], it)
        kwargs = rebuild(struct[1], it) if struct[1] is not None else {}
        out = self._run_body(tracer, args, kwargs)
        prog = self._finish(tracer, out, key, n_in=j)
        return SIGNATURES.add(key, lambda sid: SigInfo(sid, key, self, struct, leaves, _Lazy, state[0], state,
                                                       prog.out_struct, prog.out_dids, prog.out_rg, program=prog))

    def _ragged_declined(self, rec, why: str) -> None:
        """Tell the call's statistics why this block's list arguments are not run as ragged groups
        (its nodes then group by list length: ``RunStats.ragged_declined``)."""
        st = getattr(getattr(rec, "runtime", None), "stats", None)
        if st is not None and hasattr(st, "note_ragged_declined"):
            st.note_ragged_declined(f"{self.name}: {why}")
        return None

    def _trace_ragged(self, key, args, pattern, classes, state, rec):
        """Trace with ragged lists (2 placeholder members each); None if the trace is not ragged-safe."""
        from batchcraft.autobatching import ragged

        tracer = BlockTracer(self, rec)
        new_args, j, r = [], 0, 0
        ragged_dids = []
        for a, p in zip(args, pattern):
            if type(a) is _Lazy:
                new_args.append(tracer.placeholder(("in", j), a.did, bool(rec.rg_bit(a.node, a.slot))))
                j += 1
            elif type(a) is list:
                lst = TracedList()
                lst.tracer = tracer
                if a:
                    did, rg = a[0].did, bool(rec.rg_bit(a[0].node, a[0].slot))
                    node = tracer.new_value(("ragged", r), did, rg)
                    list.extend(lst, [_Lazy(tracer, node, 0, did), _Lazy(tracer, node, 0, did)])
                    ragged_dids.append(did)
                    r += 1
                new_args.append(lst)
            else:
                new_args.append(a)
        try:
            out = self._run_body(tracer, new_args, {})
        except (AutobatchError, _ValuesNeeded) as exc:
            # e.g. the body indexes the list, or an operation fails at the two-member placeholder
            # lists: per-length tracing, at the real lengths, will work or say what is wrong
            return self._ragged_declined(rec, f"its trace over the list failed ({exc.args[0] if exc.args else exc})")
        if tracer.ragged_unsafe is not None:
            return self._ragged_declined(rec, tracer.ragged_unsafe)
        prog = self._finish(tracer, out, key, ragged_dids, classes, n_in=j)
        if not ragged.analyse(prog):
            return self._ragged_declined(rec, getattr(prog, "ragged_declined", "an operation without a ragged form"))
        leaves = [a for a in args if type(a) is _Lazy]
        return SIGNATURES.add(key, lambda sid: SigInfo(sid, key, self, ("ragged", tuple(pattern)), leaves, _Lazy,
                                                       state[0], state, prog.out_struct, prog.out_dids, prog.out_rg,
                                                       program=prog, ragged=ragged_dids, lens_classes=classes))


_MODULE_TRAIN = nn.Module.train


def _recording_train(self, mode: bool = True):
    """``nn.Module.train``, which also tells a recording call of this thread that a module's
    mode changed: its blocks check their fingerprints again (a block's module switched by
    ``eval()``/``train()`` inside instance code is traced, or run unblocked, for its new mode).
    Outside a recording call it is ``nn.Module.train`` plus one thread-local lookup."""
    rec = _current()
    changed = rec is not None and any(m.training != bool(mode) for m in self.modules())
    out = _MODULE_TRAIN(self, mode)
    if changed:
        forget = getattr(rec, "forget_block_checks", None)
        if forget is not None:
            forget()
    return out


_train_hook_installed = False


def install_train_hook() -> None:
    """Put :func:`_recording_train` on ``nn.Module`` once, at the first recording call, and
    leave it there: setting and restoring a method of ``nn.Module`` around every call cost about
    0.13 ms a call (Python invalidates the method caches of every ``nn.Module`` subclass on each
    change). A ``train`` someone else installed first is wrapped, not replaced."""
    global _MODULE_TRAIN, _train_hook_installed
    if _train_hook_installed:
        return
    _train_hook_installed = True
    _MODULE_TRAIN = nn.Module.__dict__["train"]
    nn.Module.train = _recording_train


def _python_call(self, *args, **kwargs):
    rec = _current()
    if rec is None:
        return self.fn(*args, **kwargs)
    return self.record_in(rec, args, kwargs)


if _native.core is not None:
    # a C method descriptor: a block call is recorded without a Python frame
    StaticBlock.__call__ = _native.core.BlockCall()
    _MODULE_CALL = _native.core.BlockCall()
else:
    _MODULE_CALL = None


def static_block(obj):
    """Mark a function, an ``nn.Module`` instance or an ``nn.Module`` class as a static block.

    A static block contains no control flow that depends on tensor values. Inside
    :func:`batchcraft.autobatch` each call is one scheduled node, and the calls of all
    instances with the same signature run as one batched program (ACRoBat §4.1, grain-size
    coarsening). Outside ``autobatch`` the block runs as usual. A body that cannot be traced on
    placeholders of the per-instance shapes (a branch on a tensor value, ``.item()``; an output
    shape that depends on values, ``x[x > 0]``; an operation that fails at these shapes) runs
    unblocked for that call, operation by operation, with eager's values or eager's error
    (counted in ``stats.fallback_reasons``), and is traced again at the next call.

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
        orig_init = obj.__init__

        def __init__(self, *args, **kwargs):
            orig_init(self, *args, **kwargs)
            object.__setattr__(self, "_batchcraft_block",
                               StaticBlock(functools.partial(orig_call, self), module=self, name=type(self).__name__))

        def __call__(self, *args, **kwargs):
            blk = self.__dict__["_batchcraft_block"]
            rec = _current()
            if rec is None:
                return blk.fn(*args, **kwargs)
            return blk.record_in(rec, args, kwargs)

        def __reduce_ex__(self, protocol):
            state = {k: v for k, v in self.__dict__.items() if k != "_batchcraft_block"}
            return (_restore_decorated, (type(self), state))

        return type(obj.__name__, (obj,), {"__init__": __init__,
                                           "__call__": _MODULE_CALL if _MODULE_CALL is not None else __call__,
                                           "__reduce_ex__": __reduce_ex__, "_orig_call": orig_call,
                                           "__module__": obj.__module__, "__qualname__": obj.__qualname__,
                                           "__doc__": obj.__doc__})
    if isinstance(obj, nn.Module):
        blk = StaticBlock(nn.Module.__call__.__get__(obj), module=obj, name=type(obj).__name__)
        obj.__dict__["_batchcraft_block"] = blk
        obj.__class__ = _block_class(type(obj))
        return obj
    if callable(obj):
        return StaticBlock(obj)
    raise TypeError(f"static_block: expected a function or an nn.Module, got {type(obj).__name__}")


def _restore_decorated(cls, state):
    """Unpickle an instance of a class decorated with ``static_block``."""
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    object.__setattr__(obj, "_batchcraft_block",
                       StaticBlock(functools.partial(cls._orig_call, obj), module=obj, name=cls.__name__))
    return obj


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

    return type(cls.__name__, (cls,), {"__call__": _MODULE_CALL if _MODULE_CALL is not None else __call__,
                                       "__reduce_ex__": __reduce_ex__,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "_batchcraft_static": True})
