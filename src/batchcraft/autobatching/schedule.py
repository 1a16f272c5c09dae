"""Schedulers: the order in which pending (phase, depth, signature) groups run.

* ``"depth"``: group nodes by inline depth and signature; run depth 1, 2, ... Cheap (the
  buckets are filled while recording). DyNet §3.2 "depth-based". With the C core, a recurrent
  cell's per-step chains run as one call and what reads them is re-levelled (``chains.fuse``).
* ``"agenda"``: among nodes whose inputs are ready, run the signature with the lowest average
  depth over its remaining nodes, all its ready nodes at once. DyNet §3.2 "agenda-based"; it
  batches work whose depths differ (chains of different lengths before the same operation).

Phases (``batchcraft.phase``) are scheduled one after another in both.
"""

from __future__ import annotations

import time
from collections import defaultdict

from batchcraft.autobatching import chains as _chains
from batchcraft.autobatching.order import consumer_order, packed_order
from batchcraft.autobatching.signature import SIGNATURES
from batchcraft.autobatching.threadstate import under_transform

_perf = time.perf_counter


#: groups of one operation at one depth with this many input shapes are noted (``stats.shape_splits``)
SPLIT_MIN = 4


def note_shape_splits(groups, stats) -> None:
    """Note operations whose nodes at one (phase, depth) form groups of several input shapes."""
    shapes: dict = {}
    for (phase, depth, sid), _ in groups:
        info = SIGNATURES.by_sid[sid]
        key = (phase, depth, id(info.func))
        entry = shapes.get(key)
        if entry is None:
            shapes[key] = entry = (info.name, set())
        entry[1].add(info.in_dids)
    for name, dids in shapes.values():
        if len(dids) >= SPLIT_MIN:
            stats.note_shape_split(name, len(dids))


class DepthScheduler:
    """Run groups in (phase, depth) order."""

    name = "depth"

    def run(self, rec, executor, stats) -> None:
        t0 = _perf()
        groups = rec.take_buckets()
        groups.sort(key=lambda kv: (kv[0][0], kv[0][1]))
        note_shape_splits(groups, stats)
        # (not under a torch.func transform: nn.GRU / nn.LSTM layers take no batched or dual
        # wrappers, so the chains run step by step as groups there)
        if executor.options.fuse_recurrences and hasattr(rec, "chains") and not rec.hooks and not under_transform():
            # chains.py: a recurrence's steps as one call, what reads them re-levelled
            schedule, groups, merged = _chains.fuse(rec, groups, stats.note_unpacked, stats.syncs > 0)
            stats.groups_merged += merged
        else:
            schedule = [("group", key, nodes) for key, nodes in groups]
        if executor.options.packed_order:
            packed_order(rec, groups)
        if executor.options.consumer_order:
            stats.groups_consumer_ordered += consumer_order(rec, groups, executor.placed_by_rows)
        hoists = executor.plan_hoists(groups)
        stats.schedule_s += _perf() - t0
        executor.begin(groups)
        try:
            for item in schedule:
                if item[0] == "group":
                    key = item[1]
                    executor.run_group(key, item[2], hoists.get((key[0], key[2])))
                else:
                    executor.run_chains(item[1])
        finally:
            executor.end()


class AgendaScheduler:
    """DyNet's agenda: next, the ready signature with the lowest (phase, average depth)."""

    name = "agenda"

    def run(self, rec, executor, stats) -> None:
        t0 = _perf()
        groups = rec.take_buckets()
        remaining: dict = defaultdict(lambda: [0, 0])  # (phase, sid) -> [sum of depths, count]
        ready: dict = defaultdict(list)
        users: dict = defaultdict(list)
        waiting: dict = {}
        pending = set()
        meta = {}
        for (phase, depth, sid), nodes in groups:
            for nd in nodes:
                pending.add(nd)
                meta[nd] = (phase, sid, depth)
        for (phase, depth, sid), nodes in groups:
            sig = (phase, sid)
            r = remaining[sig]
            r[0] += depth * len(nodes)
            r[1] += len(nodes)
            for nd in nodes:
                c = 0
                for p, _ in rec.node_inputs(nd):
                    if p in pending:
                        users[p].append(nd)
                        c += 1
                if c:
                    waiting[nd] = c
                else:
                    ready[sig].append(nd)
        sched = _perf() - t0
        executor.begin(groups)
        try:
            while ready:
                t1 = _perf()
                sig = min(ready, key=lambda s: (s[0], remaining[s][0] / remaining[s][1]))
                nodes = ready.pop(sig)
                r = remaining[sig]
                r[0] -= sum(meta[nd][2] for nd in nodes)
                r[1] -= len(nodes)
                sched += _perf() - t1
                executor.run_group((sig[0], 0, sig[1]), nodes)
                t2 = _perf()
                for nd in nodes:
                    for u in users.pop(nd, ()):
                        c = waiting[u] - 1
                        if c:
                            waiting[u] = c
                        else:
                            del waiting[u]
                            m = meta[u]
                            ready[(m[0], m[1])].append(u)
                sched += _perf() - t2
        finally:
            executor.end()
        stats.schedule_s += sched
        if waiting:  # pragma: no cover - would mean a cycle, impossible for recorded programs
            raise RuntimeError(f"agenda scheduler: {len(waiting)} nodes never became ready")


SCHEDULERS = {"depth": DepthScheduler, "agenda": AgendaScheduler}


def make_scheduler(name: str):
    """Scheduler by name ("depth" or "agenda")."""
    try:
        return SCHEDULERS[name]()
    except KeyError:
        raise ValueError(f"autobatch: scheduler must be one of {sorted(SCHEDULERS)}, got {name!r}") from None
