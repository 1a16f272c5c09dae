"""Batching rules: run one operation for ``n`` instances at once.

A rule function receives the operation, its argument structure, the argument tensors
(per-instance ones already gathered into one tensor with a leading batch dimension of size
``n``; shared ones as they are), which of them are batched, and each one's per-instance shape.
It returns the batched result, whose every output has shape ``(n, *per-instance shape)``.

Each registered operation has a :class:`Rule`: the function above plus, for the hot
operations, a *lowering* that writes the batched call as one Python expression with the
dimension arguments already shifted (:mod:`lower` compiles a whole program from these), and
the operation's ragged form (:mod:`ragged`). Hand-written rules cover elementwise maths,
linear algebra on a shared weight, embeddings, normalisation, reductions and shape operations
with a dimension argument, indexing and RNN cells; everything else goes through
``torch.func.vmap`` (the general rule). The executor checks each step's result and runs a step
one instance at a time when its rule fails (counted in ``RunStats.fallbacks``, with the reason).

Source: DyNet auto-batching (Neubig et al. 2017) for the per-op batched kernels;
``torch.func.vmap`` (functorch) for the general rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchcraft.autobatching import rowmm as _rowmm
from batchcraft.autobatching.descs import is_int_scalar
from batchcraft.autobatching.signature import LEAF, call_with, rebuild
from batchcraft.autobatching.kernels import TORCH_LINEAR as _LINEAR

_call = call_with


def _args(struct, leaves):
    it = iter(leaves)
    args = rebuild(struct[0], it)
    kwargs = rebuild(struct[1], it) if struct[1] is not None else {}
    return list(args), kwargs


def rule_vmap(func, struct, leaves, mask, shapes, n):
    """General rule: ``torch.func.vmap`` over the batched arguments (dim 0), shared ones unbatched."""
    in_dims = tuple(0 if m else None for m in mask)

    def per_instance(*ls):
        return _call(func, struct, ls)

    return torch.func.vmap(per_instance, in_dims=in_dims, randomness="different")(*leaves)


def rule_direct(func, struct, leaves, mask, shapes, n):
    """Operations that act row-wise on a leading batch dimension as they are."""
    return _call(func, struct, leaves)


def rule_elementwise(func, struct, leaves, mask, shapes, n):
    """Broadcasting maths: give each batched argument the output's rank before its own dims."""
    rank = 0
    for s in shapes:
        if len(s) > rank:
            rank = len(s)
    new = []
    for x, m, s in zip(leaves, mask, shapes):
        if m and len(s) < rank:
            x = x.reshape((n,) + (1,) * (rank - len(s)) + tuple(s))
        new.append(x)
    return _call(func, struct, new)


def _shared_weights(mask, first=1):
    return not any(mask[first:])


def rule_weight(func, struct, leaves, mask, shapes, n):
    """linear / embedding / layer_norm: batched input, shared weights: a direct call works."""
    if mask[0] and _shared_weights(mask):
        return _call(func, struct, leaves)
    if func is F.embedding or func is torch.embedding:
        _check_embedding_ids(func, leaves, mask, shapes)
    return rule_vmap(func, struct, leaves, mask, shapes, n)


