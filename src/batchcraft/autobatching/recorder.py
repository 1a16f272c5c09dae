"""Recording of per-instance operations on lazy values.

:class:`Recorder` is the hot path: every torch call made by instance code on a
lazy value costs one :meth:`Recorder.record` (a few microseconds: flatten the
arguments, build the signature, look up the inferred output shape, append the
node to its (phase, depth, signature) bucket).

Output shapes are inferred once per signature by running the operation on
``meta`` tensors and cached, so instance code can read ``.shape`` of any lazy
value. Calls with no lazy argument run at once; tensors they return (e.g.
``torch.tensor(word_id)``) become per-instance *leaves* that are batched like
any other per-instance value.
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

from batchcraft.autobatching import lazy as _lazy
from batchcraft.autobatching.graph import Graph, LeafNode, Node
from batchcraft.autobatching.lazy import LazyTensor
from batchcraft.autobatching.signature import _SCALARS, LEAF, SigInfo, flatten, flatten_args, rebuild
from batchcraft.errors import AutobatchError, UnsupportedOperationError

_tls = threading.local()


def current():
    """The innermost active recorder of this thread, or None."""
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


def push(rec) -> None:
    if not hasattr(_tls, "stack"):
        _tls.stack = []
    _tls.stack.append(rec)


def pop() -> None:
    _tls.stack.pop()


class _State:
    current = staticmethod(current)


_lazy._state = _State

# Per-signature output inference: key -> (out_struct, out_descs). Keys hold ids of shared tensors,
# so the cache is bounded and cleared when it grows (a stale id only costs a re-inference).
_META_CACHE: dict = {}
_FAST_CACHE: dict = {}  # (func, interned arg signature, grad mode) -> SigInfo
_META_CACHE_MAX = 200_000
_grad_enabled = torch.is_grad_enabled
_CPU = torch.device("cpu")


def infer_outputs(func, struct, leaves, device):
    """Run ``func`` on meta tensors; return (out_struct, out_descs)."""
    with torch._C.DisableTorchFunction(), torch.no_grad():
        metas = []
        for x in leaves:
            if type(x) is LazyTensor:
                shape, dtype, _ = x.desc
                metas.append(torch.empty(shape, dtype=dtype, device="meta"))
            else:
                metas.append(x.to("meta"))
        it = iter(metas)
        args = rebuild(struct[0], it)
        kwargs = rebuild(struct[1], it) if struct[1] is not None else {}
        out = func(*args, **kwargs)
    out_leaves: list = []
    out_struct = flatten(out, out_leaves)
    descs = tuple((tuple(t.shape), t.dtype, device) for t in out_leaves)
    return out_struct, descs


_torch_tensor = torch.tensor
_PY_SCALARS = (int, float, bool)
_SCALAR_KW = frozenset({"dtype", "device"})
_I64 = 2 ** 63
_SCALAR_SPECS: dict = {}  # (dtype, device argument) -> (dtype, torch.device, desc, desc id)


class _RecordingMode(TorchFunctionMode):
    """Routes every torch call of instance code to the active recorder."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rec = current()
        if (func is _torch_tensor and len(args) == 1 and type(args[0]) in _PY_SCALARS
                and (not kwargs or kwargs.keys() <= _SCALAR_KW)
                and (type(args[0]) is not int or -_I64 <= args[0] < _I64)):  # else: fails now, here
            leaf = getattr(rec, "scalar_leaf", None)  # fast path: no tensor is made until needed
            if leaf is not None:
                return leaf(args[0], **(kwargs or {}))
        return rec.record(func, args, kwargs or {})


