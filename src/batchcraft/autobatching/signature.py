"""Signatures: what makes two recorded operations batchable together.

A signature is ``(op, argument structure, leaf descriptors, grad mode, thread state)``:

* the operation (a torch function, a Tensor method, or a static block);
* the structure of its arguments, with every non-tensor argument **by type and value**
  (``add(x, 1)`` and ``add(x, 2)`` never share a signature; DyNet #555), floats by bit
  pattern (-0.0 is not 0.0, NaN equals NaN), slices, lists and dicts spelled out;
* for each per-instance (lazy) tensor its descriptor id (shape, dtype, device: keyed on
  inputs, not outputs; DyNet #622), and for each shared tensor (parameters, tensors captured
  from outside the instance) its identity, shape, dtype and ``requires_grad``, so that it is
  passed once to the batched call and never gathered (ACRoBat §4.3, parameter reuse);
* a list argument of a ragged-safe static block is keyed as *empty* or *non-empty* (with
  its members' common descriptor), not by its length, so nodes with any number of children
  run as one group (:mod:`ragged`).

:class:`SignatureCache` owns every cache keyed by signatures; each distinct signature gets a
:class:`SigInfo` with a small interned id. Source: DyNet auto-batching (Neubig et al. 2017,
§3.1, "signatures"); ACRoBat (Fegade et al. 2024, §4).
"""

from __future__ import annotations

import threading

import torch

from batchcraft.autobatching.descs import DESCS, desc_id

LEAF = "\x00leaf"  # marks a tensor position in a structure; the tensor is in the leaf list
RAGGED = "\x00ragged"  # a ragged list argument: (RAGGED, nonempty, member did)

SCALAR_TYPES = frozenset({int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype,
                          torch.device, torch.layout, torch.memory_format})
_Tensor = torch.Tensor
_Size = torch.Size