def _check_embedding_ids(func, leaves, mask, shapes) -> None:
    """Per-instance tables: vmap's embedding looks ids up in the instances' tables laid end to
    end, so an id past one instance's table read another's row (silently; a hostile find, stop
    49). Out-of-range ids raise eager's error here: the group then runs per instance and names it."""
    i, w = (0, 1) if func is F.embedding else (1, 0)
    if len(leaves) <= max(i, w) or not mask[w] or not isinstance(leaves[i], torch.Tensor):
        return
    ids, rows = leaves[i], shapes[w][0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError("index out of range in self")


def rule_rnn_cell(func, struct, leaves, mask, shapes, n):
    """lstm_cell / gru_cell / rnn_*_cell: per-instance (k, features) inputs -> (n*k, features)."""
    ks = {s[0] for s, m in zip(shapes, mask) if m}
    if len(ks) != 1 or any(len(s) != 2 for s, m in zip(shapes, mask) if m):
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    k = ks.pop()
    # input and state come first (lstm: input, h, c); a shared one (a state or input made outside
    # the instance, the same for all) is repeated per instance: ATen's cells do not broadcast
    n_data = 3 if func is torch.lstm_cell else 2
    flat = []
    for j, (x, m, s) in enumerate(zip(leaves, mask, shapes)):
        if m:
            x = x.reshape(n * k, s[1])
        elif j < n_data and isinstance(x, torch.Tensor):
            if x.dim() != 2 or x.shape[0] != k:
                return rule_vmap(func, struct, leaves, mask, shapes, n)
            x = x.repeat(n, 1)
        flat.append(x)
    out = _call(func, struct, flat)
    if isinstance(out, tuple):
        return tuple(o.reshape(n, k, *o.shape[1:]) for o in out)
    return out.reshape(n, k, *out.shape[1:])


def rule_matmul(func, struct, leaves, mask, shapes, n):
    """matmul / mm / @ with at most one shared 2-D operand; other cases use vmap."""
    if len(leaves) != 2:
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    (a, b), (ma, mb), (sa, sb) = leaves, mask, shapes
    reflected = getattr(func, "__name__", "") == "__rmatmul__"
    if reflected:  # b @ a, with a the lazy self
        a, b, ma, mb, sa, sb = b, a, mb, ma, sb, sa
    if ma and not mb and len(sb) == 2 and len(sa) >= 1:
        return torch.matmul(a, b)
    if ma and mb and len(sa) >= 2 and len(sb) >= 2:
        # align ranks after the batch dim (matmul broadcasts batch dims from the right: (n, 2, 4, 5)
        # @ (n, 5, 3) would pair b's instances with a's dim of size 2; hostile helper, stop 32)
        if len(sa) < len(sb):
            a = a.reshape((n,) + (1,) * (len(sb) - len(sa)) + tuple(sa))
        elif len(sb) < len(sa):
            b = b.reshape((n,) + (1,) * (len(sa) - len(sb)) + tuple(sb))
        return torch.matmul(a, b)
    if mb and not ma and len(sa) == 2 and len(sb) >= 2:
        return torch.matmul(a, b)
    if mb and not ma and len(sa) == 2 and len(sb) == 1:
        return torch.matmul(b, a.transpose(0, 1))
    return rule_vmap(func, struct, leaves, mask, shapes, n)


def _shift(d, rank):
    """Per-instance dim -> batched dim (negative dims count from the end and stay)."""
    return d + 1 if d >= 0 else d


def _find_dim(args, kwargs, pos: int, name: str, default):
    """The dim argument of a call and where it was given: ``(value, "kw" | "pos")``."""
    if name in kwargs:
        return kwargs[name], "kw"
    if len(args) > pos:
        return args[pos], "pos"
    return default, "kw"


def make_dim_rule(pos: int, name: str = "dim", default=None, full=None):
    """Rule for ops with a dimension argument at ``pos`` / keyword ``name``.

    ``default``: the op's default dim when not given (None: no default). ``full``: how to spell
    a reduction over all per-instance dims ("tuple" for sum-like ops; None: use vmap).
    """

    def rule(func, struct, leaves, mask, shapes, n):
        if not mask[0] or any(mask[1:]) and func not in _BATCHED_OTHER_OK:
            return rule_vmap(func, struct, leaves, mask, shapes, n)
        rank = len(shapes[0])
        args, kwargs = _args(struct, leaves)
        d, where = _find_dim(args, kwargs, pos, name, default)
        if d is None and full == "flat":
            if not _flat_ok(args, kwargs, pos):
                return rule_vmap(func, struct, leaves, mask, shapes, n)
            out = func(args[0].reshape(n, -1), 1)
            return out.reshape((n,) + (1,) * rank) if _keepdim(args, kwargs, pos) else out
        if d is None:
            if full != "tuple":
                return rule_vmap(func, struct, leaves, mask, shapes, n)
            nd = tuple(range(1, rank + 1))
            if rank == 0:
                return args[0]
        elif isinstance(d, int):
            nd = _shift(d, rank)
        elif isinstance(d, (tuple, list)) and all(isinstance(i, int) for i in d):
            nd = tuple(_shift(i, rank) for i in d)
        else:
            return rule_vmap(func, struct, leaves, mask, shapes, n)
        if where == "pos":
            args[pos] = nd
        else:
            kwargs[name] = nd
        return func(*args, **kwargs)

    return rule


_BATCHED_OTHER_OK: set = set()


def _flat_ok(args, kwargs, pos: int) -> bool:
    """``argmax(x)`` / ``argmin(x)`` over all elements: per instance the index into the flattened
    tensor, so the batched call is the same op over ``x.reshape(n, -1)`` along dim 1 (ties resolve
    to the first index in both); ``keepdim=True`` reshapes that to ``(n, 1, ..., 1)``."""
    return type(_keepdim(args, kwargs, pos)) is bool and set(kwargs) <= {"dim", "keepdim"} and len(args) <= pos + 2


def _keepdim(args, kwargs, pos: int):
    return kwargs.get("keepdim", args[pos + 1] if len(args) > pos + 1 else False)


def rule_seq_dim(func, struct, leaves, mask, shapes, n):
    """cat / stack over a list of tensors: shift dim; expand shared members to the batch."""
    args, kwargs = _args(struct, leaves)
    seq = args[0]
    if not isinstance(seq, (list, tuple)):
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    # which members are batched: leaves are the members in order (plus nothing else)
    members = list(seq)
    if len(members) != len(mask):
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    rank = len(shapes[0]) if func is not torch.stack else len(shapes[0])
    members = [m if b else m.expand(n, *m.shape) for m, b in zip(members, mask)]
    d = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if not isinstance(d, int):
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    if func is torch.stack or getattr(func, "__name__", "") == "stack":
        nd = d + 1 if d >= 0 else d
    else:
        nd = _shift(d, rank)
    if "dim" in kwargs:
        kwargs["dim"] = nd
        return func(members, **kwargs)
    return func(members, nd, *args[2:], **kwargs)


def rule_shape_args(prepend_n: bool):
    """view / reshape / expand (prepend ``n``) and repeat (prepend 1)."""

    def rule(func, struct, leaves, mask, shapes, n):
        if not mask[0] or any(mask[1:]):
            return rule_vmap(func, struct, leaves, mask, shapes, n)
        args, kwargs = _args(struct, leaves)
        x, rest = args[0], args[1:]
        if "size" in kwargs or "shape" in kwargs:
            return rule_vmap(func, struct, leaves, mask, shapes, n)
        if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
            rest = list(rest[0])
        if not all(isinstance(s, int) for s in rest):
            return rule_vmap(func, struct, leaves, mask, shapes, n)
        lead = n if prepend_n else 1
        if prepend_n and len(rest) > len(shapes[0]) and _is_expand(func):
            # expand adds leading dims: they go after the batch dim, not before it
            x = x.reshape((n,) + (1,) * (len(rest) - len(shapes[0])) + tuple(shapes[0]))
        return func(x, (lead, *rest), **kwargs)

    return rule


def _is_expand(func) -> bool:
    return func is torch.Tensor.expand or getattr(func, "__name__", "") == "expand"


def rule_permute(func, struct, leaves, mask, shapes, n):
    args, kwargs = _args(struct, leaves)
    dims = args[1:] if "dims" not in kwargs else kwargs.pop("dims")
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    rank = len(shapes[0])
    return args[0].permute(0, *[(d % rank) + 1 for d in dims])


def rule_t(func, struct, leaves, mask, shapes, n):
    x = leaves[0]
    return x.transpose(1, 2) if len(shapes[0]) == 2 else x


def rule_transpose(func, struct, leaves, mask, shapes, n):
    args, kwargs = _args(struct, leaves)
    d0 = kwargs.get("dim0", args[1] if len(args) > 1 else None)
    d1 = kwargs.get("dim1", args[2] if len(args) > 2 else None)
    if not (isinstance(d0, int) and isinstance(d1, int)) or any(mask[1:]):
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    rank = len(shapes[0])
    return torch.transpose(args[0], _shift(d0, rank), _shift(d1, rank))


def rule_flatten(func, struct, leaves, mask, shapes, n):
    args, kwargs = _args(struct, leaves)
    rank = len(shapes[0])
    s = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
    e = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
    if rank == 0:
        return args[0].reshape(n, 1)
    s, e = s % rank, e % rank
    return torch.flatten(args[0], s + 1, e + 1)


def rule_squeeze(func, struct, leaves, mask, shapes, n):
    args, kwargs = _args(struct, leaves)
    d = kwargs.get("dim", args[1] if len(args) > 1 else None)
    shape = shapes[0]
    if d is None:  # never squeeze the batch dimension, even when n == 1
        dims = tuple(i + 1 for i, s in enumerate(shape) if s == 1)
    elif isinstance(d, int):
        dims = (d % len(shape) + 1,) if shape else ()
    else:
        dims = tuple(i % len(shape) + 1 for i in d)
    x = args[0]
    for dd in sorted(dims, reverse=True):
        x = x.squeeze(dd)
    return x


def rule_unsqueeze(func, struct, leaves, mask, shapes, n):
    args, kwargs = _args(struct, leaves)
    d = kwargs.get("dim", args[1] if len(args) > 1 else None)
    rank = len(shapes[0])
    d = d if d >= 0 else d + rank + 1
    return args[0].unsqueeze(d + 1)


def _is_plain_index(idx) -> bool:
    if isinstance(idx, tuple):
        return all(_is_plain_index(i) for i in idx)
    return idx is None or idx is Ellipsis or isinstance(idx, (int, slice, bool)) and not isinstance(idx, torch.Tensor)


def rule_getitem(func, struct, leaves, mask, shapes, n):
    """x[i], x[a:b], x[..., None]: prepend a full slice for the batch dimension."""
    if len(leaves) == 2 and mask[1] and not shapes[1] and struct[0][1][1] is LEAF:
        # x[i], i a per-instance 0-d integer (eager: x.select(0, int(i))): one advanced index
        # of the rows; an index out of range raises here and the group runs per instance
        x, i = leaves
        if is_int_scalar((), i.dtype, with_bool=False):
            return x[i] if not mask[0] else x[torch.arange(n, device=x.device), i]
    if len(leaves) != 1:  # a tensor index
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    args, _ = _args(struct, leaves)
    x, idx = args[0], args[1]
    if not _is_plain_index(idx):
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    idx = idx if isinstance(idx, tuple) else (idx,)
    return x[(slice(None),) + idx]


def rule_new_factory(func, struct, leaves, mask, shapes, n):
    """x.new_zeros(size) and friends: prepend n to the size."""
    args, kwargs = _args(struct, leaves)
    x, rest = args[0], args[1:]
    if len(rest) >= 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        size = tuple(rest[0])
        rest = rest[1:]
    else:
        k = 1 if func is torch.Tensor.new_full else 0
        size = tuple(rest[: len(rest) - k]) if rest else ()
        rest = rest[len(rest) - k:] if k else ()
        if "size" in kwargs:
            size = tuple(kwargs.pop("size"))
    return func(x, (n, *size), *rest, **kwargs)


def rule_split(func, struct, leaves, mask, shapes, n):
    args, kwargs = _args(struct, leaves)
    d = kwargs.pop("dim", args[2] if len(args) > 2 else 0)
    if any(mask[1:]) or not isinstance(d, int):
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    return func(args[0], args[1], _shift(d, len(shapes[0])), **kwargs)


# -- the registry: rule objects ----------------------------------------------------------------


class Rule:
    """How one family of operations is batched.

    Attributes:
        name (str): shown in ``RunStats.groups_by_rule``.
        fn: ``fn(func, struct, leaves, mask, shapes, n) -> batched output`` (always correct or raises).
        lower: optional ``lower(func, args, kwargs, lw) -> expression | None``, the batched call as
            one Python expression (``lw`` is the :class:`~batchcraft.autobatching.lower.StepView`),
            or None to use ``fn``.
        ragged: optional ragged form (see :mod:`ragged`), by family name.
    """

    __slots__ = ("name", "fn", "lower", "ragged")

    def __init__(self, name, fn, lower=None, ragged=None):
        self.name = name
        self.fn = fn
        self.lower = lower
        self.ragged = ragged

    def __repr__(self) -> str:
        return f"Rule({self.name})"


RULES: dict = {}
VMAP = Rule("vmap", rule_vmap)
_NO_RULE: dict = {}


def _register(funcs, rule):
    for f in funcs:
        if f is not None:
            RULES[f] = rule


def _tensor_methods(*names):
    return [getattr(torch.Tensor, n, None) for n in names]


def _torch_funcs(*names):
    return [getattr(torch, n, None) for n in names]


# -- lowerings: the batched call written out (dims shifted, ranks aligned) ------------------------

def dense_on_cpu(x):
    """``x`` contiguous if it is a strided CPU tensor, else ``x`` itself (see ``_STRIDED_SLOW``)."""
    if x.device.type == "cpu" and not x.is_contiguous():
        return x.contiguous()
    return x


#: Unary maths that torch 2.x computes with MKL's vector library on contiguous CPU tensors and
#: much more slowly on a strided view: on this 2-core VM ``torch.tanh`` of the third ``chunk`` of a
#: (256, 768) batch takes 72 µs, of a contiguous copy 12 µs (+5 µs for the copy), the same bits
#: (benchmarks/strided_unary.py). A batched block meets such views where the per-instance code
#: chunked a vector (``i, o, u = iou.chunk(3)``): each instance's chunk was contiguous, the
#: batch's is not. The lowering copies the input first.
_STRIDED_SLOW = ("tanh", "exp", "log", "sqrt", "sin", "cos", "erf", "atan", "log2", "log10", "tan", "trunc")


def _lower_elementwise(func, args, kwargs, lw):
    rank = max((len(s) for s in lw.shapes if s is not None), default=0)
    for j, (b, s) in enumerate(zip(lw.batched, lw.shapes)):
        if b and len(s) < rank:
            lw.wrap(j, lambda e, s=s: f"{e}.reshape((n,) + {(1,) * (rank - len(s)) + tuple(s)!r})")
    if func in _DENSE_FIRST and lw.batched == [True] and not kwargs:
        dense = lw.em.name(dense_on_cpu, "D")
        lw.wrap(0, lambda e: f"{dense}({e})")
    return lw.call(func, args, kwargs)


def _lower_direct(func, args, kwargs, lw):
    return lw.call(func, args, kwargs)


def _lower_weight(func, args, kwargs, lw):
    if not (lw.batched[0] and not any(lw.batched[1:])):
        return None
    if func is _LINEAR and lw.kernels is not None:
        return lw.call(lw.kernels.linear_for(lw, lw.shapes), args, kwargs)
    return lw.call(func, args, kwargs)


def _dim_lowering(pos: int, name: str = "dim", default=None, full=None):
    def lower(func, args, kwargs, lw):
        if not lw.batched[0] or (any(lw.batched[1:]) and func not in _BATCHED_OTHER_OK):
            return None
        rank = len(lw.shapes[0])
        d, where = _find_dim(args, kwargs, pos, name, default)
        if d is None and full == "flat":
            if not _flat_ok(args, kwargs, pos):
                return None
            lw.wrap(0, lambda e: f"{e}.reshape(n, -1)")
            e = lw.call(func, [args[0], 1], {})
            return f"{e}.reshape((n,) + {(1,) * rank!r})" if _keepdim(args, kwargs, pos) else e
        if d is None:
            if full != "tuple":
                return None
            if rank == 0:
                return lw.expr(args[0])
            nd = tuple(range(1, rank + 1))
        elif type(d) is int:
            nd = _shift(d, rank)
        elif isinstance(d, (tuple, list)) and all(type(i) is int for i in d):
            nd = tuple(_shift(i, rank) for i in d)
        else:
            return None
        if where == "pos":
            args[pos] = nd
        else:
            kwargs[name] = nd
        return lw.call(func, args, kwargs)

    return lower


def _lower_shape_args(prepend_n: bool):
    def lower(func, args, kwargs, lw):
        if not lw.batched[0] or any(lw.batched[1:]) or "size" in kwargs or "shape" in kwargs:
            return None
        rest = args[1:]
        if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
            rest = list(rest[0])
        if not all(type(s) is int for s in rest):
            return None
        shape = tuple(lw.shapes[0])
        if prepend_n and len(rest) > len(shape) and _is_expand(func):  # new leading dims after n
            pad = (1,) * (len(rest) - len(shape)) + shape
            lw.wrap(0, lambda e: f"{e}.reshape((n,) + {pad!r})")
        return lw.call(func, [args[0], (lw.N if prepend_n else 1, *rest)], kwargs)

    return lower


def _lower_unsqueeze(func, args, kwargs, lw):
    d = kwargs.pop("dim", args[1] if len(args) > 1 else None)
    if type(d) is not int or any(lw.batched[1:]):
        return None
    rank = len(lw.shapes[0])
    d = d if d >= 0 else d + rank + 1
    return f"{lw.expr(args[0])}.unsqueeze({d + 1})"


def _lower_squeeze(func, args, kwargs, lw):
    """``x.squeeze(d)`` as ``x.squeeze(d + 1)`` (as :func:`rule_squeeze`, written out once)."""
    if not lw.batched[0] or any(lw.batched[1:]) or set(kwargs) - {"dim"}:
        return None
    d = kwargs.get("dim", args[1] if len(args) > 1 else None)
    shape = lw.shapes[0]
    if d is None:
        dims = tuple(i + 1 for i, s in enumerate(shape) if s == 1)
    elif type(d) is int and shape:
        dims = (d % len(shape) + 1,)
    elif type(d) in (tuple, list) and shape and all(type(x) is int for x in d):
        dims = tuple(i % len(shape) + 1 for i in d)
    else:
        return None
    e = lw.expr(args[0])
    for dd in sorted(dims, reverse=True):
        e = f"{e}.squeeze({dd})"
    return e


def _lower_seq(func, args, kwargs, lw):
    """``torch.cat`` / ``stack`` of a list: dim shifted, shared members expanded to the batch (as
    :func:`rule_seq_dim`, written out once)."""
    seq = args[0] if args else None
    if (not isinstance(seq, (list, tuple)) or len(seq) != len(lw.batched) or len(args) > 2
            or set(kwargs) - {"dim"}):
        return None
    d = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if type(d) is not int:
        return None
    stack = func is torch.stack or getattr(func, "__name__", "") == "stack"
    nd = (d + 1 if d >= 0 else d) if stack else _shift(d, len(lw.shapes[0]))
    for j, b in enumerate(lw.batched):
        if not b:
            lw.wrap(j, lambda e, s=tuple(lw.shapes[j]): f"{e}.expand((n,) + {s!r})")
    return lw.call(func, [list(seq), nd], {})


def _lower_getitem(func, args, kwargs, lw):
    if len(lw.batched) != 1 or not _is_plain_index(args[1]):
        return None
    idx = args[1] if isinstance(args[1], tuple) else (args[1],)
    return f"{lw.expr(args[0])}[{lw.value((slice(None),) + tuple(idx))}]"


def _lower_split(func, args, kwargs, lw):
    d = kwargs.pop("dim", args[2] if len(args) > 2 else 0)
    if any(lw.batched[1:]) or type(d) is not int:
        return None
    return lw.call(func, [args[0], args[1], _shift(d, len(lw.shapes[0]))], kwargs)


_FULL_EXTREMA = {"max": "amax", "min": "amin"}


def _lower_extremum(func, args, kwargs, lw):
    """``max`` / ``min``: with a dim as other dim ops; over all elements (``x.max()``) as ``amax``
    of each row, which takes the same value. Only where no gradient flows (recorded with grad mode
    off): ``amax``'s gradient matches ``max()``'s over ties but not at a NaN (all NaN, where
    eager's goes to the NaN; hostile helper, stop 32). With grad mode on: vmap, as before."""
    if len(args) == 1 and not kwargs and lw.batched == [True] and lw.step.state is not None \
            and not lw.step.state[0]:
        op = _FULL_EXTREMA[getattr(func, "__name__", "")]
        return f"{lw.expr(args[0])}.reshape(n, -1).{op}(1)"
    return _DIM1_LOWER(func, args, kwargs, lw)


def _lower_permute(func, args, kwargs, lw):
    if any(lw.batched[1:]) or not lw.batched[0]:
        return None
    dims = args[1:] if "dims" not in kwargs else [kwargs["dims"]]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    if not all(type(d) is int for d in dims):
        return None
    rank = len(lw.shapes[0])
    return f"{lw.expr(args[0])}.permute({(0, *[(d % rank) + 1 for d in dims])!r})"


def _lower_transpose(func, args, kwargs, lw):
    d0 = kwargs.get("dim0", args[1] if len(args) > 1 else None)
    d1 = kwargs.get("dim1", args[2] if len(args) > 2 else None)
    if type(d0) is not int or type(d1) is not int or any(lw.batched[1:]) or not lw.batched[0]:
        return None
    rank = len(lw.shapes[0])
    return f"{lw.expr(args[0])}.transpose({_shift(d0, rank)}, {_shift(d1, rank)})"


def _lower_matmul(func, args, kwargs, lw):
    """The cases of :func:`rule_matmul` that are one ``torch.matmul`` of the batched operands."""
    if len(lw.batched) != 2 or kwargs or getattr(func, "__name__", "") == "__rmatmul__":
        return None
    (ma, mb), (sa, sb) = lw.batched, lw.shapes
    if ma and mb and len(sa) >= 2 and len(sb) >= 2:
        # ranks aligned after the batch dim: matmul broadcasts batch dims from the right
        for j, (s, other) in enumerate(((sa, sb), (sb, sa))):
            if len(s) < len(other):
                lw.wrap(j, lambda e, s=tuple(s), k=len(other) - len(s): f"{e}.reshape((n,) + {(1,) * k + s!r})")
    elif mb and not ma and len(sa) == 2 and len(sb) == 2:
        # a shared matrix times each node's matrix: rowmm's kernel where it runs (torch broadcasts
        # the matrix over the batch: 48 GFLOP/s on one core at MV-RNN's 128 x 256 x 128), else torch's
        return f"{lw.em.name(_rowmm.matmul, 'RM')}({lw.expr(args[0])}, {lw.expr(args[1])})"
    elif not ((ma and not mb and len(sb) == 2 and len(sa) >= 1) or (mb and not ma and len(sa) == 2 and len(sb) >= 2)):
        return None
    return f"{lw.em.name(torch.matmul, 'F')}({lw.expr(args[0])}, {lw.expr(args[1])})"


# -- registrations --------------------------------------------------------------------------------

_ELEMENTWISE = ("add", "sub", "mul", "div", "true_divide", "neg", "sigmoid", "tanh", "relu", "exp",
                "log", "log1p", "expm1", "sqrt", "rsqrt", "abs", "pow", "maximum", "minimum", "where",
                "clamp", "clamp_min", "clamp_max", "sin", "cos", "reciprocal", "square", "sign", "floor",
                "ceil", "round", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
                "logical_not", "masked_fill", "zeros_like", "ones_like", "full_like", "rand_like",
                "randn_like", "empty_like", "lerp", "addcmul", "addcdiv", "erf", "atan2", "fmod",
                "remainder", "floor_divide", "bitwise_and", "bitwise_or", "isnan", "isinf", "isfinite",
                "nan_to_num", "rsub", "logaddexp", "hypot", "trunc", "frac", "tan", "asin", "acos",
                "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "log2", "log10", "exp2", "sgn",
                "bitwise_not", "bitwise_xor", "logical_xor", "xlogy", "copysign", "float_power")
_DUNDERS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
            "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__pow__", "__rpow__",
            "__and__", "__or__", "__xor__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__",
            "__ne__", "__neg__", "__abs__", "__invert__", "__pos__", "__lshift__", "__rshift__")
