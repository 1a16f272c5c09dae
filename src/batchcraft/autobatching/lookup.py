"""Embedding lookups read in place: a group that only looks rows up places its nodes in the table.

A group whose program does nothing but ``F.embedding(ids, W)`` of one integer scalar per
instance (each output possibly viewed to another shape, as MV-RNN's word matrix
``matrix(word_id).view(H, H)``) would copy every looked-up row into a new buffer, and its
readers would then gather those rows again: two copies of rows that already sit in ``W``.
In inference the executor skips the group instead: the tables themselves (detached, viewed
to the per-instance shape) become the group's buffers and each node is placed at its id's
row (``Recorder.place`` with one row per node, as a deduplicated group is). The readers'
gathers read the tables directly; the lookup's copy is never made.

As with deduplicated groups, a node's value handed out (an output of the call, a value wait,
``.numpy()``) first gets rows of its own (``RecorderBase.value_of``): a write into it never
reaches the table. The rows are read when the readers run, as every recorded operation reads
its inputs when its group runs.

Only for big rows (:data:`MIN_ROW_BYTES` over a node's outputs: small rows copied once into a
group's own buffer are then read as contiguous views, where rows of the table need a gather;
DRNN's 1 KiB label rows ran 5% slower in place), without autograd (the looked-up rows would
need their history), for ids that are all in range (otherwise the group runs as usual and
raises ``F.embedding``'s error), CPU tables that are contiguous, no ``max_norm`` (which
renormalises the table in place) and rows of at least two elements (a scalar read converts a
whole result to a list, ``RecorderBase.scalar``). Part of the ``dedup`` option.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchcraft.autobatching.descs import DESCS
from batchcraft.autobatching.signature import LEAF, rebuild

#: looked up in place only when a node's outputs take at least this many bytes (MV-RNN's word
#: matrices: 16-64 KiB; the readers gather such rows anyway, from several buffers)
MIN_ROW_BYTES = 4096
_EMBEDDINGS = (F.embedding, torch.embedding)
_VIEWS = frozenset({torch.Tensor.view, torch.Tensor.reshape, torch.reshape})
_INT = (torch.int64, torch.int32)


class _Leaf:
    __slots__ = ("ref",)

    def __init__(self, ref):
        self.ref = ref


def _args(st):
    it = iter([_Leaf(r) for r in st.refs])
    args = list(rebuild(st.struct[0], it))
    kwargs = rebuild(st.struct[1], it) if st.struct[1] is not None else {}
    return args, kwargs


def form(prog, in_descs):
    """``[(table, per-instance shape), ...]``, one per output of ``prog``, when its groups may be
    placed in the tables (see the module docstring); else None. ``in_descs``: the
    ``(shape, dtype, device)`` of each per-instance input."""
    if prog.n_ragged or prog.n_in != 1 or len(in_descs) != 1:
        return None
    shape, dtype, device = in_descs[0]
    if shape != () or dtype not in _INT or torch.device(device).type != "cpu":
        return None
    table: dict = {}  # (step, slot) -> the table its rows come from
    for st in prog.steps:
        if len(st.out_dids) != 1 or st.out_struct is not LEAF:
            return None
        args, kwargs = _args(st)
        if st.func in _EMBEDDINGS:
            first, second = (args + [None, None])[:2]
            if st.func is torch.embedding:  # (weight, indices, ...): no max_norm
                w, ids, max_norm = first, second, None
            else:  # F.embedding(input, weight, padding_idx, max_norm, ...)
                ids, w = first, second
                max_norm = kwargs.get("max_norm", args[3] if len(args) > 3 else None)
            if (type(ids) is not _Leaf or ids.ref != ("in", 0) or type(w) is not _Leaf or w.ref[0] != "const"
                    or max_norm is not None):
                return None
            t = w.ref[1]
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_cpu or not t.is_contiguous():
                return None
            table[(st.index, 0)] = t
        elif st.func in _VIEWS:
            src = args[0] if args else None
            if type(src) is not _Leaf or src.ref[0] != "val" or (src.ref[1], src.ref[2]) not in table:
                return None
            table[(st.index, 0)] = table[(src.ref[1], src.ref[2])]
        else:
            return None
    out = []
    for ref, did in zip(prog.out_refs, prog.out_dids):
        if ref[0] != "val" or (ref[1], ref[2]) not in table:
            return None
        t = table[(ref[1], ref[2])]
        oshape = tuple(DESCS[did][0])
        numel = 1
        for d in oshape:
            numel *= d
        if numel != t.shape[1] or numel < 2 or DESCS[did][1] != t.dtype:
            return None
        out.append((t, oshape))
    if sum(t.shape[1] * t.element_size() for t, _ in out) < MIN_ROW_BYTES:
        return None
    return out or None


def place(rec, nodes, ids, tables) -> bool:
    """Place ``nodes`` at their ``ids`` (``(n,)`` integer tensor) in ``tables`` (:func:`form`);
    False (nothing done) when an id is out of range or the tables changed shape since the trace."""
    if (type(ids) is not torch.Tensor or ids.dim() != 1 or ids.shape[0] != len(nodes) or ids.dtype not in _INT
            or not ids.is_cpu):
        return False
    views = []
    for t, shape in tables:
        if t.dim() != 2 or not t.is_contiguous() or not t.is_cpu:
            return False
        views.append(t.detach().view((t.shape[0],) + shape))
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or any(hi >= t.shape[0] for t, _ in tables):
        return False  # the group runs as usual: F.embedding raises its own error
    rows = ids.to(torch.int64).contiguous()
    bufs = rec.buffers
    buf = len(bufs)
    bufs.extend(views)
    rec.place(nodes, buf, bytearray(rows.numpy().tobytes()))
    rec.shared_rows[buf] = len(views)  # a value handed out gets rows of its own first
    return True


__all__ = ["form", "place", "MIN_ROW_BYTES"]
