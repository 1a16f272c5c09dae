"""Execution of recorded groups: gather, one lowered program, results in place.

For each group of nodes with the same (phase, depth, signature):

1. **gather** each per-instance argument into one ``(n, ...)`` tensor following the recorder's
   gather plan (:mod:`plan`, :mod:`gather`): a view when the rows are already in order, one
   ``index_select`` otherwise; ragged list arguments as flat member rows plus segment ids.
   Shared arguments (parameters) are never gathered (ACRoBat §4.3, parameter reuse).
2. **run** the signature's lowered program (:mod:`lower`) under the thread state the nodes were
   recorded in (grad mode, inference mode, autocast).
3. **place** the outputs: in inference, groups of one operation with the same output
   descriptors write into one arena per output (so a later argument drawn from many groups is
   still one ``index_select``); otherwise each group's outputs are buffers of their own.

A program whose step fails falls back step by step (see :mod:`lower`); if even that fails, the
group runs node by node, one instance at a time, and an error names the instance.
"""

from __future__ import annotations

import time
from array import array as _array

import torch

from batchcraft.autobatching import chains as _chains
from batchcraft.autobatching import dedup as _dedup
from batchcraft.autobatching import fuse as _fuse
from batchcraft.autobatching import gather as _gather
from batchcraft.autobatching import hoist as _hoist
from batchcraft.autobatching import lookup as _lookup
from batchcraft.autobatching import rowmm as _rowmm
from batchcraft.autobatching.descs import DESCS, row_bytes
from batchcraft.autobatching.functional import make_leaf
from batchcraft.autobatching.gather import RowRefs, Rows, index_tensor, keep_requires_grad, materialize, take, take_all
from batchcraft.autobatching.lower import Runner
from batchcraft.autobatching.program import Program
from batchcraft.autobatching.signature import LEAF, RAGGED, SIGNATURES, call_with, flatten, rebuild
from batchcraft.autobatching.threadstate import PLAIN, under
from batchcraft.autobatching.threadstate import is_transform_wrapped as _wrapped
from batchcraft.autobatching.threadstate import tangents_possible, under_transform
from batchcraft.errors import AutobatchError, BatchcraftError, InstanceError

_perf = time.perf_counter

#: output arenas only for rows up to this size (bytes, all outputs of a node) and buffers up to
#: ARENA_MAX_BYTES: copying big rows twice costs more than the gathers it saves (MV-RNN h128)
ARENA_MAX_ROW_BYTES = 8192
ARENA_MAX_BYTES = 64 << 20
#: a group whose largest per-instance input has rows of at least this size runs its nodes in that
#: input's source order (``Recorder.order_by_input``): its gather then reads each source buffer's
#: rows in order, with no permutation copy (MV-RNN's word matrices: 16-64 KiB a row)
ORDER_MIN_ROW_BYTES = 4096
# Rows of an output nothing reads (no recorded input, no live lazy value) are left uncomputed where
# only per-node-rows-times-shared-matrix products make that output (lower._cut_output)
DEAD_ROWS = True


class _NoLazy:
    pass


def _row_bytes(rows) -> bytearray:
    """The int64 row map ``rows`` as bytes (``Recorder.place``'s per-node rows); through a list,
    not a write into a tensor over the bytes, which functorch transforms refuse."""
    return bytearray(_array("q", rows.tolist()))


def program_of(info) -> Program:
    prog = info.program
    if prog is None:
        prog = info.program = Program.single(info)
    return prog


#: ``hoisted[2]`` of a signature whose shared prefix failed in this flush (``run_group``)
_PREFIX_FAILED = object()