_CONVERSIONS = ("float", "double", "half", "long", "int", "bool", "to", "type_as", "contiguous",
                "clone", "detach", "bfloat16", "cpu", "cuda", "requires_grad_")

_ELEM = Rule("elementwise", rule_elementwise, _lower_elementwise, ragged="elementwise")
_DENSE_FIRST = frozenset(_torch_funcs(*_STRIDED_SLOW) + _tensor_methods(*_STRIDED_SLOW) + [F.tanh]) - {None}
_register(_torch_funcs(*_ELEMENTWISE) + _tensor_methods(*_ELEMENTWISE, *_DUNDERS), _ELEM)
_register([F.relu, F.gelu, F.silu, F.elu, F.leaky_relu, F.softplus, F.hardtanh, F.relu6, F.dropout,
           F.sigmoid, F.tanh, F.mish, F.selu, F.logsigmoid, F.hardswish, F.hardsigmoid, torch.selu,
           torch.dropout, torch.celu, F.celu, F.softsign, F.tanhshrink, F.threshold, F.softshrink,
           F.hardshrink, torch.nn.functional.relu6], _ELEM)
_register(_tensor_methods(*_CONVERSIONS) + [torch.clone, torch.detach], Rule("direct", rule_direct, _lower_direct,
                                                                              ragged="elementwise"))
