"""Gathering: turn a gather plan (:mod:`plan`) into one batched tensor.

A view when the rows are in order, one ``index_select`` per source buffer otherwise
(REFERENCES §7: a gather feeding a GEMM is nearly free on this CPU). Rows from several buffers
are copied once, straight into the result: each buffer's rows into their slice of it, or, where
the group's order interleaves the buffers, each row to its final place (``_fused.copy_rows``);
with autograd, or without the extension there, a ``cat`` and one reorder. Index tensors are made
from an ``array``/bytes buffer (``torch.tensor(list)`` costs ~30 µs for a few hundred rows).
"""

from __future__ import annotations

from array import array as _array

import torch

from batchcraft.autobatching.consts import ConstLeaf
from batchcraft.autobatching.threadstate import is_transform_wrapped as _wrapped
from batchcraft.autobatching.threadstate import tangents_possible

try:  # optional extension (fuse.py): without it interleaved gathers take the cat path
    from batchcraft.autobatching import _fused
except ImportError:  # pragma: no cover - exercised by the CC=/bin/false install
    _fused = None

_frombuffer = torch.frombuffer
_int64 = torch.int64
_T = torch.Tensor


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """CPU tensor ``t`` on ``device``, without waiting for the device.

    A plain ``t.to("cuda")`` from pageable memory synchronises the stream: the host would wait
    for every kernel queued so far before recording on. From pinned memory with
    ``non_blocking=True`` the copy is queued behind them (torch's caching host allocator keeps the
    pinned block until the copy has run), so recording and planning overlap the kernels.
    """
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def index_tensor(rows, device) -> torch.Tensor:
    """int64 index tensor of ``rows`` (a list of ints or int64 bytes) on ``device``."""
    if type(rows) is not bytearray:
        rows = _array("q", rows)
    t = _frombuffer(rows, dtype=_int64)
    return t if device.type == "cpu" else to_device(t, device)


def select_rows(t, idx) -> torch.Tensor:
    """``t.index_select(0, idx)``; a contiguous ``t`` of rank > 2 is gathered as a 2-D view.

    ATen's ``index_select`` copies a 2-D contiguous tensor row by row but walks higher ranks
    element-wise: 3.5x slower for (N, 64, 64) rows on this CPU (MV-RNN's word matrices). The
    rows and values are the same.
    """
    if t.dim() > 2 and t.is_contiguous():
        return t.view(t.shape[0], -1).index_select(0, idx).view((idx.shape[0],) + tuple(t.shape[1:]))
    return t.index_select(0, idx)


class Rows:
    """Rows ``index`` (``(m,)`` int64) of the 2-D float32 ``buffer``, not copied yet: a gathered
    input that fused kernels read in place (:mod:`fuse`), each row through the index, so the
    gather's copy is never made. Any other reader calls :meth:`materialize` (the copy it saved)."""

    __slots__ = ("buffer", "index")

    def __init__(self, buffer, index):
        self.buffer = buffer
        self.index = index

    @property
    def device(self):
        return self.buffer.device

    def materialize(self) -> torch.Tensor:
        return self.buffer.index_select(0, self.index)


class RowRefs:
    """Rows of one or more buffers, not copied: the address of each node's row (``addrs``,
    ``(n,)`` int64), read in place by the batched products of :mod:`rowmm` (a pointer-array
    GEMM), so the gather's copy of large per-node matrices (MV-RNN's 64 KiB ``A^T``) is never
    made. ``shape``: one row's shape. Any other reader calls :meth:`materialize` (the copy it
    saved). Only made by :func:`row_refs`, which checks every buffer."""

    __slots__ = ("addrs", "shape", "buffers", "plan", "_copy")

    def __init__(self, addrs, shape, buffers, plan):
        self.addrs = addrs
        self.shape = shape
        self.buffers = buffers  # (the flush's buffer list: keeps every row alive while this is read)
        self.plan = plan
        self._copy = None

    @property
    def device(self):
        return self.addrs.device

    @property
    def copied(self) -> bool:
        """Was it gathered after all (a reader that could not read it in place)?"""
        return self._copy is not None

    def materialize(self) -> torch.Tensor:
        if self._copy is None:  # (gathered once for all its readers)
            self._copy = _take(self.buffers, self.plan)
        return self._copy


#: rows smaller than this are gathered (a copy of small rows costs less than per-node products)
ROW_REFS_MIN_BYTES = 4096


