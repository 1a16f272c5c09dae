"""Submodule, parameter and buffer reads without Python's ``__getattr__`` detour (``fast_attributes=True``, C core).

``nn.Module`` keeps submodules, parameters and buffers in dicts that ordinary attribute lookup does
not search, so every ``self.cell`` in instance code ends in ``nn.Module.__getattr__``. On Python
3.11 the way there is the expensive part: the interpreter's lookup first formats an
``AttributeError`` ("'TreeLSTM' object has no attribute 'cell'"), clears it, and only then calls
``__getattr__`` -- about 1 µs a read inside a recording call, two reads per TreeLSTM node.

While a call records, :func:`for_call` puts one :class:`ModuleAttr` descriptor (C core) on the
class of each module the function reaches, per name of its parameters, buffers and submodules
(only names the class and its bases do not define). The lookup then finds the name on the class
and the descriptor does ``nn.Module.__getattr__``'s own lookups, in its order, on the live dicts:
nothing is copied or cached, so ``functional_call``, ``del``, ``add_module`` and writes into
``_parameters`` during the call are seen exactly as in eager. A non-data descriptor, it comes after
the instance ``__dict__`` (as ``__getattr__`` does); on a miss, on the class itself, or on an
instance of a subclass with its own ``__getattr__``, it raises a bare ``AttributeError`` and the
type's ``__getattr__`` runs as it would without it (same result, same error message). A class
whose subclasses (or that itself) would find the name further along their MRO (a mixin listed
after it: ``class Model(Base, Defaults)``) gets no descriptor, nor does ``nn.Module`` itself or a
class with more than :data:`MAX_SUBCLASSES` subclasses; a subclass created during the call is
checked at its first lookup (a hostile helper's finds, reliability #63).

Each class attribute costs about 1 µs to set and to remove (a leaf class has few subclasses whose
caches Python invalidates). Earlier versions set ``nn.Module.__getattr__`` itself to a C function
(about 160 µs a call: Python updates the slots of every ``nn.Module`` subclass in the process, 353
here, on set and on restore, and it saved nothing on 3.11's formatted error) and, before that,
copied entries into each module's ``__dict__`` (wrong under ``functional_call``, ``del``,
``add_module`` and ``torch.save`` during the call, found by a helper's hostile tests).

Nested and concurrent calls share installations (a count per class and name); the last call to
leave removes the descriptor, unless someone replaced it meanwhile.
"""

from __future__ import annotations

import sys
import threading
import weakref

from torch import nn

from batchcraft.autobatching import _native
from batchcraft.autobatching.modstate import roots

#: ``nn.Module``'s own ``__getattr__``: classes (and instances' types) with another one keep theirs
MODULE_GETATTR = nn.Module.__dict__["__getattr__"]

_OBJECT_GETATTRIBUTE = object.__getattribute__

#: at most this many modules are walked per call to find classes and names (a larger model's
#: further modules read their attributes the ordinary way)
MAX_MODULES = 512

_lock = threading.Lock()
_installed: dict = {}  # (class, name) -> [holders, descriptor]


#: classes with more subclasses than this (in the process) get no descriptors: checking them all
#: would cost more than the reads save
MAX_SUBCLASSES = 64


def _defined_on(cls, name: str) -> bool:
    return any(name in vars(k) for k in cls.__mro__)


def _subclasses(cls) -> list | None:
    """``cls`` and its subclasses (recursively), or None when there are too many."""
    out, todo, seen = [cls], [cls], {cls}
    while todo:
        for sub in type.__subclasses__(todo.pop()):
            if sub not in seen:
                seen.add(sub)
                out.append(sub)
                todo.append(sub)
                if len(out) > MAX_SUBCLASSES:
                    return None
    return out


def _after(cls, subs: list) -> list:
    """The classes that come after ``cls`` in the MRO of any of ``subs`` (each once)."""
    later: dict = {}
    for sub in subs:
        mro = sub.__mro__
        for k in mro[mro.index(cls) + 1:]:
            later[k] = None
    return list(later)