_register([_LINEAR, F.embedding, F.layer_norm, torch.layer_norm, torch.embedding, F.rms_norm],
          Rule("weight", rule_weight, _lower_weight, ragged="rowwise"))
_register([torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell, torch.rnn_relu_cell], Rule("rnn_cell", rule_rnn_cell))
_register([torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.__matmul__,
           torch.Tensor.__rmatmul__], Rule("matmul", rule_matmul, _lower_matmul, ragged="matmul"))
_DIM1 = Rule("dim", make_dim_rule(1), _dim_lowering(1), ragged="reduce")
_register(_torch_funcs("softmax", "log_softmax", "cumsum", "cumprod", "logsumexp",
                       "amax", "amin", "index_select", "narrow", "select", "gather", "prod")
          + _tensor_methods("softmax", "log_softmax", "cumsum", "cumprod", "logsumexp",
                            "amax", "amin", "index_select", "narrow", "select", "gather", "prod")
          + [F.softmax, F.log_softmax], _DIM1)
_register(_torch_funcs("argmax", "argmin") + _tensor_methods("argmax", "argmin"),
          Rule("dim", make_dim_rule(1, full="flat"), _dim_lowering(1, full="flat"), ragged="reduce"))
_register(_torch_funcs("sum", "mean", "std", "var", "all", "any") + _tensor_methods("sum", "mean", "all", "any"),
          Rule("sum", make_dim_rule(1, full="tuple"), _dim_lowering(1, full="tuple"), ragged="reduce"))