def row_refs(buffers, plan):
    """The rows of an index or multi-buffer ``plan`` as a :class:`RowRefs`, or None where the
    gather must run: a view plan (no copy to save), small rows, autograd, another device or
    dtype than float32 CPU, a torch.func wrapper, a conjugate, negative or zero tensor (their
    memory is not their values: reliability #192), rows that are not contiguous, an index out
    of its buffer."""
    kind = plan[0]
    if kind == "view":
        return None
    pieces, perm = ([(plan[1], plan[2])], None) if kind == "index" else (plan[1], plan[2])
    first = buffers[pieces[0][0]]
    if first.dim() < 2 or first[0].numel() * 4 < ROW_REFS_MIN_BYTES:
        return None
    addrs: list = []  # (Python ints: a group's few hundred rows cost less than torch calls per piece)
    for b, rows in pieces:
        t = buffers[b]
        if (type(t) is not _T or (t is not first and t.shape[1:] != first.shape[1:]) or t.dtype is not torch.float32
                or not t.is_cpu or t.requires_grad or not t.is_contiguous() or not _memory_is_values(t)):
            return None  # (contiguous buffers have contiguous rows)
        rows = _ints(rows)
        if rows and (min(rows) < 0 or max(rows) >= t.shape[0]):
            return None
        base, stride = t.data_ptr(), t.stride(0) * 4
        addrs += [base + r * stride for r in rows]
    if perm is not None:  # row i of the group is row perm[i] of the concatenation
        perm = _ints(perm)
        if len(perm) != len(addrs) or (perm and (min(perm) < 0 or max(perm) >= len(addrs))):
            return None
        addrs = [addrs[i] for i in perm]
    return RowRefs(torch.tensor(addrs, dtype=_int64), tuple(first.shape[1:]), buffers, plan)


def _memory_is_values(t) -> bool:
    """Are ``t``'s bytes its values, for raw reads (row copies, row addresses)? Not for a
    torch.func wrapper (no storage), a conjugate or negative view or a zero tensor (reliability #192)."""
    return not (_wrapped(t) or t.is_conj() or t.is_neg() or t._is_zerotensor())


def _ints(rows) -> list:
    """A plan's rows (a list of ints, or int64 bytes) as a list of ints."""
    return _array("q", rows).tolist() if type(rows) is bytearray else rows


def materialize(x):
    """``x``, or the tensor of a :class:`Rows` / :class:`RowRefs` (what a program's unfused
    branch reads)."""
    return x.materialize() if type(x) is Rows or type(x) is RowRefs else x




def _deferrable(t) -> bool:
    return (t.dim() == 2 and t.dtype is torch.float32 and t.is_cpu and t.layout is torch.strided
            and not t.requires_grad and (t.shape[1] < 2 or t.stride(1) == 1) and not _wrapped(t))


def take(buffers, plan, defer: bool = False):
    """The ``(n, ...)`` tensor described by ``plan``; with ``defer``, an index plan over a 2-D
    float32 CPU buffer without autograd history is a :class:`Rows` instead (no copy)."""
    if defer and plan[0] == "index" and _deferrable(buffers[plan[1]]):
        t = buffers[plan[1]]
        return Rows(t, index_tensor(plan[2], t.device))
    return _take(buffers, plan)


def _take(buffers, plan) -> torch.Tensor:
    """The ``(n, ...)`` tensor described by ``plan``."""
    kind = plan[0]
    if kind == "view":
        t = buffers[plan[1]]
        r0, n = plan[2], plan[3]
        return t if (r0 == 0 and t.shape[0] == n) else t[r0:r0 + n]
    if kind == "index":
        t = buffers[plan[1]]
        return select_rows(t, index_tensor(plan[2], t.device))
    out = _take_pieces(buffers, plan[1], plan[2])
    if out is not None:
        return out
    pieces = []
    for b, rows in plan[1]:
        t = buffers[b]
        r0, n = _run_of(rows)
        pieces.append(t[r0:r0 + n] if r0 >= 0 else select_rows(t, index_tensor(rows, t.device)))
    cat = torch.cat(pieces)
    perm = plan[2]
    if perm is None:
        return cat
    return select_rows(cat, index_tensor(perm, cat.device))


def _run_of(rows) -> tuple:
    """``(first row, count)`` when ``rows`` (a list of ints, or int64 bytes: not checked) are
    consecutive, else ``(-1, count)``."""
    if type(rows) is bytearray:
        return -1, len(rows) // 8
    n = len(rows)
    r0 = rows[0]
    return (r0, n) if rows[-1] - r0 == n - 1 and rows == list(range(r0, r0 + n)) else (-1, n)


