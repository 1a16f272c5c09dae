"""The auto-batching runtime: run instances as fibers, record, schedule, execute.

Each instance runs in its own fiber (a ``greenlet``). Instance code records
operations on lazy values; when it needs a concrete value (``bool(t)``,
``t.item()``, a tensor used as a Python index, an operation whose output shape
depends on values) its fiber yields. When every live fiber is waiting or
finished, all pending work runs as batched groups, and the waiting fibers
resume. Work is never executed twice (executed nodes keep their results) and
there is no deadlock: a waiting fiber only waits for work that is already
recorded, and all recorded work runs at every synchronisation.

Source: ACRoBat (Fegade et al. 2023) §5, fibers for tensor-dependent control
flow; DyNet (Neubig et al. 2017) for lazy recording and depth/agenda batching.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Sequence

import greenlet
import torch

from batchcraft.autobatching import recorder as _rec
from batchcraft.autobatching.execute import Executor
from batchcraft.autobatching.graph import LeafNode
from batchcraft.autobatching.lazy import LazyTensor
from batchcraft.autobatching.schedule import make_scheduler
from batchcraft.autobatching.signature import flatten, rebuild
from batchcraft.autobatching.stats import RunStats
from batchcraft.errors import AutobatchError, BatchcraftError, InstanceError

_perf = time.perf_counter


def _tag(exc, i: int) -> None:
    """Name the instance in a batchcraft error raised by instance code (type kept)."""
    if getattr(exc, "instance", None) is None:
        exc.instance = i
        exc.args = (f"instance {i}: {exc.args[0]}",) + exc.args[1:] if exc.args else exc.args


class _Wait:
    """Message from a fiber to the scheduler: I need pending work to run."""


_WAIT = _Wait()


class Runtime:
    """State of one call of an auto-batched function over a sequence of instances."""

    def __init__(self, fn: Callable, *, scheduler: str = "depth", fibers: bool = True,
                 max_steps: int | None = None, max_pending: int | None = None,
                 direct_blocks: bool = True, compile_blocks: bool = False):
        self.fn = fn
        self.scheduler = make_scheduler(scheduler)
        self.use_fibers = fibers
        self.max_steps = max_steps
        self.max_pending = max_pending
        self.stats = RunStats()
        self.executor = Executor(self.stats, direct_blocks=direct_blocks, compile_blocks=compile_blocks)
        self.rec = _rec.Recorder(self)
        self.main = None
        self.exec_time = 0.0

    # -- execution of pending work ------------------------------------------------------------
    def flush(self) -> None:
        """Run every pending node, in batched groups, in scheduler order."""
        graph = self.rec.graph
        if not graph.n_pending:
            return
        if graph.n_pending > self.stats.peak_pending:
            self.stats.peak_pending = graph.n_pending
        t0 = _perf()
        # no recorder is active while batched calls run: a static block called inside another
        # block's direct call must execute, not record (flushes also happen mid-recording: syncs,
        # max_pending)
        _rec.push(None)
        try:
            with torch._C.DisableTorchFunction():
                self.scheduler.run(graph, self.executor, self.stats)
        finally:
            _rec.pop()
        self.exec_time += _perf() - t0

    def pending_limit(self) -> None:
        """``max_pending`` nodes wait: run them now (a fiber yields first, so others batch too)."""
        self.wait_for(None, "bound the pending graph (max_pending)")

    def wait_for(self, x: LazyTensor | None, why: str) -> None:
        """Called by instance code that needs the value of pending ``x``."""
        rec = self.rec
        if rec.max_steps is not None:
            rec.inst_steps += 1
            if rec.inst_steps > rec.max_steps:
                rec.step_limit()
        cur = greenlet.getcurrent()
        if self.main is None or cur is self.main:
            # no fibers: run everything pending now (correct; batching across later work is lost)
            self.stats.syncs += 1
            self.flush()
            return
        # Inside a TorchFunctionMode handler torch has stashed our mode; put it back while other
        # fibers run, so that their calls are still intercepted, and take it out again after.
        stashed = torch._C._len_torch_function_stack() == 0
        if stashed:
            torch._C._push_on_torch_function_stack(self.rec.mode)
        try:
            self.main.switch(_WAIT)
        finally:
            if stashed:
                torch._C._pop_torch_function_stack()
        if x is not None and x.node.outs is None:  # pragma: no cover - would be a scheduler bug
            raise AutobatchError(f"internal error: value needed to {why} was not computed")

    # -- instances ----------------------------------------------------------------------------
    def _wrap_instance(self, inst):
        if isinstance(inst, torch.Tensor):
            return self.rec.leaf(inst)
        if isinstance(inst, (tuple, list, dict)):
            leaves: list = []
            st = flatten(inst, leaves)
            if leaves:
                return rebuild(st, iter([self.rec.leaf(t) if isinstance(t, torch.Tensor) else t
                                         for t in leaves]))
        return inst

    def _body(self, i: int, inst):
        return self.fn(self._wrap_instance(inst))

    def run(self, instances: Sequence) -> list:
        instances = list(instances)
        st = self.stats
        st.instances = len(instances)
        if not instances:
            return []
        t_start = _perf()
        # Recording allocates many small objects; cyclic GC passes over them cost more than the
        # recording itself, and the graph has no cycles to collect. Re-enabled on exit.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(instances, t_start)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _run(self, instances, t_start):
        st = self.stats
        _rec.push(self.rec)
        mode = self.rec.mode
        mode.__enter__()
        try:
            if self.use_fibers:
                outputs = self._run_fibers(instances)
            else:
                outputs = self._run_sequential(instances)
        finally:
            mode.__exit__(None, None, None)
            _rec.pop()
        self.flush()
        st.record_s = _perf() - t_start - self.exec_time
        st.ops_recorded = self.rec.ops_recorded
        st.eager_ops = self.rec.eager_ops
        return [self._resolve(o, i) for i, o in enumerate(outputs)]

    def _run_sequential(self, instances):
        outputs = []
        rec = self.rec
        for i, inst in enumerate(instances):
            rec.instance, rec.phase, rec.inst_steps = i, 0, 0
            try:
                outputs.append(self._body(i, inst))
            except BatchcraftError as exc:
                _tag(exc, i)
                raise
            except Exception as exc:
                raise InstanceError(i, f"{type(exc).__name__}: {exc}") from exc
            self._check_pending()
        return outputs

    def _run_fibers(self, instances):
        n = len(instances)
        rec = self.rec
        self.main = greenlet.getcurrent()
        fibers = [greenlet.greenlet(self._body) for _ in range(n)]
        outputs: list[Any] = [None] * n
        phases = [0] * n
        steps = [0] * n
        ready = list(range(n))
        started = [False] * n
        try:
            while ready:
                waiting = []
                for i in ready:
                    rec.instance, rec.phase, rec.inst_steps = i, phases[i], steps[i]
                    try:
                        if started[i]:
                            res = fibers[i].switch()
                        else:
                            started[i] = True
                            res = fibers[i].switch(i, instances[i])
                    except BatchcraftError as exc:
                        _tag(exc, i)
                        raise
                    except Exception as exc:
                        raise InstanceError(i, f"{type(exc).__name__}: {exc}") from exc
                    phases[i], steps[i] = rec.phase, rec.inst_steps
                    if fibers[i].dead:
                        outputs[i] = res
                    else:
                        waiting.append(i)
                    self._check_pending()
                if waiting:
                    self.stats.syncs += 1
                    self.flush()
                ready = waiting
        finally:
            self.main = None
            for j, f in enumerate(fibers):  # unwind fibers left suspended by an error
                if started[j] and not f.dead:
                    try:
                        f.throw(greenlet.GreenletExit)
                    except Exception:
                        pass
        return outputs

    def _check_pending(self):
        if self.max_pending is not None and self.rec.graph.n_pending >= self.max_pending:
            self.flush()

    def _resolve(self, out, i):
        with torch._C.DisableTorchFunction():
            return self._resolve_(out, i)

    def _resolve_(self, out, i):
        t = type(out)
        if t is LazyTensor:
            nd = out.node
            if type(nd) is LeafNode:
                return nd.value
            if nd.outs is None:  # pragma: no cover
                raise AutobatchError(f"internal error: output of instance {i} was not computed")
            v = nd.outs[out.slot][nd.row]
            # the batched result requires grad if any instance's does; this instance's may not
            return v.detach() if (v.requires_grad and not nd.requires_grad) else v
        if t is list:
            return [self._resolve_(o, i) for o in out]
        if t is dict:
            return {k: self._resolve_(v, i) for k, v in out.items()}
        if isinstance(out, tuple):
            items = [self._resolve_(o, i) for o in out]
            if t is tuple:
                return tuple(items)
            return t(*items) if hasattr(t, "_fields") else t(items)  # namedtuple / structseq
        attrs = getattr(out, "__dict__", None)
        if attrs and any(type(v) is LazyTensor for v in attrs.values()):
            raise InstanceError(i, f"the output is a {t.__name__} object holding a lazy tensor; "
                                   f"batchcraft resolves tensors in tuples, lists and dicts only",
                                hint="return the tensors (e.g. a dict of them) and build the object "
                                     "after the call")
        return out