_DIM1_LOWER = _dim_lowering(1)
_register(_torch_funcs("max", "min") + _tensor_methods("max", "min"), Rule("max", make_dim_rule(1), _lower_extremum,
                                                                           ragged="reduce"))
_BATCHED_OTHER_OK.update([torch.gather, torch.Tensor.gather])
_register([torch.cat, torch.concat, torch.concatenate, torch.stack], Rule("seq", rule_seq_dim, _lower_seq,
                                                                         ragged="seq"))
_register(_tensor_methods("view", "reshape", "expand") + [torch.reshape],
          Rule("shape", rule_shape_args(True), _lower_shape_args(True)))
_register(_tensor_methods("repeat"), Rule("repeat", rule_shape_args(False), _lower_shape_args(False)))
_register([torch.permute, torch.Tensor.permute], Rule("permute", rule_permute, _lower_permute, ragged="permute"))
_register([torch.t, torch.Tensor.t], Rule("t", rule_t))
_register([torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes],
          Rule("transpose", rule_transpose, _lower_transpose, ragged="transpose"))
_register(_torch_funcs("unbind") + _tensor_methods("unbind"),
          Rule("unbind", make_dim_rule(1, default=0), _dim_lowering(1, default=0)))
_register([torch.flatten, torch.Tensor.flatten], Rule("flatten", rule_flatten))
_register([torch.squeeze, torch.Tensor.squeeze], Rule("squeeze", rule_squeeze, _lower_squeeze, ragged="squeeze"))
_register([torch.unsqueeze, torch.Tensor.unsqueeze], Rule("unsqueeze", rule_unsqueeze, _lower_unsqueeze,
                                                          ragged="unsqueeze"))
