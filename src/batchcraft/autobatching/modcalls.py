"""Calls of common modules on lazy values, recorded without ``nn.Module.__call__``.

Code written without ``static_block`` calls ``nn.Linear``, ``nn.Embedding`` and the cell modules
once per instance and step. On a lazy value such a call goes through ``Module.__call__`` (two
Python frames and the hook checks), the module's ``forward`` (``self.weight`` through
``Module.__getattr__``), and torch's dispatch of ``F.linear`` / ``F.embedding`` to the
recording mode: about 1 µs of a 2.5-2.8 µs call here (issue 14, plain models). While a call
records, :data:`FAST_CALLS` gives these classes a ``__call__`` that, when nothing would make the
module's call differ from its plain forward, records the same operation the mode would have seen,
with the same arguments, directly. A module with any hook (its own or global), a compiled call,
an overridden or instance-level ``forward``, a parameter that is not a plain tensor (replaced,
parametrized, a subclass), JIT tracing, a static block's tracer, a mode of the user's on top,
or an input that is not this call's lazy value takes ``Module.__call__``, unchanged.

With the C core, the patched ``__call__`` is a ``_core.FastCall`` applying these rules in C (the
per-class verdicts, keyed by type version tag, stay in this module's dicts), and for the cells it
also records their forward's common case (:func:`cell_call`): ``nn.Linear`` 1.75 -> 0.93 µs,
``nn.Embedding`` 1.9 -> 1.1 µs, ``nn.GRUCell`` 3.3 -> 1.5 µs per call here. Whatever it declines
(another recorder, keywords, a hook, a check not cached yet) goes to the Python functions below,
which are also the Python core's path.
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from batchcraft.autobatching import _native, stack as _stack
from batchcraft.autobatching.kernels import TORCH_LINEAR
from batchcraft.autobatching.mode import NOT_ON_TOP, TORCH_DIR
from batchcraft.autobatching.patches import PatchSet, SharedPatch

_module_call = nn.Module.__call__
_tracing = torch._C._get_tracing_state
_current = _stack.current
_tf_len, _tf_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
_tf_pop, _tf_push = torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack
_PLAIN = (torch.Tensor, nn.Parameter)
_MISSING = object()  # a bias not registered (replaced or deleted): torch's path
_NONE: dict = {}
_MODULE_ATTR = getattr(_native.core, "ModuleAttr", None) if _native.core is not None else None
_type_version = getattr(_native.core, "type_version", None) if _native.core is not None else None


def _hooked(d) -> bool:
    """False when ``Module.__call__`` of a module with instance dict ``d`` would only call forward."""
    return bool(d.get("_forward_hooks", True) or d.get("_forward_pre_hooks", True) or d.get("_backward_hooks", True)
                or d.get("_backward_pre_hooks", True) or d.get("_compiled_call_impl") is not None or "forward" in d
                or "_call_impl" in d
                or _module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks or _tracing() is not None)


def backward_hooked(modules) -> str | None:
    """Why a call reaching ``modules`` must run one instance at a time, as eager, or None.

    A module's full backward hooks (``register_full_backward_hook``, also the older
    ``register_backward_hook`` and the pre-hooks) see each instance's gradients through autograd
    nodes that ``Module.__call__`` puts around plain tensors: on lazy values torch warns that the
    output is not a Tensor and the hooks never ran (reliability #122). The global ones apply to
    every module called."""
    if _module._global_backward_hooks or _module._global_backward_pre_hooks:
        return "a global module backward hook (register_module_full_backward_hook) is registered"
    for m in modules:
        d = m.__dict__
        if d.get("_backward_hooks") or d.get("_backward_pre_hooks"):
            return f"a module it calls ({type(m).__name__}) has a backward hook"
    return None


def _own_call(cls, d, names, verdicts) -> bool:
    """True when calling a module of class ``cls`` (instance dict ``d``) is ``nn.Module``'s own call
    of its forward, which reads the registered parameters ``names``: no instance attribute
    shadowing a parameter, and :func:`_class_calls_own` for the class (hostile finds, stop 35).
    ``verdicts`` caches the class part per class, keyed by CPython's type version tag (renewed
    when the class or a base changes: ``nn.Module.__call__`` wrapped, a class attribute set)."""
    for n in names:
        if n in d:
            return False
    got = verdicts.get(cls)  # class_calls_own's cache, inlined (the hot path)
    if got is not None and _type_version is not None and got[0] == _type_version(cls):
        return got[1]
    return class_calls_own(cls, names, verdicts)


def class_calls_own(cls, names, verdicts) -> bool:
    """:func:`_class_calls_own`, cached in ``verdicts`` per class and type version tag."""
    if _type_version is None:
        return _class_calls_own(cls, names)
    got = verdicts.get(cls)
    version = _type_version(cls)
    if got is not None and got[0] == version and version:
        return got[1]
    ok = _class_calls_own(cls, names)
    after = _type_version(cls)  # the lookups above assign a tag if the class had none
    if after and (after == version or not version):
        if len(verdicts) >= MAX_CACHED_CLASSES:  # classes made in a loop must not pile up
            verdicts.clear()
        verdicts[cls] = (after, ok)
    return ok


def _class_calls_own(cls, names) -> bool:
    """No subclass ``_call_impl`` / ``_wrapped_call_impl``, no wrapper of ``nn.Module.__call__``
    installed after import (profilers, FLOP counters), no ``__getattr__`` / ``__getattribute__``
    of the subclass's, and no class attribute or property named like a parameter."""
    return not (cls._call_impl is not _CALL_IMPL or cls._wrapped_call_impl is not _WRAPPED_CALL_IMPL
                or nn.Module.__call__ is not _module_call or cls.__getattr__ is not _GETATTR
                or cls.__getattribute__ is not _GETATTRIBUTE or shadowed(cls, names))