class Recorder:
    """Records the operations of the instances of one ``autobatch`` call.

    Args:
        runtime: the owning runtime (executes pending work on ``materialize``).
    """

    def __init__(self, runtime):
        self.runtime = runtime
        self.graph = Graph()
        self.instance = -1
        self.phase = 0
        self.ops_recorded = 0
        self.eager_ops = 0  # ops that could not be recorded lazily and ran on concrete values
        self.blocks_checked: set = set()
        self.mode = _RecordingMode(self)
        self.max_pending = getattr(runtime, "max_pending", None)
        self.max_steps = getattr(runtime, "max_steps", None)
        self.inst_steps = 0  # operations + synchronisations of the running instance

    # -- the hot path --------------------------------------------------------------------------
    def record(self, func, args, kwargs):
        # Fast path: arguments are lazy values, lists/tuples of them and plain scalars. The
        # signature is then spelled with interned descriptor ids, and the argument structure
        # comes from the cache instead of being rebuilt.
        if not kwargs:
            sig = []
            leaves: list = []
            for a in args:
                t = type(a)
                if t is LazyTensor:
                    leaves.append(a)
                    sig.append(a.did)
                elif t is list or t is tuple:
                    ids = []
                    for b in a:
                        if type(b) is not LazyTensor:
                            break
                        leaves.append(b)
                        ids.append(b.did)
                    else:
                        sig.append((t, tuple(ids)))
                        continue
                    break
                elif t is float:
                    sig.append((float, a.hex()))
                elif t in _SCALARS:
                    sig.append((t, a))
                else:
                    break
            else:
                if leaves:
                    fkey = (func, tuple(sig), _grad_enabled())
                    info = _FAST_CACHE.get(fkey)
                    if info is not None:
                        return self._add(info, func, info.struct, leaves)
                    info = self.signature_info(func, args, kwargs)
                    if info is None:  # ran concretely (no lazy input) or needs values
                        return self.record_general(func, args, kwargs)
                    _FAST_CACHE[fkey] = info
                    return self._add(info, func, info.struct, leaves)
        return self.record_general(func, args, kwargs)

    def step_limit(self):
        from batchcraft.errors import StepLimitError

        raise StepLimitError(f"instance {self.instance} exceeded max_steps={self.max_steps} "
                             f"(operations + synchronisations) without finishing",
                             hint="raise max_steps, or check the instance's loop condition")

    def signature_info(self, func, args, kwargs):
        """The SigInfo of a call with lazy arguments (inferred on a miss), or None."""
        _refuse(func)
        leaves: list = []
        struct = (flatten_args(args, leaves), flatten(kwargs, leaves) if kwargs else None)
        descs = []
        device = None
        for x in leaves:
            if type(x) is LazyTensor:
                descs.append(x.desc)
                if device is None:
                    device = x.desc[2]
            else:
                descs.append(("shared", id(x), x.shape, x.dtype, x.device))
        if device is None:
            return None
        key = (func, struct, tuple(descs), _grad_enabled())
        info = _META_CACHE.get(key)
        if info is None:
            try:
                info = self.infer(func, struct, leaves, device, key)
            except _NeedsValues:
                return None
        return info

    def record_general(self, func, args, kwargs):
        """Record any call: flatten the arguments, build the full signature, infer outputs."""
        _refuse(func)
        leaves: list = []
        struct = (flatten_args(args, leaves), flatten(kwargs, leaves) if kwargs else None)
        has_lazy = False
        descs = []
        device = None
        for x in leaves:
            if type(x) is LazyTensor:
                has_lazy = True
                descs.append(x.desc)
                if device is None:
                    device = x.desc[2]
            else:
                descs.append(("shared", id(x), x.shape, x.dtype, x.device))
        if not has_lazy:
            return self.run_concrete(func, args, kwargs)
        key = (func, struct, tuple(descs), _grad_enabled())
        info = _META_CACHE.get(key)
        if info is None:
            try:
                info = self.infer(func, struct, leaves, device, key)
            except _NeedsValues as nv:
                return self.run_on_values(func, struct, leaves, nv)
        return self._add(info, func, struct, leaves)

    def _add(self, info, func, struct, leaves):
        """Append a node for ``info`` with inputs ``leaves``; return its lazy outputs."""
        depth = 0
        rg = False
        phase = self.phase
        for x in leaves:
            if type(x) is LazyTensor:
                nd = x.node
                if nd.outs is None:
                    ph = nd.phase
                    if ph > phase:  # an input from a later phase (values shared across instances)
                        phase, depth = ph, nd.depth
                    elif ph == phase and nd.depth > depth:
                        depth = nd.depth
                if nd.requires_grad:
                    rg = True
            elif x.requires_grad:
                rg = True
        if self.max_steps is not None:
            self.inst_steps += 1
            if self.inst_steps > self.max_steps:
                self.step_limit()
        node = Node(info, func, struct, leaves, depth + 1, self.instance, phase,
                    (rg or info.const_grad) and info.key[3])
        graph = self.graph
        graph.buckets[(phase, depth + 1, info.sid)].append(node)  # Graph.add, inlined (hot)
        graph.n_pending += 1
        self.ops_recorded += 1
        if self.max_pending is not None and graph.n_pending >= self.max_pending:
            self.runtime.pending_limit()
        if info.single:
            return LazyTensor(node, 0, info.out_descs[0], info.out_dids[0])
        outs = [LazyTensor(node, i, d, di) for i, d, di in info.out_specs]
        if info.flat_tuple:
            return tuple(outs)
        return rebuild(info.out_struct, iter(outs))

    # -- slower paths --------------------------------------------------------------------------
    def infer(self, func, struct, leaves, device, key):
        from batchcraft.autobatching.blocks import StaticBlock

        if isinstance(func, StaticBlock):
            return func.trace(struct, leaves, device, key)
        try:
            out_struct, out_descs = infer_outputs(func, struct, leaves, device)
        except (NotImplementedError, RuntimeError, TypeError) as exc:
            # e.g. data-dependent output shapes (nonzero, unique): needs concrete values
            raise _NeedsValues(exc) from None
        if len(_META_CACHE) > _META_CACHE_MAX:
            _META_CACHE.clear()
            _FAST_CACHE.clear()
        info = _META_CACHE[key] = SigInfo(key, out_struct, out_descs)
        return info

    def run_concrete(self, func, args, kwargs):
        """A call without lazy arguments: run it now; its tensors become per-instance leaves."""
        func = getattr(func, "fn", func) if func.__class__.__name__ == "StaticBlock" else func
        with torch._C.DisableTorchFunction():
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            scalar = (func is torch.tensor and args and type(args[0]) in (int, float, bool)
                      and not out.requires_grad)
            return self.leaf(out, args[0] if scalar else None)
        if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
            leaves: list = []
            st = flatten(out, leaves)
            return rebuild(st, iter([self.leaf(t) if isinstance(t, torch.Tensor) else t for t in leaves]))
        return out

    def scalar_leaf(self, v, dtype=None, device=None) -> LazyTensor:
        """``torch.tensor(v[, dtype=, device=])`` for a Python scalar: a leaf whose tensor is made lazily."""
        if dtype is None:
            t = type(v)
            dtype = torch.int64 if t is int else (torch.bool if t is bool else torch.get_default_dtype())
        spec = _SCALAR_SPECS.get((dtype, device))  # (dtype, device, desc, desc id), interned
        if spec is None:
            dev = _CPU if device is None else torch.device(device)
            desc = ((), dtype, dev)
            spec = _SCALAR_SPECS[(dtype, device)] = (dtype, dev, desc, _lazy.desc_id(desc))
        node = LeafNode(None, v, self.instance, spec[0], spec[1])
        return LazyTensor(node, 0, spec[2], spec[3])

    def leaf(self, value: torch.Tensor, pyvalue=None) -> LazyTensor:
        node = LeafNode(value, pyvalue, self.instance)
        return LazyTensor(node, 0, (tuple(value.shape), value.dtype, value.device))

    def run_on_values(self, func, struct, leaves, nv):
        """Run an op whose output shape depends on values (nonzero, unique, ...) eagerly.

        Its lazy inputs are materialised (a fiber yields until they are computed);
        the op runs per instance, is counted in ``eager_ops``, and its outputs become leaves.
        """
        name = getattr(func, "__name__", repr(func))
        values = [self.materialize(x, f"run {name} (output shape depends on values)")
                  if type(x) is LazyTensor else x for x in leaves]
        it = iter(values)
        a = rebuild(struct[0], it)
        k = rebuild(struct[1], it) if struct[1] is not None else {}
        self.eager_ops += 1
        with torch._C.DisableTorchFunction():
            try:
                out = func(*a, **k)
            except Exception as exc:
                raise exc from nv.cause
        out_leaves: list = []
        st = flatten(out, out_leaves)
        return rebuild(st, iter([self.leaf(t) if isinstance(t, torch.Tensor) else t for t in out_leaves]))

    def materialize(self, x: LazyTensor, why: str) -> torch.Tensor:
        """Concrete value of ``x``; runs pending work first if needed (fibers yield here)."""
        node = x.node
        if type(node) is LeafNode:
            return node.value
        if node.outs is None:
            self.runtime.wait_for(x, why)
        # the recording mode may be active here (a call through a LazyTensor method): index
        # the batched result as a plain tensor, not as a new recorded op
        with torch._C.DisableTorchFunction():
            v = node.outs[x.slot][node.row]
            # the batched result requires grad if any instance's does; this one's may not (#19)
            return v.detach() if (v.requires_grad and not node.requires_grad) else v


_NO_BACKWARD = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}


def _refuse(func):
    if func in _NO_BACKWARD:
        raise UnsupportedOperationError(
            f"{getattr(func, '__qualname__', func)} inside instance code is not supported: the "
            f"instances' work has not run yet and runs batched, in one autograd graph",
            hint="return the loss from the per-instance function and call backward() on the "
                 "(summed) results after the autobatch call")


class _NeedsValues(Exception):
    """Raised when an operation's output cannot be inferred without concrete inputs."""

    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


__all__ = ["Recorder", "current", "push", "pop", "infer_outputs", "AutobatchError",
           "UnsupportedOperationError"]