def _verified(cls, name: str, subs: list | None, later: list | None) -> set | None:
    """The types that reach a descriptor on ``cls`` and define ``name`` nowhere after ``cls`` in
    their MRO (a mixin listed after it would win in eager), or None when one does (then no
    descriptor: the types are checked again at lookup, see ``ModuleAttr``, but a data descriptor
    further along would lose to the instance ``__dict__``). ``subs``: :func:`_subclasses` of ``cls``;
    ``later``: :func:`_after` of them."""
    if subs is None:
        return None
    for k in later:
        if name in k.__dict__:
            return None
    return set(subs)


class PlanCache:
    """What one auto-batched function reached at its last call: its roots, the modules walked
    below them, their :func:`tree_token <batchcraft.autobatching._core>` and the pairs of
    :func:`plan`. A call whose roots are the same objects and whose token is equal reuses them
    without the walk (about 14 µs a call for the TreeLSTM, more with cold caches after the
    previous call's kernels). Without the C core every call walks.

    Roots and modules are held by weak references: a model or submodule the caller drops
    between calls is freed as in eager (a hostile helper's find, stop 51); one that died makes
    the next call walk again."""

    __slots__ = ("roots", "modules", "token", "pairs")

    def __init__(self):
        self.roots, self.modules, self.token, self.pairs = (), (), None, None

    def refresh(self, fn) -> list:
        """The modules ``fn`` reaches now (:func:`_walk` of :func:`modstate.roots`), walked again
        only where the roots or the token changed (then :attr:`pairs` is recomputed on demand)."""
        rs = roots(fn)
        core = _native.core
        if self.token is not None and len(rs) == len(self.roots) and all(a is r() for a, r in zip(rs, self.roots)):
            modules = [r() for r in self.modules]
            if None not in modules and core.tree_token(modules, MODULE_GETATTR) == self.token:
                return modules
        modules = _walk(rs)
        self.pairs = None
        self.token = core.tree_token(modules, MODULE_GETATTR) if core is not None else None
        try:
            self.roots, self.modules = tuple(map(weakref.ref, rs)), tuple(map(weakref.ref, modules))
        except TypeError:  # (a module class without weak references: nothing kept)
            self.roots, self.modules, self.token = (), (), None
        return modules

    def pairs_of(self, modules) -> list:
        """:func:`plan`'s pairs for ``modules``, what :meth:`refresh` returned this call."""
        if self.pairs is None:
            self.pairs = _pairs(modules)
        return self.pairs


def _walk(rs) -> list:
    """The modules below ``rs`` (each once, ``Module.modules()`` order), at most :data:`MAX_MODULES`."""
    out, seen = [], set()
    for root in rs:
        for m in root.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            if len(out) == MAX_MODULES:
                return out
            out.append(m)
    return out


def _compiled(m) -> bool:
    """``m.compile()`` was called, or ``m`` is what ``torch.compile(module)`` returns."""
    if m.__dict__.get("_compiled_call_impl") is not None:
        return True
    ev = sys.modules.get("torch._dynamo.eval_frame")  # (not imported: no compiled module exists)
    opt = getattr(ev, "OptimizedModule", None) if ev is not None else None
    return opt is not None and isinstance(m, opt)