_MRO_DICTS: dict = {}
#: the per-class caches hold their classes; past this many they start again
MAX_CACHED_CLASSES = 1024


def shadowed(cls, names) -> bool:
    """True when a class in ``cls``'s MRO defines one of ``names`` (other than the lookup
    descriptors of :mod:`~batchcraft.autobatching.attrs`). The MRO's namespaces are kept
    per class (mapping proxies: live views, so attributes set later are seen; a lookup through
    ``getattr(cls, name, default)`` costs an exception per missing name)."""
    mro = cls.__mro__
    got = _MRO_DICTS.get(cls)
    if got is None or got[0] is not mro:
        if len(_MRO_DICTS) >= MAX_CACHED_CLASSES:
            _MRO_DICTS.clear()
        got = _MRO_DICTS[cls] = (mro, tuple(_namespace(k) for k in mro))
    for ns in got[1]:
        for n in names:
            if n in ns and type(ns[n]) is not _MODULE_ATTR:
                # (batchcraft's own descriptor, attrs.py, does Module.__getattr__'s lookup)
                return True
    return False


def _namespace(cls):
    """The dict behind ``cls.__dict__`` (a live view either way; the dict's lookups cost a
    fraction of the mapping proxy's method calls)."""
    proxy = cls.__dict__
    inner = gc.get_referents(proxy)
    return inner[0] if len(inner) == 1 and type(inner[0]) is dict else proxy


def _record_on_top(rec, func, args, kwargs):
    """``rec.record(func, args, kwargs)`` as the recording mode's handler would run it (the mode
    off the stack), or :data:`NOT_ON_TOP` when a mode of the user's is innermost
    (:func:`~batchcraft.autobatching.mode.as_mode_handler`, inlined: this is the hot path)."""
    mode = rec.mode
    n = _tf_len()
    if mode is None or not n or _tf_at(n - 1) is not mode:
        return NOT_ON_TOP
    _tf_pop()
    try:
        return rec.record(func, args, kwargs)
    finally:
        _tf_push(mode)


