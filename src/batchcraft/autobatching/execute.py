"""Execution of recorded groups: gather -> one batched call -> results in place.

For each group of nodes with the same (phase, depth, signature):

1. **gather** each per-instance argument into one tensor with a leading batch
   dimension. Inputs that are already rows ``r..r+n`` of one earlier result are
   a view (no copy); rows of one result are one ``index_select``; rows of several
   results are gathered per source and put in order; leaves created by
   ``torch.tensor(scalar)`` become one ``torch.tensor(list)``. Shared arguments
   (parameters) are passed once, never gathered (ACRoBat §4.3, parameter reuse).
2. **call** the batching rule (static blocks replay their traced program).
3. **check** every output's shape; a rule that fails or mismatches falls back to
   running the group one instance at a time (counted in ``RunStats.fallbacks``).
"""

from __future__ import annotations

import time
from array import array as _array

import torch

from batchcraft.autobatching.blocks import StaticBlock
from batchcraft.autobatching.graph import LeafNode
from batchcraft.autobatching.lazy import LazyTensor
from batchcraft.autobatching.rules import rule_for, rule_vmap
from batchcraft.autobatching.signature import flatten, rebuild
from batchcraft.errors import AutobatchError, InstanceError

_perf = time.perf_counter


class _Mismatch(Exception):
    pass


def _call(func, struct, leaves):
    it = iter(leaves)
    args = rebuild(struct[0], it)
    kwargs = rebuild(struct[1], it) if struct[1] is not None else {}
    return func(*args, **kwargs)


def _tensors(out) -> list:
    flat: list = []
    flatten(out, flat)
    return flat


def index_tensor(rows: list, device) -> torch.Tensor:
    """int64 index tensor of ``rows``: through an ``array`` buffer on the CPU (~8x cheaper than
    ``torch.tensor(list)`` for a few hundred rows), copied to ``device`` otherwise."""
    t = torch.frombuffer(_array("q", rows), dtype=torch.int64)
    return t if device.type == "cpu" else t.to(device)


def stack_leaves(nodes) -> torch.Tensor:
    """Batch per-instance leaves: one tensor of the Python scalars of ``torch.tensor(scalar)``
    leaves, else a stack."""
    first = nodes[0]
    if first.pyvalue is not None:
        vals = [nd.pyvalue for nd in nodes]
        if None not in vals:
            if first.dtype is torch.int64 and all(type(v) is int for v in vals):
                try:
                    return index_tensor(vals, first.device)
                except OverflowError:  # pragma: no cover - torch.tensor rejects these at record time
                    pass
            return torch.tensor(vals, dtype=first.dtype, device=first.device)
    return torch.stack([nd.value for nd in nodes])


def gather(lazies: list, n: int) -> torch.Tensor:
    """One tensor of shape (n, *per-instance shape) holding the values of ``lazies`` in order."""
    x0 = lazies[0]
    nd0 = x0.node
    outs0 = nd0.outs
    if outs0 is None:
        nodes = [x.node for x in lazies]
        if type(nd0) is LeafNode and all(type(nd) is LeafNode for nd in nodes):
            return stack_leaves(nodes)
    else:
        # one pass: all rows of one earlier result (the common case with arenas)?
        slot = x0.slot
        rows = []
        for x in lazies:
            nd = x.node
            if nd.outs is not outs0 or x.slot != slot:
                break
            rows.append(nd.row)
        else:
            t = outs0[slot]
            r0 = rows[0]
            if rows[-1] - r0 == n - 1 and rows == list(range(r0, r0 + n)):
                return t if (r0 == 0 and t.shape[0] == n) else t[r0:r0 + n]  # a view, no copy
            return t.index_select(0, index_tensor(rows, t.device))
    return _gather_sources(lazies, n)


def _gather_sources(lazies: list, n: int) -> torch.Tensor:
    """Rows of several sources: one piece per source, then the rows put back in order."""
    index: dict = {}
    sources: list = []  # (tensor or None for leaves, rows or leaf nodes)
    order = []
    for x in lazies:
        nd = x.node
        k = None if type(nd) is LeafNode else (id(nd.outs), x.slot)
        s = index.get(k)
        if s is None:
            s = index[k] = len(sources)
            sources.append((None if k is None else nd.outs[x.slot], []))
        rows = sources[s][1]
        order.append((s, len(rows)))
        rows.append(nd if k is None else nd.row)
    pieces = []
    for t, rows in sources:
        if t is None:
            pieces.append(stack_leaves(rows))
        else:
            r0 = rows[0]
            if rows[-1] - r0 == len(rows) - 1 and rows == list(range(r0, r0 + len(rows))):
                pieces.append(t[r0:r0 + len(rows)])
            else:
                pieces.append(t.index_select(0, index_tensor(rows, t.device)))
    cat = torch.cat(pieces)
    offsets, acc = [], 0
    for p in pieces:
        offsets.append(acc)
        acc += p.shape[0]
    perm = [offsets[s] + p for s, p in order]
    if perm == list(range(n)):
        return cat
    return cat.index_select(0, index_tensor(perm, cat.device))