def _rows_2d(t):
    """``t`` as ``(rows, row elements)`` with contiguous rows, or None."""
    if t.dim() == 2:
        return t if t.shape[1] < 2 or t.stride(1) == 1 else None
    return t.view(t.shape[0], -1) if t.is_contiguous() else None


#: gathers from several buffers up to this many bytes are one ``_fused.gather_pieces`` call
SMALL_GATHER_BYTES = 64 * 1024


def _small_gather(buffers, pieces, perm, first, grad):
    """:func:`_take_pieces` for at most :data:`SMALL_GATHER_BYTES`: one ``_fused.gather_pieces``
    call, no torch call but the output's allocation; None where the general path must decide."""
    dtype, rshape = first.dtype, first.shape[1:]
    item = first.element_size()
    for d in rshape:
        item *= d
    total = sum(len(rows) // 8 if type(rows) is bytearray else len(rows) for _, rows in pieces)
    if total * item > SMALL_GATHER_BYTES or not first.dim():
        return None  # (before the checks below: the general path makes its own)
    srcs = []
    for b, rows in pieces:
        t = buffers[b]
        if (type(t) is not _T or not t.is_cpu or t.dtype is not dtype or t.shape[1:] != rshape
                or (grad and t.requires_grad) or not _memory_is_values(t)):
            return None
        st = t.stride()
        if len(st) > 1 and not t.is_contiguous() and not (len(st) == 2 and (rshape[0] < 2 or st[1] == 1)):
            return None  # rows whose elements are apart: the general path
        srcs.append((t.data_ptr(), st[0] * t.element_size() if st else 0, t.shape[0] if st else 1, rows))
    out = torch.empty((total, *rshape), dtype=dtype)
    if item:  # (rows of no elements: nothing to copy, and their buffers may have no address)
        _fused.gather_pieces(out.data_ptr(), total, item, tuple(srcs), perm)
    return out


def _take_pieces(buffers, pieces, perm):
    """Rows of several buffers (``pieces``: ``[(buffer, rows), ...]`` in concatenation order, then
    ``perm`` over the concatenation, or None) copied once into a new tensor; None where the
    cat path must run: autograd (the copies below record no history), another device, a
    torch.func wrapper, a conjugate or negative view (the row copies read memory, not values:
    reliability #192), buffers of different row shapes or dtypes, or a reorder without the
    extension."""
    first = buffers[pieces[0][0]]
    grad = torch.is_grad_enabled()
    if tangents_possible():  # dual rows: torch has no out= copy for them (reliability #209)
        return None
    if _fused is not None:
        out = _small_gather(buffers, pieces, perm, first, grad)
        if out is not None:
            return out
    srcs = []
    for b, _ in pieces:
        t = buffers[b]
        if (type(t) is not _T or not t.is_cpu or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or (grad and t.requires_grad) or not _memory_is_values(t)):
            return None
        t2 = _rows_2d(t)
        if t2 is None:
            return None
        srcs.append(t2)
    if perm is not None and _fused is None:
        return None
    counts = [_run_of(rows) for _, rows in pieces]
    total = sum(n for _, n in counts)
    out = torch.empty((total, *first.shape[1:]), dtype=first.dtype)
    if out.numel() == 0:  # rows of no elements (or none): nothing to copy, no address to read
        return out
    o2 = out.view(total, -1)
    if perm is None:
        r = 0
        for (_, rows), t2, (r0, n) in zip(pieces, srcs, counts):
            if r0 >= 0:
                o2[r:r + n].copy_(t2[r0:r0 + n])
            else:
                torch.index_select(t2, 0, index_tensor(rows, t2.device), out=o2[r:r + n])
            r += n
        return out
    # row i of the result is row perm[i] of the concatenation: each piece's rows go to inv[...]
    p = index_tensor(perm, out.device)
    if p.shape[0] != total:
        return None
    inv = torch.empty(total, dtype=_int64)
    inv.index_copy_(0, p, torch.arange(total, dtype=_int64))
    item = o2.element_size() * o2.shape[1]
    r = 0
    for (_, rows), t2, (r0, n) in zip(pieces, srcs, counts):
        src = torch.arange(r0, r0 + n, dtype=_int64) if r0 >= 0 else index_tensor(rows, t2.device)
        _fused.copy_rows(o2.data_ptr(), inv[r:r + n].data_ptr(), t2.data_ptr(), src.data_ptr(), item,
                         t2.stride(0) * t2.element_size(), n, total, t2.shape[0])
        r += n
    return out


def keep_requires_grad(buffers, plans, ins) -> list:
    """``ins`` where a gathered input of a group recorded under ``no_grad`` requires grad as its rows did.

    A gather under ``no_grad`` cuts ``requires_grad``; eager's no_grad *view* of a tensor that
    requires grad still requires grad (a leaf without history, reliability #54). Such an input
    becomes a leaf that requires grad (a detached alias: no copy), so views of it do as in eager
    and other results do not. ``None`` entries (inputs a hoisted rest does not read) stay.
    """
    out = ins
    for j, t in enumerate(ins[:len(plans)]):  # (a hoisted rest's prefix outputs come after)
        if t is None or type(t) is Rows or type(t) is RowRefs or t.requires_grad:  # (of buffers without history)
            continue
        p = plans[j]
        kind = p[0]
        if kind == "view":
            continue
        srcs = (p[1],) if kind == "index" else [b for b, _ in p[1]]
        if any(buffers[b].requires_grad for b in srcs):
            if out is ins:
                out = list(ins)
            out[j] = t.detach().requires_grad_()
    return out


#: index plans of one buffer in one group are joined into one ``index_select`` from this many on
JOIN_MIN = 2


def take_all(buffers, plans, defer=(), refs=(), skip=()) -> list:
    """:func:`take` of every plan of a group; index plans reading one buffer share one gather.

    A group with many slots (``torch.stack`` of a sentence's words: one slot per word) would make
    one small ``index_select`` per slot; joined, the slots are one ``index_select`` of all their
    rows (slot after slot) and each slot is a contiguous view of it. Values are the same rows.
    ``defer``: slots taken with ``take(..., defer=True)`` (possibly :class:`Rows`); ``refs``:
    slots taken as :class:`RowRefs` where :func:`row_refs` allows (else gathered); ``skip``: slots
    the group's program never reads (a leaf's unused argument): None, nothing gathered.
    """
    by_buf: dict = {}
    got: dict = {}
    for j in refs:
        r = row_refs(buffers, plans[j])
        if r is not None:
            got[j] = r
    for j, p in enumerate(plans):
        if p[0] == "index" and j not in defer and j not in got and j not in skip:
            by_buf.setdefault(p[1], []).append(j)
    out = [None] * len(plans)
    for b, js in by_buf.items():
        if len(js) < JOIN_MIN:
            continue
        rows = [plans[j][2] for j in js]
        if all(type(r) is bytearray for r in rows):
            joined = bytearray().join(rows)
            sizes = [len(r) // 8 for r in rows]
        elif not any(type(r) is bytearray for r in rows):
            joined = [x for r in rows for x in r]
            sizes = [len(r) for r in rows]
        else:  # pragma: no cover - one planner emits one kind
            continue
        t = buffers[b]
        g = select_rows(t, index_tensor(joined, t.device))
        r0 = 0
        for j, n in zip(js, sizes):
            out[j] = g[r0:r0 + n]
            r0 += n
    for j, r in got.items():
        out[j] = r
    return [None if j in skip else take(buffers, p, j in defer) if o is None else o
            for j, (p, o) in enumerate(zip(plans, out))]


def stack_leaves(records, desc, value_of, nodes) -> torch.Tensor:
    """One tensor of leaves with descriptor ``desc``: ``records[i]`` is ``[tensor, pyvalue, did]``.

    ``torch.tensor(scalar)`` and ``torch.tensor([scalars])`` leaves become one tensor of their
    Python scalars, others a stack.
    """
    shape, dtype, device = desc
    if any(type(r[1]) is ConstLeaf for r in records):  # constant factories' leaves (consts.py)
        first = records[0][1]
        if all(r[0] is None and r[1] is first for r in records):  # one template, copied into each row
            return first.rows(len(records))
        return torch.stack([r[0] if r[0] is not None else value_of(nd) for r, nd in zip(records, nodes)])
    if len(shape) == 1 and all(r[0] is None and type(r[1]) is tuple for r in records):
        return to_device(torch.tensor([r[1] for r in records], dtype=dtype), device)  # (k, n): one call
    if not shape and all(r[1] is not None for r in records):
        vals = [r[1] for r in records]
        if dtype is torch.int64 and all(type(v) is int for v in vals):
            try:
                return index_tensor(vals, device)
            except OverflowError:  # pragma: no cover - torch.tensor rejects these at record time
                pass
        return to_device(torch.tensor(vals, dtype=dtype), device)
    return torch.stack([r[0] if r[0] is not None else value_of(nd) for r, nd in zip(records, nodes)])