class Executor:
    """Runs groups of pending nodes as batched programs and records statistics."""

    def __init__(self, rec, stats, options, kernels=None):
        self.rec = rec
        self.stats = stats
        self.options = options
        self.kernels = kernels
        self.runner_key = (kernels, options.fuse_elementwise)  # a program's Runner per (kernels, fusion)
        self.arenas: dict | None = None

    # -- arenas ----------------------------------------------------------------------------------
    def begin(self, groups) -> None:
        """Before running ``groups`` (``[(key, nodes), ...]``): plan one arena per kind of group.

        Groups of one operation with the same output descriptors (e.g. TreeLSTM cells of every
        depth) write their outputs into shared buffers, one per output slot, each group into its
        own rows. Only when no group of the flush runs with grad on: with autograd on, copies into a
        shared buffer would chain the whole buffer through backward, and a grad-mode consumer
        would save rows that later copies overwrite. Each flush allocates its own arenas, so rows
        of an earlier flush are never written again.
        """
        self.arenas = {}
        if not self.options.arenas:
            return
        count: dict = {}
        by_sid = SIGNATURES.by_sid
        if any(by_sid[key[2]].grad for key, _ in groups):
            # a grad-mode consumer in this flush may save an arena row for backward; a later
            # group's copy into the same buffer would then bump its version (a fuzzer find)
            return
        for key, nodes in groups:
            info = by_sid[key[2]]
            if not info.out_dids or info.state[1]:
                continue
            k = (info.func, info.out_dids)
            c = count.get(k)
            if c is None:
                count[k] = [1, len(nodes)]
            else:
                c[0] += 1
                c[1] += len(nodes)
        for k, (ngroups, rows) in count.items():
            row = row_bytes(k[1])
            if ngroups >= 2 and row <= ARENA_MAX_ROW_BYTES and row * rows <= ARENA_MAX_BYTES:
                self.arenas[k] = [None, 0, rows]  # [first buffer id, next free row, capacity]

    def end(self) -> None:
        self.arenas = None

    def _into_arena(self, a, outs, n):
        off = a[1]
        if off + n > a[2]:  # pragma: no cover - the plan counted every node
            return None
        if not all(t.is_contiguous() for t in outs):
            return None  # a copy would change eager's layout (.view() on it may rely on it)
        if any(_wrapped(t) for t in outs):
            return None  # torch.func's batched values have no storage to copy into a plain arena (#193)
        if len(outs) > 1 and any(t._base is not None for t in outs):
            # outputs aliasing each other ((a, a[0])) stay one storage; a view of a temporary
            # (an LSTM cell's squeezed h and c) is copied like any result
            ptrs = [t.untyped_storage().data_ptr() for t in outs]
            if len(set(ptrs)) != len(ptrs):
                return None
        bufs = self.rec.buffers
        self._arena_buffers(a, [(t.shape[1:], t.dtype, t.device) for t in outs])
        first = a[0]
        for s, t in enumerate(outs):
            b = bufs[first + s]
            if b.dtype != t.dtype or b.device != t.device or b.shape[1:] != t.shape[1:]:
                return None
        for s, t in enumerate(outs):
            d = bufs[first + s][off:off + n]
            if t.data_ptr() != d.data_ptr() or t.shape != d.shape or t.stride() != d.stride():
                d.copy_(t)  # (else a fused kernel wrote it there: _arena_rows)
        a[1] = off + n
        return first, off

    def _arena_rows(self, info, n):
        """The rows the next ``n`` nodes of ``info`` will take in their arena, one ``(n, ...)``
        tensor per output (the arena's buffers made here from the output descriptors if no group
        has made them yet), or None where that signature has no arena. No group has read or
        written these rows yet."""
        a = self.arenas.get((info.func, info.out_dids))
        if a is None or a[1] + n > a[2]:
            return None
        self._arena_buffers(a, [DESCS[did] for did in info.out_dids])
        bufs, first, off = self.rec.buffers, a[0], a[1]
        return [bufs[first + s][off:off + n] for s in range(info.n_out)]

    def _arena_buffers(self, a, specs) -> None:
        """Make arena ``a``'s buffers, one per output, if no group has: ``specs`` gives each
        output's per-node ``(shape, dtype, device)``."""
        if a[0] is None:
            bufs = self.rec.buffers
            a[0] = len(bufs)
            for shape, dtype, device in specs:
                bufs.append(torch.empty((a[2], *shape), dtype=dtype, device=device))

    # -- one group -------------------------------------------------------------------------------
    @staticmethod
    def _order_slot(info, prog) -> int:
        """The per-instance input whose source order a group follows (:data:`ORDER_MIN_ROW_BYTES`),
        or -1: the largest one, when its rows are big enough for copies to matter."""
        j = prog.lowered.get("order_slot")
        if j is None:
            sizes = [row_bytes((d,)) for d in info.in_dids[:prog.n_in]]
            big = max(sizes, default=0)
            j = sizes.index(big) if big >= ORDER_MIN_ROW_BYTES and len(sizes) == prog.n_in else -1
            prog.lowered["order_slot"] = j
        return j

    @staticmethod
    def _cuts_pay(info, taken) -> bool:
        """Are the cut output's rows and the rows its products read big enough to be read in place
        (:data:`gather.ROW_REFS_MIN_BYTES`)?"""
        least = _gather.ROW_REFS_MIN_BYTES
        return (row_bytes((info.out_dids[taken.cut_out],)) >= least
                and all(row_bytes((info.in_dids[j],)) >= least for j in taken.rows_ins))

    @staticmethod
    def _dedups(info, prog) -> bool:
        """May groups of ``info`` run once per distinct input (:mod:`dedup`)? Decided once."""
        d = prog.lowered.get("dedup")
        if d is None:  # "probe": eligible by name; its first deduplicated run checks the generator
            d = prog.lowered["dedup"] = "probe" if _dedup.eligible(
                prog, [DESCS[x] for x in info.in_dids[:prog.n_in]]) else False
        return d

    def _lookups(self, info, prog):
        """The tables a group of ``info`` may be placed in (:mod:`lookup`), or None. Decided once."""
        t = prog.lowered.get("lookup", 0)
        if t == 0:
            t = prog.lowered["lookup"] = _lookup.form(prog, [DESCS[x] for x in info.in_dids[:prog.n_in]])
        return t

    def placed_by_rows(self, key, n: int) -> bool:
        """Will the group ``key`` of ``n`` nodes be placed by rows, in any order: deduplicated (at
        its distinct inputs' rows; only once its program has deduplicated) or looked up in place
        (at its ids' rows of the tables)?"""
        info = SIGNATURES.by_sid[key[2]]
        prog = info.program
        if prog is None or not self.options.dedup or info.grad or any(info.out_rg):
            return False
        return (prog.lowered.get("dedup") is True and n >= _dedup.MIN_NODES) or bool(prog.lowered.get("lookup"))

    def runner_of(self, info) -> Runner:
        prog = program_of(info)
        key = self.runner_key
        r = prog.lowered.get(key)
        if r is None:
            r = prog.lowered[key] = Runner(prog, self.kernels, getattr(prog, "ragged_plan", None)
                                           if info.ragged else None, fuse=self.options.fuse_elementwise)
        return r

    def runner_for(self, prog) -> Runner:
        """The runner of a derived (hoisting) program."""
        key = self.runner_key
        r = prog.lowered.get(key)
        if r is None:
            r = prog.lowered[key] = Runner(prog, self.kernels, fuse=self.options.fuse_elementwise)
        return r

    # -- hoisting (hoist.py) -----------------------------------------------------------------------
    def plan_hoists(self, groups) -> dict:
        """(phase, sid) -> [split, groups of that signature (in order), prefix outputs or None, next row]."""
        if not self.options.hoist:
            return {}
        by_sig: dict = {}
        for key, nodes in groups:
            by_sig.setdefault((key[0], key[2]), []).append(nodes)
        out = {}
        by_sid = SIGNATURES.by_sid
        for (phase, sid), gl in by_sig.items():
            if len(gl) < 2:
                continue
            info = by_sid[sid]
            if info.ragged:
                continue
            sp = _hoist.plan(self.rec, program_of(info), gl)
            if sp is not None:
                out[(phase, sid)] = [sp, gl, None, 0]
        return out

    def run_group(self, key, nodes, hoisted=None) -> None:
        if hoisted is not None and hoisted[2] is _PREFIX_FAILED:
            hoisted = None  # (its signature's shared prefix failed: each group runs whole)
        rec = self.rec
        st = self.stats
        info = SIGNATURES.by_sid[key[2]]
        if info.func is make_leaf:
            return self._made_leaves(info, nodes)
        n = len(nodes)
        t0 = _perf()
        runner = self.runner_of(info)
        prog = runner.program
        if hoisted is None and prog.n_ragged == 0:
            j = self._order_slot(info, prog)
            if j >= 0:  # big rows: read the largest argument in its sources' row order
                ordered = rec.order_by_input(nodes, j)
                if ordered is not None:
                    nodes = ordered
                    st.groups_reordered += 1
        bufs = rec.buffers
        # (forward-mode AD or a transform: no raw row reads, lookups or products: they carry no tangent)
        tangents = tangents_possible()
        tables = (self._lookups(info, prog) if hoisted is None and self.options.dedup and not info.grad
                  and not any(info.out_rg) and not rec.hooks and not tangents else None)
        # inputs only fused kernels read stay rows of their buffers (gather.Rows), read in place:
        # only without grad mode or autocast, where the kernels run (else they would be copied anyway)
        plain = hoisted is None and not info.state[0] and info.state[2] is None and not tangents
        dedups = (hoisted is None and n >= _dedup.MIN_NODES and self.options.dedup and not info.grad
                  and not any(info.out_rg) and self._dedups(info, prog))
        with under(info.state):
            taken = runner.prepare() if plain else None  # (lowered before the gathers: a first run reads rows too)
        live = None  # dead rows: nodes whose output taken.cut_out nothing reads go last, uncomputed
        # only where the products read their rows in place (big rows): the reordering costs the
        # consumer order of small rows (order.py), whose products would compute every row anyway
        if (plain and taken.cut_out >= 0 and not dedups and not tables and not info.grad and not rec.hooks
                and DEAD_ROWS and hasattr(rec, "dead_last") and self._cuts_pay(info, taken)):
            got = rec.dead_last(nodes, taken.cut_out)
            if got is not None:
                nodes, live = got
        # gathers too run under the recorded state: a gather under the caller's no_grad (a flush
        # inside a no_grad block) would cut the autograd history of rows recorded with grad on
        with under(PLAIN):  # leaves stacked here are shared by later groups: keep their history
            plans = rec.plan_group(nodes, prog.n_in, prog.n_ragged)
        with under(info.state):
            if hoisted is None:
                # inputs the program never reads are not gathered (None), except where the inputs
                # are keys (deduplication, lookups: they read every input)
                skip = runner.unread_ins if not (dedups or tables) else ()
                ins = take_all(bufs, plans[:prog.n_in], taken.deferred_ins if plain else (),
                               taken.rows_ins if plain else (), skip)  # (RowRefs: rowmm.py)
            else:
                sp = hoisted[0]
                reads = sp.rest_reads
                got = iter(take_all(bufs, [p for p, r in zip(plans, reads) if r]))
                ins = [next(got) if r else None for r in reads]
                if hoisted[2] is None:  # first group of the signature: the prefix for all of them
                    try:
                        hoisted[2] = _hoist.run_prefix(self, sp, [nd for g in hoisted[1] for nd in g])
                    except Exception:
                        # run whole, the groups fall back node by node where they fail, which
                        # names the instance whose operation failed (as without hoisting)
                        hoisted[2] = _PREFIX_FAILED
                        return self.run_group(key, nodes, hoisted)
                    st.groups_by_rule["hoisted"] = st.groups_by_rule.get("hoisted", 0) + 1
                    st.batched_calls += 1
                r0 = hoisted[3]
                ins = ins + [t[r0:r0 + n] for t in hoisted[2]]
                hoisted[3] = r0 + n
                runner = self.runner_for(sp.rest)
            if tables and _lookup.place(rec, nodes, ins[0], tables):
                st.groups_looked_up += 1  # the nodes are rows of the embedding tables: nothing to run
                st.groups_by_rule["lookup"] = st.groups_by_rule.get("lookup", 0) + 1
                st.gather_s += _perf() - t0
                return
            if not info.state[0] and not info.state[1]:
                ins = keep_requires_grad(bufs, plans, ins)
            rags, segs, cnts = [], [], []
            if plain and (taken.deferred_ins or taken.rows_ins):
                st.rows_in_place += sum(type(x) is Rows or type(x) is RowRefs for x in ins)
            if prog.n_ragged:
                seen = set()
                for r, (p, seg, cnt) in enumerate(plans[prog.n_in:]):
                    rags.append(take(bufs, p, plain and r in taken.deferred_rags))
                    st.rows_in_place += type(rags[-1]) is Rows
                    c = prog.ragged_classes[r]
                    if c not in seen:
                        seen.add(c)
                        dev = rags[-1].device
                        segs.append(index_tensor(seg, dev))
                        cnts.append(index_tensor(cnt, dev))
            t1 = _perf()
            fc = _fuse.COUNTS
            c0, s0, d0 = fc.calls, fc.steps, fc.declined
            rows = None  # a deduplicated group: each node's row among its distinct outputs
            dest = None  # arena rows the program's kernels may write its outputs into
            try:
                outs = None
                if dedups:
                    probe = prog.lowered["dedup"] == "probe"
                    got = _dedup.run(runner, n, ins, probe)
                    if got is _dedup.DREW:  # it samples: each node keeps its own draw from now on
                        prog.lowered["dedup"] = False
                    elif got is not None:
                        outs, rows, saved = got
                        st.groups_deduplicated += 1
                        st.rows_deduplicated += saved
                        if probe:
                            prog.lowered["dedup"] = True
                if outs is None:
                    if (plain and runner.writes_outputs and self.arenas and not info.grad and not info.state[1]
                            and not under_transform()):  # (a transform's values have no rows to write into)
                        dest = self._arena_rows(info, n)
                    skipped = _rowmm.skipped_rows()
                    outs = runner(n, ins, rags, segs, cnts, dest, taken, live)
                    if live is not None:  # (only rows a product really left: not a fallback's)
                        st.rows_dead += _rowmm.skipped_rows() - skipped
                m = n if rows is None else n - saved  # (a deduplicated group: its distinct rows)
                if len(outs) != info.n_out or any(t.shape[0] != m for t in outs):
                    raise AutobatchError(f"{info.name}: batched outputs of the wrong shape")
            except BatchcraftError as exc:
                if isinstance(exc, InstanceError):
                    raise
                rows = None
                outs = self.per_instance_group(info, nodes, self._all_inputs(ins, plans), rags, plans, exc)
            except Exception as exc:
                rows = None
                outs = self.per_instance_group(info, nodes, self._all_inputs(ins, plans), rags, plans, exc)
            # (rows a product could not read in place were copied after all)
            st.rows_in_place -= sum(type(x) is RowRefs and x.copied for x in ins)
            if fc.calls != c0 or fc.declined != d0:
                st.fused_kernels += fc.calls - c0
                st.steps_fused += fc.steps - s0
                st.fused_declined += fc.declined - d0
        if runner.fuse_error:
            st.note_fallback(f"{info.name}: elementwise fusion off ({runner.fuse_error})", n)
        if runner.rewrite_error:
            st.note_fallback(f"{info.name}: products not accumulated ({runner.rewrite_error})", n)
        if runner.lower_error:
            st.note_fallback(f"{info.name}: runs its checked program ({runner.lower_error})", n)
        if runner.fallback_steps:
            st.fallbacks += n * runner.fallback_steps
            for reason in runner.fallbacks.values():  # (a one-step program's step has its name)
                st.note_fallback(reason if reason.startswith(f"{info.name}: ") else f"{info.name}: {reason}", n)
        placed = None
        if rows is None and self.arenas and not info.grad and not info.state[1]:
            # (a group of the same op recorded with grad on must keep its own autograd history)
            a = self.arenas.get((info.func, info.out_dids))
            if a is not None:
                if dest is not None and len(outs) == len(dest) and all(o is d for o, d in zip(outs, dest)):
                    placed = (a[0], a[1])  # the kernels wrote every output into its arena rows
                    a[1] += n
                else:
                    placed = self._into_arena(a, outs, n)
        if placed is None and dest is not None:
            # kernels wrote into arena rows that the arena did not take (outputs that alias, as
            # ``h, h[4:]``): the rows stay this group's, so no later group writes over an output or a
            # view of one (comparing start pointers missed views at an offset: reliability #325)
            self.arenas[(info.func, info.out_dids)][1] += n
        if placed is not None:
            rec.place(nodes, placed[0], placed[1])
        else:
            buf = len(bufs)
            bufs.extend(outs)
            if rows is None:
                rec.place(nodes, buf, 0)
            else:  # the distinct outputs are the buffers, each node at its row; a value handed
                rec.place(nodes, buf, _row_bytes(rows))  # out gets rows of its own (value_of)
                rec.shared_rows[buf] = len(outs)
        if rec.hooks:
            rec.attach_hooks(nodes)
        st.gather_s += t1 - t0
        st.kernel_s += _perf() - t1
        st.batched_calls += 1
        kinds = st.groups_by_rule
        if hasattr(info.func, "record_in"):
            kname = "ragged_block" if info.ragged else "block"
        else:
            kname = next(iter(runner.rules), "op")
        kinds[kname] = kinds.get(kname, 0) + 1

    def _made_leaves(self, info, nodes) -> None:
        """``requires_grad_()`` on per-instance values: each instance's value becomes a leaf tensor
        of its own, handed out as its value (its ``.grad`` is eager's), and their stack feeds later
        groups. Before, one batched leaf held every instance's row, and the value an instance
        returned was a row view of it, with no ``.grad`` (reliability #260)."""
        rec = self.rec
        t0 = _perf()
        with under(PLAIN):
            (plan,) = rec.plan_group(nodes, 1, 0)
            x = take(rec.buffers, plan)
        with under(info.state):
            leaves = [x[i].detach().clone().requires_grad_(True) for i in range(len(nodes))]
            out = torch.stack(leaves)
        buf = len(rec.buffers)
        rec.buffers.append(out)
        rec.place(nodes, buf, 0)
        rec.own_values.update(zip(nodes, leaves))
        if rec.hooks:
            rec.attach_hooks(nodes)
        self.stats.gather_s += _perf() - t0
        self.stats.batched_calls += 1
        kinds = self.stats.groups_by_rule
        kinds["made_leaf"] = kinds.get("made_leaf", 0) + 1

    # -- fused recurrences (chains.py) --------------------------------------------------------------
    def run_chains(self, unit) -> None:
        """Run every chain of one cell signature as one recurrent-layer call (:mod:`chains`)."""
        rec = self.rec
        st = self.stats
        t0 = _perf()
        rows, sizes, last, heads = _chains.packed(unit.chains)
        spec, info = unit.spec, unit.info
        with under(PLAIN):
            (px,) = rec.plan_slots(rows, (spec.x,))
            ps = rec.plan_slots(heads, spec.states)
        bufs = rec.buffers
        with under(info.state):
            x = take(bufs, px)
            states = [take(bufs, p) for p in ps]
            t1 = _perf()
            lin = self.kernels.linear if self.kernels is not None else None
            outs, stepwise = _chains.run(spec, x, states, sizes, last, lin, self.options.fuse_elementwise)
        buf = len(bufs)
        bufs.extend(outs)
        rec.place(rows, buf, 0)
        st.gather_s += t1 - t0
        st.kernel_s += _perf() - t1
        st.batched_calls += 1
        st.recurrences_stepwise += stepwise
        name = "fused_" + spec.kind
        st.groups_by_rule[name] = st.groups_by_rule.get(name, 0) + 1

    # -- the last resort: node by node -------------------------------------------------------------
    def _all_inputs(self, ins, plans):
        """``ins`` with the inputs a hoisted rest did not read gathered too (for the original func)."""
        return [take(self.rec.buffers, plans[j]) if t is None else materialize(t) for j, t in enumerate(ins)]

    def per_instance_group(self, info, nodes, ins, rags, plans, cause):
        """Run each node of the group alone, on its own rows; stack the outputs."""
        rags = [materialize(x) for x in rags]
        rec = self.rec
        n = len(nodes)
        self.stats.fallbacks += n
        reason = f"{type(cause).__name__}: {cause}"
        self.stats.note_fallback(f"{info.name}: whole group one instance at a time ({reason})", n)
        func = info.func.fn if hasattr(info.func, "record_in") else info.func
        lens_all = rec.group_lens(nodes) if info.ragged else None
        offsets = [0] * len(rags)
        # in instance order (ragged lists: in the group's, which their offsets follow), so that
        # the earliest instance whose node fails names the error, as eager's order would
        order = range(n) if info.ragged else sorted(range(n), key=lambda k: rec.node_inst(nodes[k]))
        outs: list = [None] * n
        for i in order:
            nd = nodes[i]
            try:
                with under(info.state):
                    if info.ragged:
                        args = self._ragged_args(info, i, ins, rags, lens_all[i], offsets)
                        out = func(*args)
                    else:
                        lz = iter([x[i] for x in ins])
                        leaves = [next(lz) if k else sh for k, sh in zip(info.leaf_kinds, info.shared)]
                        out = call_with(func, info.struct, leaves)
            except Exception as exc:
                err = InstanceError(rec.node_inst(nd), f"{info.name} failed: {type(exc).__name__}: {exc}")
                err.failed_node = nd  # (the runtime finishes only what its instance recorded before it)
                raise err from exc
            flat: list = []
            flatten(out, flat, _NoLazy)
            outs[i] = flat
        return [torch.stack([o[s] for o in outs]) for s in range(len(outs[0]))]

    @staticmethod
    def _ragged_args(info, i, ins, rags, lens, offsets):
        pattern = info.struct[1]
        args, j, r = [], 0, 0
        for p in pattern:
            if type(p) is int:
                args.append(ins[j][i])
                j += 1
            elif type(p) is tuple and p and p[0] is RAGGED:
                if p[1]:
                    k = lens[r]
                    rows = rags[r][offsets[r]:offsets[r] + k]
                    offsets[r] += k
                    args.append(list(rows.unbind(0)))
                    r += 1
                else:
                    args.append([])
            else:
                args.append(rebuild(p, iter(())))
        return args


__all__ = ["Executor", "program_of", "ARENA_MAX_ROW_BYTES", "ARENA_MAX_BYTES", "ORDER_MIN_ROW_BYTES", "LEAF"]