_register([torch.Tensor.__getitem__], Rule("getitem", rule_getitem, _lower_getitem, ragged="getitem"))
_register(_tensor_methods("new_zeros", "new_ones", "new_empty", "new_full"), Rule("new_factory", rule_new_factory))
_register([torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk], Rule("split", rule_split, _lower_split,
                                                                                  ragged="split"))



def rule_scatter(func, struct, leaves, mask, shapes, n):
    """select_scatter / slice_scatter / diagonal_scatter: shift the dimension arguments.

    (``torch.func.vmap`` of ``select_scatter`` double-counts the gradient of the overwritten
    slots in torch 2.13, so these do not go through vmap.)
    """
    args, kwargs = _args(struct, leaves)
    if not mask[0]:
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    rank = len(shapes[0])
    if not mask[1]:
        args[1] = args[1].expand(n, *args[1].shape)
    names = ("dim1", "dim2") if func is torch.diagonal_scatter else ("dim",)
    first = 3 if func is torch.diagonal_scatter else 2
    for k, name in enumerate(names):
        pos = first + k
        if name in kwargs:
            kwargs[name] = _shift(kwargs[name], rank)
        elif len(args) > pos:
            args[pos] = _shift(args[pos], rank)
        elif func is torch.diagonal_scatter:
            kwargs[name] = _shift(k, rank)  # defaults dim1=0, dim2=1
        else:
            kwargs[name] = 1  # default dim=0
    return func(*args, **kwargs)