class Opaque:
    """An argument of unknown type, compared by identity (kept alive by the signature)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return type(other) is Opaque and other.obj is self.obj

    def __repr__(self):
        return f"Opaque({type(self.obj).__name__})"


def flatten(obj, leaves: list, lazy_type):
    """A hashable structure for ``obj``; its tensors (lazy or real) are appended to ``leaves``."""
    t = type(obj)
    if t is lazy_type:
        leaves.append(obj)
        return LEAF
    if t is tuple or t is list:
        return (t, tuple([flatten(o, leaves, lazy_type) for o in obj]))
    if t is float:  # by bit pattern: -0.0 differs from 0.0, and nan equals nan
        return (float, obj.hex())
    if t in SCALAR_TYPES:
        return (t, obj)
    if t is slice:
        return (slice, flatten(obj.start, leaves, lazy_type), flatten(obj.stop, leaves, lazy_type),
                flatten(obj.step, leaves, lazy_type))
    if isinstance(obj, _Tensor):
        leaves.append(obj)
        return LEAF
    if t is _Size:
        return (tuple, tuple([(int, d) for d in obj]))
    if t is dict:
        return (dict, tuple(obj.keys()), tuple([flatten(v, leaves, lazy_type) for v in obj.values()]))
    if isinstance(obj, list):  # a list subclass (e.g. a block's traced list): as a list
        return (list, tuple([flatten(o, leaves, lazy_type) for o in list.__iter__(obj)]))
    if isinstance(obj, tuple):  # namedtuple, torch.return_types (structseq)
        return (t, tuple([flatten(o, leaves, lazy_type) for o in obj]))
    return (Opaque, Opaque(obj))


def rebuild(struct, it):
    """Inverse of :func:`flatten`: rebuild the structure taking tensors from iterator ``it``."""
    if struct is LEAF:
        return next(it)
    tag = struct[0]
    if tag is tuple:
        return tuple([rebuild(s, it) for s in struct[1]])
    if tag is list:
        return [rebuild(s, it) for s in struct[1]]
    if tag is slice:
        return slice(rebuild(struct[1], it), rebuild(struct[2], it), rebuild(struct[3], it))
    if tag is dict:
        return {k: rebuild(s, it) for k, s in zip(struct[1], struct[2])}
    if tag is Opaque:
        return struct[1].obj
    if tag is float:
        return float.fromhex(struct[1])
    if isinstance(tag, type) and issubclass(tag, tuple):
        items = [rebuild(s, it) for s in struct[1]]
        return tag(*items) if hasattr(tag, "_fields") else tag(items)  # namedtuple / structseq
    return struct[1]


def call_with(func, struct, leaves):
    """``func(*args, **kwargs)`` with the arguments rebuilt from ``struct`` and ``leaves``."""
    it = iter(leaves)
    args = rebuild(struct[0], it)
    kwargs = rebuild(struct[1], it) if struct[1] is not None else {}
    return func(*args, **kwargs)


def shared_descriptor(t: torch.Tensor, made_views=None) -> tuple:
    """Key part of a shared tensor: identity plus what may change under the same identity.

    A view of a shared tensor that instance code makes during the call (``W.t()``,
    ``x0.unsqueeze(0)`` inside ``nn.GRUCell``; ``made_views``: id -> tensor, kept alive by the
    recorder) is a new object at every call of the instance code, but views of one base at the
    same address with the same sizes, strides and conj/neg bits read the same memory: they key
    alike, so the calls batch (keyed by identity, each instance's call was a signature of its
    own and ran alone). The address, not the offset: ``W.data = ...`` gives the base new
    storage under the same id, and the signature's stored view, which keeps the old storage
    alive, must not be used for it. Views made *outside* the call keep their identity: the
    caller may differentiate with respect to that very object, or hook it.
    """
    if made_views is not None and made_views.get(id(t)) is t and t.layout == torch.strided:
        base = t._base
        if base is not None:
            return ("shared_view", id(base), t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device,
                    t.requires_grad, t.is_conj(), t.is_neg())
        # an alias without a base (``w.detach()``): by the storage it reads, which the signature's
        # stored alias keeps alive (so the address cannot come back for other memory)
        return ("shared_alias", t.untyped_storage().data_ptr(), t.data_ptr(), tuple(t.shape), t.stride(),
                t.dtype, t.device, t.requires_grad, t.is_conj(), t.is_neg())
    return ("shared", id(t), tuple(t.shape), t.dtype, t.device, t.requires_grad)


def holds_these_shared(info, leaves) -> bool:
    """Whether ``info`` stores the very shared tensors of ``leaves`` (not equivalent views).

    The fast paths key shared tensors by identity; an entry for a view that ``info`` does not
    hold could outlive the view and match an unrelated tensor at the same address later.
    """
    return all(s is None or s is x for s, x in zip(info.shared, leaves))


class SigInfo:
    """What is known about one signature.

    Attributes:
        sid (int): interned id, cheap to hash (buckets are keyed by it).
        key (tuple): the full signature.
        func: the operation or static block.
        struct: argument structure (ragged lists as ``(RAGGED, nonempty, did)``).
        leaf_kinds (tuple[bool]): per leaf of ``struct``: per-instance (True) or shared.
        shared (tuple): the shared tensors, in leaf order (``None`` at per-instance positions).
        in_dids (tuple[int]): descriptor ids of the per-instance leaves (single ones).
        ragged (tuple[int]): for each ragged list argument, its member descriptor id.
        lens_classes (tuple[int]): per ragged list argument, its length class (equal lengths).
        grad (bool): grad mode when recorded; ``state``: other thread state (autocast) or None.
        out_struct, out_dids: structure and descriptor ids of the outputs.
        out_rg (tuple[bool]): per output: requires grad when no per-instance input does
            (``rg_mask`` as bits); ``rg_dep[j]``: the outputs that require grad when input ``j``
            does. Blocks key their inputs' flags instead (``rg_dep`` empty).
        view (bool): the output is a view of the first argument (``views.py``).
        shared_rg (bool): a shared leaf, or the block body, uses tensors requiring grad.
        program: the :class:`~batchcraft.autobatching.program.Program` executed for a group.
    """

    __slots__ = ("sid", "key", "func", "struct", "leaf_kinds", "shared", "in_dids", "ragged", "grad",
                 "state", "out_struct", "out_dids", "single", "flat_tuple", "shared_rg", "program",
                 "n_out", "name", "stats_key", "validated", "out_rg", "rg_mask", "view", "lens_classes", "rg_dep",
                 "dep_any",
                 "__weakref__")

    def __init__(self, sid, key, func, struct, leaves, lazy_type, grad, state, out_struct, out_dids,
                 out_rg=None, program=None, ragged=(), lens_classes=()):
        self.sid = sid
        self.key = key
        self.func = func
        self.struct = struct
        kinds, shared, in_dids = [], [], []
        shared_rg = False
        for x in leaves:
            if type(x) is lazy_type:
                kinds.append(True)
                shared.append(None)
                in_dids.append(x.did)
            else:
                kinds.append(False)
                shared.append(x)
                shared_rg = shared_rg or bool(x.requires_grad)
        self.leaf_kinds = tuple(kinds)
        self.shared = tuple(shared)
        self.in_dids = tuple(in_dids)
        self.ragged = tuple(ragged)
        self.grad = grad
        self.state = state
        self.out_struct = out_struct
        self.out_dids = tuple(out_dids)
        self.n_out = len(self.out_dids)
        self.single = out_struct is LEAF
        self.flat_tuple = (type(out_struct) is tuple and out_struct[0] is tuple
                           and all(s is LEAF for s in out_struct[1]))
        self.program = program
        self.shared_rg = shared_rg or (program is not None and program.uses_grad_consts)
        self.name = getattr(func, "__name__", type(func).__name__)
        self.stats_key = None
        self.validated = True
        self.out_rg = tuple(out_rg) if out_rg is not None else (False,) * self.n_out
        self.rg_mask = sum(1 << s for s, r in enumerate(self.out_rg) if r)
        self.rg_dep = ()      # per per-instance input: outputs that require grad when it does
        self.dep_any = False
        self.lens_classes = tuple(lens_classes)
        from batchcraft.autobatching.views import is_view_call

        self.view = bool(kinds) and kinds[0] and not ragged and is_view_call(func, struct, leaves)

    @property
    def out_descs(self) -> tuple:
        return tuple(DESCS[d] for d in self.out_dids)

    def __repr__(self) -> str:
        return f"SigInfo(sid={self.sid}, {self.name}, in={self.in_dids}, out={self.out_dids})"


def _storage_address(t) -> tuple:
    try:
        return ("storage", t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (sparse, meta): identity only
        return ("object", id(t))


def _read_tensors(info):
    """The shared tensors one signature reads: its shared arguments and, for a static block,
    its program's constants (nested programs included)."""
    for x in info.shared:
        if isinstance(x, torch.Tensor):
            yield x
    todo = [info.program] if info.program is not None else []
    while todo:
        prog = todo.pop()
        for st in prog.steps:
            for r in st.refs:
                if r[0] == "const" and isinstance(r[1], torch.Tensor):
                    yield r[1]
            if st.info is not None and st.info.program is not None:
                todo.append(st.info.program)