def _pairs(modules) -> list:
    """The pairs of ``modules`` (see :func:`plan`); none at all where one of them is compiled:
    dynamo reads class attributes itself and cannot call the descriptors (``'ModuleAttr' object is
    not callable`` under ``model.compile()``, found by a hostile helper at stop 50)."""
    if any(_compiled(m) for m in modules):
        return []
    pairs, seen_pairs, ok_cls = [], set(), {}
    for m in modules:
        cls = type(m)
        ok = ok_cls.get(cls)
        if ok is None:  # (never nn.Module itself: every module class would reach it)
            # (a class's own __getattribute__ may catch the AttributeError that eager's lookup
            # raises before __getattr__: the descriptor would answer it; hostile helper, stop 51)
            ok = ok_cls[cls] = (cls is not nn.Module and getattr(cls, "__getattr__", None) is MODULE_GETATTR
                                and getattr(cls, "__getattribute__", None) is _OBJECT_GETATTRIBUTE)
        if not ok:
            continue
        d = m.__dict__
        for table in (d.get("_parameters"), d.get("_buffers"), d.get("_modules")):
            if type(table) is not dict:
                continue
            for name in table:
                key = (cls, name)
                if (key not in seen_pairs and type(name) is str and name.isidentifier()
                        and not name.startswith("__")):
                    seen_pairs.add(key)
                    pairs.append(key)
    return pairs


def plan(fn, cache: PlanCache | None = None) -> list:
    """``[(class, name), ...]``: the module classes ``fn`` reaches (:func:`modstate.roots`) with
    ``nn.Module.__getattr__`` as their ``__getattr__``, and the names of their instances'
    parameters, buffers and submodules (:class:`ClassAttrs` leaves out, when it installs, the names
    a class or its bases define). With ``cache`` (the function's :class:`PlanCache`), the last
    answer is reused while the roots and the walked modules' token are unchanged."""
    if cache is None:
        return _pairs(_walk(roots(fn)))
    return cache.pairs_of(cache.refresh(fn))


class ClassAttrs:
    """Context manager: the :class:`ModuleAttr` descriptors of ``pairs`` on their classes."""

    __slots__ = ("pairs", "entered")

    def __init__(self, pairs):
        self.pairs = pairs
        self.entered: list = []

    def __enter__(self) -> "ClassAttrs":
        try:
            self._install()
        except BaseException:  # (an error while walking a class: nothing of this call stays)
            self.__exit__()
            raise
        return self

    def _install(self) -> None:
        make = _native.core.ModuleAttr
        subclasses: dict = {}  # one walk per class, not per name: (subclasses, classes after it)
        with _lock:
            for key in self.pairs:
                e = _installed.get(key)
                if e is None:
                    cls, name = key
                    if _defined_on(cls, name):  # the class's own (or defined since): theirs stays
                        continue
                    walk = subclasses.get(cls)
                    if walk is None:
                        subs = _subclasses(cls)
                        walk = subclasses[cls] = (subs, _after(cls, subs) if subs is not None else None)
                    verified = _verified(cls, name, walk[0], walk[1])
                    if verified is None:
                        continue
                    d = make(name, MODULE_GETATTR, cls, verified)
                    try:
                        setattr(cls, name, d)
                    except Exception:  # a class (or metaclass) that refuses the attribute: reads stay eager's
                        continue
                    e = _installed[key] = [0, d]
                e[0] += 1
                self.entered.append(key)

    def __exit__(self, *exc) -> bool:
        with _lock:
            for key in self.entered:
                e = _installed[key]
                e[0] -= 1
                if e[0] == 0:
                    del _installed[key]
                    cls, name = key
                    if vars(cls).get(name) is e[1]:
                        try:
                            delattr(cls, name)
                        except Exception:  # a metaclass refusing it: ours goes all the same (hostile, stop 51)
                            type.__delattr__(cls, name)
            self.entered = []
        return False


def for_call(fn, cache: PlanCache | None = None, modules: list | None = None) -> ClassAttrs | None:
    """The descriptors for one call of ``fn``; None without the C core. ``cache``: see :func:`plan`;
    ``modules``: what ``cache.refresh(fn)`` returned for this call (not walked or checked again)."""
    if _native.core is None:
        return None
    return ClassAttrs(cache.pairs_of(modules) if modules is not None else plan(fn, cache))


__all__ = ["for_call", "plan", "PlanCache", "ClassAttrs", "MODULE_GETATTR", "MAX_MODULES", "MAX_SUBCLASSES"]