def rule_setitem_functional(func, struct, leaves, mask, shapes, n):
    """``x[key] = v`` out of place (functionalised writes): prepend a full slice to a basic key."""
    args, kwargs = _args(struct, leaves)
    key = args[1]
    if not mask[0] or not _is_plain_index(key) or (len(mask) > 2 and any(mask[2:])):
        return rule_vmap(func, struct, leaves, mask, shapes, n)
    key = key if isinstance(key, tuple) else (key,)
    y = args[0].clone()
    value = args[2]
    if isinstance(value, torch.Tensor) and len(mask) > 1 and mask[-1]:
        # a per-instance value: (n, *value shape), broadcast into the indexed region of each row
        region = y[(slice(None),) + key]
        value = value.reshape(value.shape[:1] + (1,) * (region.dim() - value.dim()) + value.shape[1:])
    y[(slice(None),) + key] = value
    return y


def rule_for(func):
    """The :class:`Rule` of ``func``: a registered rule, else vmap, else None (run per instance).

    Custom operators (``torch.library``) without a vmap rule of their own get None: vmap would
    only loop over the instances inside, so batchcraft runs them per instance and counts it.
    """
    r = RULES.get(func)
    if r is not None:
        return r
    if func in _NO_RULE:
        return None
    if isinstance(func, torch._ops.OpOverload) and func.namespace not in ("aten", "prim", "prims"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "FuncTorchBatched"):
            _NO_RULE[func] = True
            return None
    return VMAP