#: output arenas only for rows up to this size (bytes, all outputs of a node) and buffers up to
#: ARENA_MAX_BYTES: copying big rows twice costs more than the gathers it saves
ARENA_MAX_ROW_BYTES = 8192
ARENA_MAX_BYTES = 64 << 20


def _row_bytes(out_descs) -> int:
    total = 0
    for shape, dtype, _ in out_descs:
        n = 1
        for d in shape:
            n *= d
        total += n * dtype.itemsize
    return total


class Executor:
    """Runs groups of pending nodes as batched calls and records statistics."""

    #: switches for the ablation benchmark (benchmarks/autobatch_ablation.py); always on otherwise
    use_arenas = True

    def __init__(self, stats, *, direct_blocks: bool = True, compile_blocks: bool = False):
        self.stats = stats
        self.direct_blocks = direct_blocks
        self.compile_blocks = compile_blocks
        self.arenas: dict | None = None

    def begin(self, buckets: dict) -> None:
        """Before running the groups of ``buckets``: plan one output arena per kind of group.

        Groups of one operation with the same output descriptors (e.g. TreeLSTM cells of every
        depth and child count) write their outputs into shared buffers, one per output slot,
        each group into its own rows. A later argument whose rows come from several such groups
        is then one ``index_select`` (or a view) instead of one per source plus a reorder: the
        arena layout of the minimal prototype in REFERENCES.md §6. Inference only: with autograd
        on, in-place copies into a shared buffer would chain the whole buffer through backward.
        """
        if not self.use_arenas:
            self.arenas = None
            return
        count: dict = {}
        for nodes in buckets.values():
            first = nodes[0]
            info = first.info
            if info.key[3] or type(info.out_descs) is not tuple:
                continue
            k = (first.func, info.out_descs)
            c = count.get(k)
            if c is None:
                count[k] = [1, len(nodes)]
            else:
                c[0] += 1
                c[1] += len(nodes)
        # [buffers (made on first use), next free row, capacity]; one group alone needs no arena, and
        # large rows (MV-RNN's matrices) are not worth a second copy (measured: 271 vs 239 ms)
        self.arenas = {}
        for k, (groups, rows) in count.items():
            row = _row_bytes(k[1])
            if groups >= 2 and row <= ARENA_MAX_ROW_BYTES and row * rows <= ARENA_MAX_BYTES:
                self.arenas[k] = [None, 0, rows]

    def end(self) -> None:
        self.arenas = None

    @staticmethod
    def _into_arena(a, outs, n):
        bufs, off = a[0], a[1]
        if off + n > a[2]:  # pragma: no cover - the plan counted every node
            return outs, 0
        if bufs is None:
            bufs = a[0] = [torch.empty((a[2], *t.shape[1:]), dtype=t.dtype, device=t.device) for t in outs]
        if len(bufs) != len(outs) or any(b.dtype != t.dtype or b.device != t.device or b.shape[1:] != t.shape[1:]
                                          for b, t in zip(bufs, outs)):
            return outs, 0
        # a copy would change eager's layout (a non-contiguous result stays non-contiguous, and
        # .view() on it may rely on that) or cut a view from its base (x[0] aliases x): keep those
        if any(t._base is not None or not t.is_contiguous() for t in outs):
            return outs, 0
        for b, t in zip(bufs, outs):
            b[off:off + n].copy_(t)
        a[1] = off + n
        return bufs, off

    def _block_fn(self, block, prog):
        """The callable run on batched inputs: the block itself, or its torch.compile'd form."""
        if not self.compile_blocks:
            return block.fn
        if getattr(prog, "compiled", None) is None:
            # compiled once per signature with a dynamic batch dimension, reused across calls
            prog.compiled = torch.compile(block.fn, dynamic=True)
        return prog.compiled

    def run_group(self, nodes: list) -> None:
        n = len(nodes)
        first = nodes[0]
        info = first.info
        st = self.stats
        t0 = _perf()
        leaves, mask, shapes = [], [], []
        for j, x in enumerate(first.leaves):
            if type(x) is LazyTensor:
                leaves.append(gather([nd.leaves[j] for nd in nodes], n))
                mask.append(True)
                shapes.append(x.desc[0])
            else:
                leaves.append(x)
                mask.append(False)
                shapes.append(tuple(x.shape))
        t1 = _perf()
        outs = self.call_batched(first.func, first.struct, leaves, mask, shapes, n, info.out_descs,
                                 info.key[3], nodes, info)
        base = 0
        arenas = self.arenas
        if arenas is not None and not info.key[3]:
            a = arenas.get((first.func, info.out_descs))
            if a is not None:
                outs, base = self._into_arena(a, outs, n)
        for r, nd in enumerate(nodes):
            nd.outs = outs
            nd.row = base + r
        t2 = _perf()
        st.gather_s += t1 - t0
        st.kernel_s += t2 - t1
        st.batched_calls += 1

    def call_batched(self, func, struct, leaves, mask, shapes, n, out_descs, grad, nodes, info=None):
        """Batched outputs (list, one tensor of shape (n, ...) per output slot)."""
        if grad != torch.is_grad_enabled():
            with torch.set_grad_enabled(grad):
                return self.call_batched(func, struct, leaves, mask, shapes, n, out_descs, grad, nodes, info)
        kinds = self.stats.groups_by_rule
        if isinstance(func, StaticBlock):
            prog = info.program
            if prog.direct and self.direct_blocks:
                try:
                    outs = _tensors(_call(self._block_fn(func, prog), struct, leaves))
                    if len(outs) == len(out_descs) and all(
                            t.shape[0] == n and tuple(t.shape[1:]) == d[0] and t.dtype == d[1]
                            for t, d in zip(outs, out_descs)):
                        kinds["block_direct"] = kinds.get("block_direct", 0) + 1
                        return outs
                except Exception:  # the step-by-step replay below is always correct
                    pass
                prog.direct = False
            kinds["block"] = kinds.get("block", 0) + 1
            return self.replay(prog, leaves, mask, n, nodes)
        rule = rule_for(func)
        if rule is None:
            return self.per_instance(func, struct, leaves, mask, n, nodes, None)
        try:
            outs = _tensors(rule(func, struct, leaves, mask, shapes, n))
            if len(outs) != len(out_descs):
                raise _Mismatch(f"{len(outs)} outputs, expected {len(out_descs)}")
            for t, d in zip(outs, out_descs):
                if t.shape[0] != n or tuple(t.shape[1:]) != d[0]:
                    raise _Mismatch(f"batched shape {tuple(t.shape)}, expected ({n}, *{d[0]})")
                if t.dtype != d[1]:  # e.g. a batched 0-dim argument promoted like a dimensioned one
                    raise _Mismatch(f"batched dtype {t.dtype}, expected {d[1]}")
            name = rule.__name__
            kinds[name] = kinds.get(name, 0) + 1
            return outs
        except Exception as exc:  # any rule failure: run per instance, correct and counted
            return self.per_instance(func, struct, leaves, mask, n, nodes, exc)

    def per_instance(self, func, struct, leaves, mask, n, nodes, cause):
        """Eager fallback: run the group one instance at a time and stack the results."""
        self.stats.fallbacks += n
        kinds = self.stats.groups_by_rule
        kinds["fallback"] = kinds.get("fallback", 0) + 1
        per_slot = None
        for i in range(n):
            li = [x[i] if m else x for x, m in zip(leaves, mask)]
            try:
                outs = _tensors(_call(func, struct, li))
            except Exception as exc:
                inst = nodes[i].instance if nodes is not None and i < len(nodes) else -1
                name = getattr(func, "__name__", repr(func))
                raise InstanceError(inst, f"{name} failed: {type(exc).__name__}: {exc}") from exc
            if per_slot is None:
                per_slot = [[] for _ in outs]
            for s, t in enumerate(outs):
                per_slot[s].append(t)
        return [torch.stack(ts) for ts in per_slot]

    def replay(self, prog, leaves, mask, n, nodes):
        """Run a traced static block on batched inputs, step by step."""
        vals = []
        for step in prog.steps:
            sl, sm = [], []
            for ref in step.refs:
                kind = ref[0]
                if kind == "in":
                    sl.append(leaves[ref[1]])
                    sm.append(mask[ref[1]])
                elif kind == "val":
                    outs, batched = vals[ref[1]]
                    sl.append(outs[ref[2]])
                    sm.append(batched)
                else:
                    sl.append(ref[1])
                    sm.append(False)
            if any(sm):
                shapes = [s if m else tuple(x.shape) for s, m, x in zip(step.shapes, sm, sl)]
                outs = self.call_batched(step.func, step.struct, sl, sm, shapes, n, step.out_descs,
                                         step.grad, nodes, step.info)
                vals.append((outs, True))
            else:
                with torch.set_grad_enabled(step.grad):
                    vals.append((_tensors(_call(step.func, step.struct, sl)), False))
        res = []
        for ref in prog.out_refs:
            kind = ref[0]
            if kind == "in":
                v, b = leaves[ref[1]], mask[ref[1]]
            elif kind == "val":
                outs, b = vals[ref[1]]
                v = outs[ref[2]]
            else:
                v, b = ref[1], False
            res.append(v if b else v.unsqueeze(0).expand(n, *v.shape))
        return res


__all__ = ["Executor", "gather", "stack_leaves", "AutobatchError"]
