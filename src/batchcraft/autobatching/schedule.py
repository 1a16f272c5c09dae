"""Schedulers: the order in which pending (phase, depth, signature) groups run.

* ``"depth"``: group nodes by inline depth and signature; run depth 1, 2, ...
  Cheap (the buckets are filled while recording). DyNet §3.2 "depth-based".
* ``"agenda"``: among nodes whose inputs are ready, run the signature with the
  lowest average depth over its remaining nodes, all its ready nodes at once.
  DyNet §3.2 "agenda-based"; it batches work whose depths differ (chains of
  different lengths before the same operation).

Phases (``batchcraft.phase``) are scheduled one after another in both.
"""

from __future__ import annotations

import time
from collections import defaultdict

from batchcraft.autobatching.graph import Node
from batchcraft.autobatching.lazy import LazyTensor

_perf = time.perf_counter


class DepthScheduler:
    """Run groups in (phase, depth) order."""

    name = "depth"

    def run(self, graph, executor, stats) -> None:
        t0 = _perf()
        buckets = graph.take()
        order = sorted(buckets.items(), key=lambda kv: (kv[0][0], kv[0][1]))
        stats.schedule_s += _perf() - t0
        executor.begin(buckets)
        try:
            for _, nodes in order:
                executor.run_group(nodes)
        finally:
            executor.end()


class AgendaScheduler:
    """DyNet's agenda: next, the ready signature with the lowest (phase, average depth)."""

    name = "agenda"

    def run(self, graph, executor, stats) -> None:
        t0 = _perf()
        buckets = graph.take()
        remaining: dict = defaultdict(lambda: [0, 0])  # sig -> [sum of depths, count]
        ready: dict = defaultdict(list)  # sig -> ready nodes
        users: dict = defaultdict(list)
        waiting: dict = {}
        for (phase, depth, sid), nodes in buckets.items():
            sig = (phase, sid)
            r = remaining[sig]
            r[0] += depth * len(nodes)
            r[1] += len(nodes)
            for nd in nodes:
                c = 0
                for x in nd.leaves:
                    if type(x) is LazyTensor:
                        p = x.node
                        if type(p) is Node and p.outs is None:
                            users[id(p)].append(nd)
                            c += 1
                if c:
                    waiting[id(nd)] = c
                else:
                    ready[sig].append(nd)
        sched = _perf() - t0
        executor.begin(buckets)
        try:
            self._drain(ready, remaining, users, waiting, executor, stats, sched)
        finally:
            executor.end()

    @staticmethod
    def _drain(ready, remaining, users, waiting, executor, stats, sched):
        while ready:
            t1 = _perf()
            sig = min(ready, key=lambda s: (s[0], remaining[s][0] / remaining[s][1]))
            nodes = ready.pop(sig)
            r = remaining[sig]
            r[0] -= sum(nd.depth for nd in nodes)
            r[1] -= len(nodes)
            sched += _perf() - t1
            executor.run_group(nodes)
            t2 = _perf()
            for nd in nodes:
                for u in users.pop(id(nd), ()):
                    k = id(u)
                    c = waiting[k] - 1
                    if c:
                        waiting[k] = c
                    else:
                        del waiting[k]
                        ready[(u.phase, u.info.sid)].append(u)
            sched += _perf() - t2
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