def _plain_recording(self, args, names, verdicts):
    """The active recorder when ``self(*args)`` would record exactly as its forward would: the
    first argument is this call's lazy value (not a tracer's), and :func:`_hooked` /
    :func:`_own_call` find nothing that makes ``Module.__call__`` do more. Else None."""
    rec = _current()
    if rec is None or not args:
        return None
    x = args[0]
    d = self.__dict__
    if (type(x) is rec.lazy_type and x.rec is rec and not rec.is_tracer and not _hooked(d)
            and _own_call(type(self), d, names, verdicts)):
        return rec
    return None


def _linear_call(self, *args, **kwargs):
    if len(args) == 1 and not kwargs and type(self).forward is _LINEAR_FORWARD and F.linear is _F_LINEAR:
        rec = _plain_recording(self, args, _LINEAR_PARAMS, _LINEAR_OK)
        if rec is not None:
            params = self.__dict__.get("_parameters") or _NONE
            w, b = params.get("weight"), params.get("bias", _MISSING)
            if type(w) in _PLAIN and (b is None or type(b) in _PLAIN):
                out = _record_on_top(rec, F.linear, (args[0], w, b), {})
                if out is not NOT_ON_TOP:
                    return out
    return nn.Module.__call__(self, *args, **kwargs)  # looked up now: a wrapper installed later runs


def _embedding_call(self, *args, **kwargs):
    if (len(args) == 1 and not kwargs and type(self).forward is _EMBEDDING_FORWARD
            and F.embedding is _F_EMBEDDING):  # (a replaced F.embedding is what forward would call)
        rec = _plain_recording(self, args, _EMBEDDING_PARAMS, _EMBEDDING_OK)
        if rec is not None:
            w = (self.__dict__.get("_parameters") or _NONE).get("weight")
            if type(w) in _PLAIN:
                # read as forward reads them (weight first), passed as F.embedding hands them to
                # torch's dispatch, so the same signature
                kw = {"padding_idx": self.padding_idx, "max_norm": self.max_norm, "norm_type": self.norm_type,
                      "scale_grad_by_freq": self.scale_grad_by_freq, "sparse": self.sparse}
                if kw["max_norm"] is None:  # max_norm renorms the table in place: torch's path
                    out = _record_on_top(rec, F.embedding, (args[0], w), kw)
                    if out is not NOT_ON_TOP:
                        return out
    return nn.Module.__call__(self, *args, **kwargs)  # looked up now: a wrapper installed later runs


def _forward_call(cls):
    """``__call__`` of a cell class: its (patched, see cells.py) forward without the hook frames."""
    def __call__(self, *args, **kwargs):
        if _plain_recording(self, args, CELL_PARAMS, CELL_VERDICTS) is not None:
            return self.forward(*args, **kwargs)  # as _call_impl reads it (a staticmethod, a callable)
        return nn.Module.__call__(self, *args, **kwargs)

    __call__.__qualname__ = f"{cls.__name__}.__call__"
    return __call__