def register_rule(func, rule=None):
    """Register a batching rule for ``func`` (usable as a decorator).

    A rule is ``rule(func, struct, leaves, mask, shapes, n) -> batched output``: ``leaves`` are
    the tensor arguments (batched ones with a leading dimension ``n``), ``mask[j]`` says
    whether leaf ``j`` is batched, ``shapes[j]`` is its per-instance shape; rebuild the call
    with :func:`call_with` and return outputs of shape ``(n, *per-instance shape)``.
    """
    if rule is None:
        return lambda r: register_rule(func, r)
    RULES[func] = Rule(getattr(rule, "__name__", "user"), rule)
    _NO_RULE.pop(func, None)
    return rule


_register([torch.select_scatter, torch.slice_scatter, torch.diagonal_scatter], Rule("scatter", rule_scatter))


def _register_functional():
    from batchcraft.autobatching.buffers import (batch_norm_train, instance_norm_train, rule_batch_norm_train,
                                                 rule_instance_norm_train)
    from batchcraft.autobatching.functional import setitem_functional

    from batchcraft.autobatching.cells import GATES, lower_gates, rule_gates

    _register([setitem_functional], Rule("setitem", rule_setitem_functional))
    _register(list(GATES), Rule("gates", rule_gates, lower_gates))
    _register([batch_norm_train], Rule("batch_norm", rule_batch_norm_train))
    _register([instance_norm_train], Rule("instance_norm", rule_instance_norm_train))


_register_functional()


__all__ = ["Rule", "RULES", "rule_for", "register_rule", "call_with", "rule_vmap"]