class SignatureCache:
    """Every cache keyed by signatures, owned by one object (one per process).

    * ``by_key``: full signature -> :class:`SigInfo` (output inference is done once per key);
    * ``fast``: the recorder's cheap key (op, interned argument spelling, grad mode) -> SigInfo;
    * ``by_sid``: interned id -> SigInfo (the C core stores only ids);
    * ``values_needed``: full signature -> the ``NeedsValues`` its output inference raised (the
      operation runs on values: its next calls skip the inference, whose failure inside torch
      costs about 0.1 ms).

    Keys hold ids of shared tensors; a SigInfo keeps those tensors alive, so an id cannot be
    reused while its entry exists. The cache is cleared when it grows past ``max_entries``
    (a stale entry only costs a new inference).

    A call under a ``torch.func`` transform records in a namespace of its own (:meth:`isolated`):
    eager's results differ there in what a signature records (under ``jvp``, ``lin(x)`` does not
    require grad), so its signatures must neither be reused outside it, by this thread later or
    by another thread meanwhile, nor come from outside it (reliability #190, #195).
    """

    def __init__(self, max_entries: int = 200_000):
        self.by_key: dict = {}
        self.fast: dict = {}
        self.by_sid: list = [None]
        self.values_needed: dict = {}
        self.max_entries = max_entries
        self.generation = 0
        self._listeners: list = []
        self._lock = threading.RLock()
        self._reads: set = set()  # see may_be_read
        self._indexed = 0
        self._local = threading.local()  # .space: this thread's isolated namespace (a list of its keys)

    def _spaced(self, key):
        space = getattr(self._local, "space", None)
        return key if space is None else (space.token, key)

    def get(self, key):
        return self.by_key.get(self._spaced(key))

    def add(self, key, make) -> SigInfo:
        """Register a new signature: ``make(sid)`` builds its SigInfo."""
        k = self._spaced(key)
        with self._lock:  # two threads must never draw the same sid
            info = self.by_key.get(k)
            if info is not None:
                return info
            if len(self.by_key) >= self.max_entries:
                self.clear()
            info = make(len(self.by_sid))
            self.by_sid.append(info)
            self.by_key[k] = info
            if k is not key:
                self._local.space.keys.append(k)
            return info

    def needs_values(self, key):
        """The ``NeedsValues`` that output inference of full signature ``key`` raised (None: not
        known, or this thread records in an isolated namespace)."""
        if getattr(self._local, "space", None) is not None:
            return None
        got = self.values_needed.get(key)
        return got[0] if got is not None else None

    def note_needs_values(self, key, nv, keep) -> None:
        """Remember that ``key``'s outputs need values (``keep``: the shared tensors whose ids the
        key holds, kept alive with it)."""
        if getattr(self._local, "space", None) is not None:
            return
        cause = getattr(nv, "cause", None)
        if isinstance(cause, BaseException):
            cause.__traceback__ = None  # (its frames: not kept alive by the cache)
        with self._lock:
            if len(self.values_needed) >= self.max_entries:
                self.values_needed.clear()
            self.values_needed[key] = (nv, keep)

    def fast_get(self, key):
        """The recorder's cheap-key entry (``fast``), in this thread's namespace."""
        return self.fast.get(self._spaced(key))

    def fast_put(self, key, info) -> None:
        k = self._spaced(key)
        self.fast[k] = info
        if k is not key:
            self._local.space.keys.append(k)

    def isolated(self) -> "_Isolated":
        """Context manager: this thread's signatures in a namespace of their own, dropped on exit
        (nested: the outer namespace is kept)."""
        return _Isolated(self)

    def may_be_read(self, t: torch.Tensor) -> bool:
        """Whether some signature reads ``t``'s memory: one of its shared tensors, or a constant of
        its static block's program, is ``t`` or lives in ``t``'s storage (False: no recorded
        operation can read it). Indexed incrementally, by storage address and identity."""
        with self._lock:
            index = self._reads
            for info in self.by_sid[self._indexed:]:
                if info is None:
                    continue
                for x in _read_tensors(info):
                    index.add(id(x))
                    index.add(_storage_address(x))
            self._indexed = len(self.by_sid)
            return id(t) in index or _storage_address(t) in index

    def on_clear(self, fn) -> None:
        """Call ``fn()`` whenever the cache is cleared (the C core drops its mirror)."""
        self._listeners.append(fn)

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self.by_key.clear()
        self.fast.clear()
        self.values_needed.clear()
        self._reads = set()
        self._indexed = 0
        self.generation += 1
        for fn in self._listeners:
            fn()

    def drop_func(self, func) -> None:
        """Forget every signature of ``func`` (a static block whose module changed)."""
        with self._lock:
            for k in [k for k, v in self.by_key.items() if v.func is func]:
                del self.by_key[k]
            for k in [k for k, v in list(self.fast.items()) if v.func is func]:
                self.fast.pop(k, None)
        for fn in self._listeners:
            fn()


class _Space:
    __slots__ = ("token", "keys")

    def __init__(self):
        self.token = object()  # (compares by identity: no other namespace's key can equal it)
        self.keys: list = []


class _Isolated:
    __slots__ = ("cache", "outer")

    def __init__(self, cache: SignatureCache):
        self.cache = cache

    def __enter__(self):
        local = self.cache._local
        self.outer = getattr(local, "space", None)
        if self.outer is None:
            local.space = _Space()
        return self

    def __exit__(self, *exc) -> bool:
        if self.outer is None:
            local = self.cache._local
            space, local.space = local.space, None
            with self.cache._lock:
                for k in space.keys:
                    self.cache.by_key.pop(k, None)
                    self.cache.fast.pop(k, None)
        return False


SIGNATURES = SignatureCache()


def intern_desc(t) -> int:
    """Descriptor id of a concrete tensor."""
    return desc_id((tuple(t.shape), t.dtype, t.device))