def torch_own(fn) -> bool:
    """True when ``fn`` is a function defined in torch's own package (not a wrapper of a
    profiler's or a library's installed before batchcraft was imported, which the fast paths
    would otherwise take for torch's and skip)."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_filename.startswith(TORCH_DIR)


_LINEAR_FORWARD = nn.Linear.forward
_EMBEDDING_FORWARD = nn.Embedding.forward
_CALL_IMPL, _WRAPPED_CALL_IMPL = nn.Module._call_impl, nn.Module._wrapped_call_impl
_F_LINEAR = TORCH_LINEAR  # what F.linear is unless replaced
_F_EMBEDDING = F.embedding
#: the module call machinery is torch's own: else no module call takes a fast path
_TORCH_CALLS = all(torch_own(f) for f in (_module_call, _CALL_IMPL, _WRAPPED_CALL_IMPL))
_GETATTR, _GETATTRIBUTE = nn.Module.__getattr__, object.__getattribute__
_DECLINED = object()


def plain_forward_call():
    """``call(module, x)``: ``module.forward(x)`` where ``module(x)`` would run only that (no hook,
    compiled call, instance-level forward or tracing: ``_core.plain_forward``, checked at each call),
    else ``module(x)``; None without the C core or where torch's module call is not its own.
    Saves ``Module.__call__``'s two Python frames (about 0.8 µs) per instance of a model."""
    plain = getattr(_native.core, "plain_forward", None) if _native.core is not None else None
    if plain is None or not _TORCH_CALLS:
        return None
    calls, ns = (_module_call, _CALL_IMPL), vars(_module)

    def call(module, x):
        out = plain(module, x, calls, ns, _tracing, _DECLINED)
        return module(x) if out is _DECLINED else out

    return call
_LINEAR_PARAMS = ("weight", "bias")
_EMBEDDING_PARAMS = ("weight",)  # its settings are read by plain attribute lookup, as forward does
#: the registered parameters a cell's forward reads, and the class verdicts for them (shared
#: with the cells' fast forward, cells.py)
CELL_PARAMS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
_LINEAR_OK: dict = {}
_EMBEDDING_OK: dict = {}
CELL_VERDICTS: dict = {}

_FAST_CALL = getattr(_native.core, "FastCall", None) if _native.core is not None else None


def _in_c(cls, kind, fallback, forward, func, names, verdicts, *cell):
    """``cls.__call__`` while a call records: the C core's ``__call__`` with
    :func:`_plain_recording`'s rules (``_core.FastCall``, about 1 µs less per call than the
    Python function, which stays its fallback for everything the C path declines: any recorder
    but the C core's, kwargs, a hook... and the Python core's path). None (no patch) when the
    class has a ``__call__`` of its own or torch's call machinery or ``forward`` is not torch's."""
    if "__call__" in vars(cls) or not _TORCH_CALLS or not torch_own(getattr(cls, "forward", None)):
        return None
    if _FAST_CALL is None:
        return fallback
    return _FAST_CALL(kind, fallback, forward, func, names, verdicts, class_calls_own, _module.__dict__, _tracing,
                      _PLAIN, vars(F), *cell)


def cell_call(cls, forward, gates, n_states: int):
    """``__call__`` of cell class ``cls`` while a call records, given its patched ``forward``
    (:data:`batchcraft.autobatching.cells.FAST_CELLS`): the C core's ``FastCall`` also runs that
    forward's common case itself (projection + ``gates`` recorded, ``n_states`` state tensors);
    else :func:`_forward_call`'s Python function. None (no patch) as :func:`_in_c`."""
    return _in_c(cls, 2, _forward_call(cls), forward, gates, CELL_PARAMS, CELL_VERDICTS, _F_LINEAR, n_states)


#: enter/exit around a recording call (the cells' ``__call__`` is patched with their forward, by
#: :data:`batchcraft.autobatching.cells.FAST_CELLS`, through :func:`cell_call`)
FAST_CALLS = PatchSet(
    [SharedPatch(nn.Linear, "__call__",
                 _in_c(nn.Linear, 0, _linear_call, _LINEAR_FORWARD, _F_LINEAR, _LINEAR_PARAMS, _LINEAR_OK)),
     SharedPatch(nn.Embedding, "__call__",
                 _in_c(nn.Embedding, 1, _embedding_call, _EMBEDDING_FORWARD, _F_EMBEDDING, _EMBEDDING_PARAMS,
                       _EMBEDDING_OK))])

__all__ = ["FAST_CALLS", "cell_call", "torch_own", "class_calls_own", "CELL_PARAMS", "CELL_VERDICTS"]
