"""The auto-batching runtime: run instances as fibers, record, schedule, execute.

Each instance runs in its own fiber (a ``greenlet``). Instance code records operations on lazy
values; when it needs a concrete value (``bool(t)``, ``t.item()``, a tensor used as a Python
index, an operation whose output shape depends on values) its fiber yields. When every live
fiber is waiting or finished, all pending work runs as batched groups, and the waiting fibers
resume. Work is never executed twice (executed nodes keep their results) and there is no
deadlock: a waiting fiber only waits for work that is already recorded, and all recorded work
runs at every synchronisation.

Every switch saves the fiber's thread state (grad mode, inference mode, autocast, default
dtype, torch-function modes; :mod:`threadstate`) and gives the scheduler its own back; each
fiber runs in a copy of the caller's ``contextvars`` context. The caller's state after the call
equals its state before, also when an instance raises.

Source: ACRoBat (Fegade et al. 2024) §5, fibers for tensor-dependent control flow; DyNet
(Neubig et al. 2017) for lazy recording and depth/agenda batching.
"""

from __future__ import annotations

import contextvars
import copy as _copy
import warnings
import gc
import time
from sys import getrefcount as _getrefcount
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import greenlet
import torch

from batchcraft.autobatching import attrs as _attrs
from batchcraft.autobatching.blocks import install_train_hook
from batchcraft.autobatching.cells import FAST_CELLS
from batchcraft.autobatching.modcalls import FAST_CALLS, plain_forward_call
from batchcraft.autobatching.devices import SET_DEFAULT_DEVICE, factory_device, global_context, set_global_context
from batchcraft.autobatching.dispatch import FAST_DISPATCH
from batchcraft.autobatching.tensormeta import TENSOR_META
from batchcraft.autobatching.modstate import resolve_module_state
from batchcraft.autobatching import core as _core
from batchcraft.autobatching import buffers as _buffers
from batchcraft.autobatching import functional as _functional
from batchcraft.autobatching import memory as _memory
from batchcraft.autobatching import stack
# loaded with the package rather than inside the first call (10 of its ~40 ms were these imports)
from batchcraft.autobatching import kernels as _kernels
from batchcraft.autobatching import ragged as _ragged  # noqa: F401
from batchcraft.autobatching import views as _views  # noqa: F401
from batchcraft.autobatching.execute import Executor
from batchcraft.autobatching.lazy import ATOMIC_PRINT, ESCAPE_HINT, LazyTensor
from batchcraft.autobatching.schedule import make_scheduler
from batchcraft.autobatching.signature import SIGNATURES, flatten, rebuild
from batchcraft.autobatching.stats import RunStats
from batchcraft.autobatching.threadstate import (DISPATCH_MODES, SAVED_TENSORS_HOOKS, FiberState, autocast_dtypes,
                                                 set_autocast_dtypes, under_transform)
from batchcraft.errors import AutobatchError, BatchcraftError, InstanceError

_perf = time.perf_counter
_PLAIN_FORWARD = plain_forward_call()

try:
    import resource as _resource

    def _minor_faults() -> int:
        return _resource.getrusage(_resource.RUSAGE_SELF).ru_minflt
except ImportError:  # not Unix
    def _minor_faults() -> int:
        return 0


def _instance_error(exc: BaseException, i: int) -> BaseException:
    """What a call raises when instance ``i``'s code raised ``exc``: a ``BatchcraftError`` (with
    ``.instance`` set) or a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``)
    as it is; any other exception as an ``InstanceError`` naming it (its ``__cause__``)."""
    if isinstance(exc, BatchcraftError) and not getattr(exc, "inline", False):
        _tag(exc, i)
        return exc
    if not isinstance(exc, Exception):
        return exc
    # (an inline nested call's InstanceError names the inner instance: wrapped, it names this one)
    err = InstanceError(i, f"{type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def _lazies_beyond(rec, outputs) -> bool:
    """Can a lazy value of ``rec`` be held anywhere but in ``outputs`` (lists, tuples and dicts of
    them)? The C core counts its live lazy values (``n_lazies``). Where every one of them is in the
    outputs, and each lazy value and each container on the way is referenced only from its place
    there (reference counts), instance code stored none on a module (``self.last = h``,
    ``self.history = outs; return outs``), so the scan of the modules' attributes after the call
    (``resolve_module_state``, 30-120 µs for a TreeLSTM) is skipped. True (scan) without the count
    (the Python core) or on any other reference."""
    n = getattr(rec, "n_lazies", None)
    if n is None:
        return True
    occ: dict = {}  # id -> [object, references from the containers of the outputs]
    n_lazy = 0
    stack = [outputs]
    while stack:
        c = stack.pop()
        # (a tuple subclass's own __iter__ may yield other than what it holds: its items, as stored)
        for x in (c.values() if type(c) is dict else tuple.__iter__(c) if isinstance(c, tuple) else c):
            t = type(x)
            if t is LazyTensor:
                if x.rec is not rec:
                    continue
            elif not (t is list or t is dict or isinstance(x, tuple)):
                continue
            e = occ.get(id(x))
            if e is not None:
                e[1] += 1
                continue
            occ[id(x)] = [x, 1]
            if t is LazyTensor:
                n_lazy += 1
            else:
                stack.append(x)
        x = c = None
    if n != n_lazy:
        return True
    for e in occ.values():
        # its references: the containers', occ's entry and getrefcount's argument
        if _getrefcount(e[0]) > e[1] + 2:
            return True
    return False


def _tag(exc, i: int) -> None:
    """Name the instance in a batchcraft error raised by instance code (type kept)."""
    if getattr(exc, "instance", None) is None:
        exc.instance = i
        exc.args = (f"instance {i}: {exc.args[0]}",) + exc.args[1:] if exc.args else exc.args


class _FlushFailed(BaseException):
    """Carries an error of pending work run at a value request of sequential instance code out
    of that code (a ``BaseException``, so ``except Exception`` there lets it pass)."""

    def __init__(self, error: BaseException):
        super().__init__(error)
        self.error = error


class _Wait:
    """Message from a fiber to the scheduler: I need pending work to run."""


_WAIT = _Wait()

_tf_state, _set_tf_state = torch._C._get_torch_function_state, torch._C._set_torch_function_state
_TF_ENABLED = torch._C._TorchFunctionState.ENABLED


class _Cancel:
    """Message from the scheduler to a waiting fiber: the call ended (an error), unwind."""


_CANCEL = _Cancel()


class _Done:
    """Message from a runner fiber to the scheduler: instance finished with ``value``; I am free."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _Finished:
    """What a recorder points to once its call has returned, in place of the runtime.

    The recorder and the runtime (and the recorder and its torch-function mode) refer to each
    other; left so, every call's buffers (the batched results) stayed alive until a cyclic GC
    pass found them, and each call cost a collection (GRU early stop: one 120 ms full collection
    every 20 calls). With the back references replaced, reference counting frees them when the
    call returns.
    """

    def __init__(self, stats):
        self.stats = stats

    def _gone(self, *args):
        raise AutobatchError("a lazy value of a finished batchcraft.autobatch call needed pending work",
                             hint=ESCAPE_HINT)

    wait_for = flush = pending_limit = _gone


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: kept where 3.11's traceback would show it
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]


def _left_text(left: list) -> str:
    if not left:
        return ""
    shown = ", ".join(dict.fromkeys(left[:8]))
    return (f"; left unfinished: {shown}{', ...' if len(left) > 8 else ''} (values stored on modules stay "
            f"lazy until assigned again)")


class Runtime:
    """State of one call of an auto-batched function over a sequence of instances."""

    def __init__(self, fn: Callable, options, fibers: bool | None = None, plans: _attrs.PlanCache | None = None,
                 modules: list | None = None):
        self.fn = fn
        self.plans = plans  # the function's attrs.PlanCache (AutoBatched keeps it across calls)
        self.modules = modules  # what plans.refresh(fn) gave for this call (None: refreshed here)
        self.options = options
        self.fibers = bool(options.fibers) if fibers is None else fibers  # ("auto" is decided by the caller)
        self.scheduler = make_scheduler(options.scheduler)
        self.stats = RunStats()
        self.rec = _core.make_recorder(self, options)
        self.stats.core = self.rec.core
        # the per-instance call of a model: its forward where Module.__call__ would run only that
        self.module_call = _PLAIN_FORWARD if (isinstance(fn, torch.nn.Module) and options.fast_modules
                                              and self.rec.core == "c") else None
        self.stats.fibers = self.fibers
        self.executor = Executor(self.rec, self.stats, options, _kernels.selector(options.kernels))
        self.main = None
        self.exec_time = 0.0
        self.waiter = None  # the greenlet whose value request switched to the scheduler last
        self.cancelling = False  # the call ended: a value request raises GreenletExit (_run_fibers)
        self.main_state: FiberState | None = None
        self.failed_at: int | None = None  # the instance whose code raised (not batched work): _settle
        self.completed: list = []  # then: the outputs of the instances before it (all finished)
        self.nested_fns: list = []  # functions of autobatch calls made inline by instance code
        self.work_error: BaseException | None = None  # the error of batched work (a flush), if one failed

    # -- execution of pending work ------------------------------------------------------------
    def flush(self) -> None:
        """Run every pending node, in batched groups, in scheduler order."""
        rec = self.rec
        if not rec.n_pending:
            return
        if rec.n_pending > self.stats.peak_pending:
            self.stats.peak_pending = rec.n_pending
        t0 = _perf()
        rec.scalar_rows.clear()  # RecorderBase.scalar: lists of the last flush's results
        # no recorder is active while batched programs run: a static block called from batched
        # code must execute, not record (flushes also happen mid-recording: syncs, max_pending)
        stack.push(None)
        try:
            # a flush from inside instance code (fibers=False) may run in its inference mode: the
            # batched work runs outside it (each group under its own recorded state, run_under)
            with torch._C.DisableTorchFunction(), (
                    torch.inference_mode(False) if torch.is_inference_mode_enabled() else nullcontext()):
                self.scheduler.run(rec, self.executor, self.stats)
        except BaseException as err:
            self.work_error = err
            raise
        finally:
            stack.pop()
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
        if self.cancelling:  # (a request from code that swallowed the first GreenletExit)
            raise greenlet.GreenletExit
        cur = greenlet.getcurrent()
        if self.main is None or cur is self.main:
            # no fibers: run everything pending now (correct; batching across later work is lost).
            # A failure there may be another instance's work: it ends the call, as a flush of the
            # fiber scheduler does; instance code's `except Exception` must not catch it
            self.stats.syncs += 1
            try:
                self.flush()
            except Exception as exc:
                raise _FlushFailed(exc) from None
            return
        self.waiter = cur  # resumed by the scheduler: a greenlet of the instance code's own, too
        # torch-function handling is thread state that fibers share and FiberState does not keep:
        # a wait inside DisableTorchFunction (an __index__ that reads a value, called by torch's
        # parser while an output is inferred) must not leave the scheduler, or the caller after
        # an error, with it disabled (a hostile find, stop 49)
        tf = _tf_state()
        if tf is not _TF_ENABLED:
            _set_tf_state(_TF_ENABLED)
        try:
            if self.main.switch(_WAIT) is _CANCEL:
                raise greenlet.GreenletExit
        finally:
            if tf is not _TF_ENABLED:
                _set_tf_state(tf)
        if x is not None and not rec.is_done(x.node):  # pragma: no cover - would be a scheduler bug
            raise AutobatchError(f"internal error: value needed to {why} was not computed")

    # -- instances ----------------------------------------------------------------------------
    def _wrap_instance(self, inst):
        rec = self.rec
        if isinstance(inst, torch.Tensor):
            return rec.input_leaf(inst)
        if isinstance(inst, (tuple, list, dict)):
            leaves: list = []
            st = flatten(inst, leaves, LazyTensor)
            if leaves:
                return rebuild(st, iter([rec.input_leaf(t) if isinstance(t, torch.Tensor) else t for t in leaves]))
        return inst

    def _body(self, i: int, inst):
        if self.module_call is not None:
            return self.module_call(self.fn, self._wrap_instance(inst))
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
        attrs = (_attrs.for_call(self.fn, self.plans, self.modules) if self.options.fast_attributes
                 and self.rec.core == "c" else None) or nullcontext()  # attrs.py
        self.modules = None  # (the plan holds them weakly; nothing of this call keeps them)
        cells = FAST_CELLS if self.options.fast_modules else nullcontext()  # cells.py
        dispatch = FAST_DISPATCH if self.options.fast_modules else nullcontext()  # dispatch.py
        calls = FAST_CALLS if self.options.fast_modules else nullcontext()  # modcalls.py
        meta = TENSOR_META if self.options.fast_modules and self.rec.core == "c" else nullcontext()  # tensormeta.py
        measured = getattr(self.executor.kernels, "n_measured", 0)
        retention = _memory.retain(self.options.retain_memory)
        faults = _minor_faults()
        # signatures recorded under torch.func transforms stay inside them, and none from outside
        # is used there (#190, #195): a namespace of this thread's; the C core's table is not read
        transformed = under_transform()
        isolated = SIGNATURES.isolated() if transformed else nullcontext()
        if transformed and hasattr(self.rec, "sig_table"):
            self.rec.sig_table = 0
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:  # everything after gc.disable() inside: no path leaves GC off or the intercept on
            _functional.intercept_function_apply(True)
            install_train_hook()
            with (isolated, attrs, cells, calls, dispatch, meta, retention, SET_DEFAULT_DEVICE, ATOMIC_PRINT,
                  SAVED_TENSORS_HOOKS, DISPATCH_MODES):
                return self._run(instances, t_start)
        finally:
            try:
                _functional.intercept_function_apply(False)
                self.rec.runtime = _Finished(st)  # no cycle outlives the call (see _Finished)
                self.rec.mode = None  # the mode refers to the recorder too; it was exited above
                st.kernels_measured = getattr(self.executor.kernels, "n_measured", 0) - measured
                st.memory_retained = retention.retained
                st.page_faults = _minor_faults() - faults
            finally:
                if gc_was_enabled:
                    gc.enable()

    def _run(self, instances, t_start):
        st = self.stats
        rec = self.rec
        stack.push(rec)
        mode = rec.mode
        # torch's class while calls record (torchclass.py; the C core's adds its torch.tensor for
        # the recording thread: ccore.FAST_FACTORIES)
        fast = getattr(rec, "fast_calls", None)
        mode.__enter__()
        dtypes = autocast_dtypes()  # kept while autocast is off, so not in the fiber state
        try:
            try:
                self.main_state = FiberState.capture()
                rec.caller_inference = self.main_state.inference  # (recorder.mode_call, _core's leaf_mode_ok)
                with fast or nullcontext():
                    if self.fibers:
                        outputs = self._run_fibers(instances)
                    else:
                        outputs = self._run_sequential(instances)
            finally:
                try:
                    if self.main_state is not None:
                        with torch._C.DisableTorchFunction():  # (its grad-mode switch would reach the mode)
                            self.main_state._apply(True)
                    set_autocast_dtypes(dtypes)  # as eager's autocast exit restores them
                finally:
                    mode.__exit__(None, None, None)
                    stack.pop()
        except BaseException as exc:
            work = self._failed_work(exc)
            if self.failed_at is not None and not (work and exc.instance < self.failed_at):
                exc.completed = None  # (set by _settle; never another call's)
                err = self._settle(exc)
                if err is not exc:
                    raise err from err.__cause__
            elif work:  # (batched work failed first, in eager's order: an instance's code raised later)
                self._after_failed_work(exc)
            raise
        try:
            self.flush()
        except BaseException as exc:
            self._after_failed_work(exc)
            raise
        st.record_s = _perf() - t_start - self.exec_time
        st.ops_recorded = rec.ops_recorded
        st.eager_ops = rec.eager_ops
        with torch._C.DisableTorchFunction():
            results = [self._resolve(o, i) for i, o in enumerate(outputs)]
            self._leave_state(outputs)
        return results

    def _leave_state(self, outputs) -> None:
        """What the instances changed outside their outputs, made eager's once their work ran:
        inputs written in place, running statistics, lazy values stored on modules (scanned for
        only where one can be held beside ``outputs``). Called without torch-function handling."""
        rec = self.rec
        self._write_back()
        _buffers.apply_deferred(rec)
        if _lazies_beyond(rec, outputs):  # (else no lazy value can be on a module: nothing to scan)
            resolve_module_state(self.fn, rec, LazyTensor, self.stats.syncs > 0, self.nested_fns)

    def _settle(self, exc: BaseException) -> BaseException:
        """After instance code raised ``exc``: run the work recorded before it, so that what
        the instances left behind is what eager leaves (reliability #229): values stored on
        modules, buffers re-assigned, inputs written in place. Eager ran the earlier instances,
        and the failing one up to its raise; their recorded work is that. Returns the error to
        raise: ``exc``, or that work's own error where it failed at an earlier instance (eager
        stops there first, #235). Where the work fails at a later instance, ``exc`` gets a note
        naming what was left unfinished (:meth:`_leave_what_ran`)."""
        rec = self.rec
        last = self.failed_at
        # (with fibers, later instances may have recorded writes before the error: eager ran none)
        rec.writebacks[:] = [w for w in rec.writebacks if w[0] <= last]
        rec.deferred[:] = [d for d in rec.deferred if d[0] <= last]
        try:
            self.flush()
            with torch._C.DisableTorchFunction():
                done = [self._resolve(o, k) for k, o in enumerate(self.completed)]
                self._leave_state(())
            exc.completed = done
            return exc
        except Exception as err:
            if self._failed_work(err) and err.instance < last:
                self._after_failed_work(err)
                return err
            left = self._leave_what_ran(last)
            _add_note(exc, f"batchcraft.autobatch: the work recorded before this error could not run "
                           f"({type(err).__name__}: {err})" + _left_text(left))
            return exc

    def _failed_work(self, exc: BaseException) -> bool:
        """Is ``exc`` batched work's error naming the instance whose operation failed?"""
        return exc is self.work_error and isinstance(exc, InstanceError) and exc.instance is not None

    def _after_failed_work(self, err: BaseException) -> None:
        """Batched work failed with ``err`` (an :class:`InstanceError` naming the instance whose
        operation failed): the end-of-call steps for what ran (:meth:`_leave_what_ran`), a note on
        ``err`` naming what could not be finished."""
        if not self._failed_work(err):
            return
        left = self._leave_what_ran(err.instance, err.failed_node)
        if left:
            _add_note(err, "batchcraft.autobatch: the batched work stopped at this error" + _left_text(left))

    def _leave_what_ran(self, last: int, failed_node: int | None = None) -> list:
        """After batched work failed: the end-of-call steps (:meth:`_leave_state`) for the work
        of instances up to ``last`` that ran (eager ran them, and instance ``last`` up to its
        error, ``failed_node``: what it recorded after that operation, such as the later
        instances of a nested ``autobatch`` call, never ran in eager): their inputs written in
        place, their running statistics, the values they stored on modules. Returns what stays
        unfinished because its work did not run (a value stored on a module stays lazy until
        assigned again)."""
        rec = self.rec
        ran = rec.computed

        def reached(inst: int, x) -> bool:  # recorded by eager's run before it stopped
            return inst < last or inst == last and (failed_node is None or x.node < failed_node)

        left: list = []
        try:
            writes = [w for w in rec.writebacks if reached(w[0], w[2])]
            stats = [d for d in rec.deferred if reached(d[0], d[2])]
            rec.writebacks[:] = [w for w in writes if ran(w[2])]
            rec.deferred[:] = [d for d in stats if ran(d[2])]
            left += [f"an input of instance {w[0]} written in place" for w in writes if not ran(w[2])]
            left += [f"a running statistic of instance {d[0]}" for d in stats if not ran(d[2])]
            with torch._C.DisableTorchFunction():
                self._write_back()
                _buffers.apply_deferred(rec)
                resolve_module_state(self.fn, rec, LazyTensor, self.stats.syncs > 0, self.nested_fns, left=left)
        except Exception as err:  # (what could be finished was; the caller's error is what matters)
            left.append(f"the rest ({type(err).__name__}: {err})")
        return left

    def _write_back(self) -> None:
        """Copy in-place updates of instance inputs back into the caller's tensors (as eager).

        Instances whose written inputs share memory (one tensor passed as two instances) are
        written back in instance order, each computed from the original value, where eager's
        writes compound: a ``RuntimeWarning`` says so.
        """
        rec = self.rec
        owners: dict = {}
        for inst, tensor, _ in rec.writebacks:
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            other = owners.setdefault(key, inst)
            if other != inst:
                warnings.warn(f"batchcraft.autobatch: instances {other} and {inst} received the same tensor and "
                              f"wrote it in place; each write started from the original value (eager would "
                              f"apply them one after another)", RuntimeWarning, stacklevel=4)
                break
        for inst, tensor, handle in sorted(rec.writebacks, key=lambda w: w[0]):
            value = rec.resolve(handle)
            # a leaf that requires grad was written without history (``x.data.add_``,
            # ``x.detach().mul_``): its values change, its autograd identity stays, as in eager
            root = tensor._base if tensor._base is not None else tensor  # (an input may be a view: big[i])
            grad = (value.requires_grad or tensor.requires_grad) and not (root.is_leaf and root.requires_grad)
            with torch.set_grad_enabled(grad):
                if value.shape != tensor.shape:  # (``x.resize_(n)``: the caller's tensor is resized)
                    with torch.no_grad():
                        tensor.resize_(value.shape)
                tensor.copy_(value)
        # ``x.requires_grad_(False)`` on an input leaf written without history (reliability #121):
        # the caller's tensor stops requiring grad, as eager's (the same tensor) did
        for tensor, flag in rec.grad_flags.values():
            tensor.requires_grad_(flag)

    def _run_sequential(self, instances):
        """The instances one after another in this greenlet, each under the thread state, context
        variables and default device it would get as a fiber (the caller's): what one instance
        leaves changed does not reach the next, the same in both modes (and so in every call of a
        ``fibers="auto"`` function)."""
        outputs = []
        rec = self.rec
        main_state = self.main_state
        ctx = contextvars.copy_context()
        main_dctx = global_context()
        for i, inst in enumerate(instances):
            rec.instance, rec.phase, rec.inst_steps = i, 0, 0
            try:  # (the instance starts in main_state, current already: the caller's state)
                outputs.append(ctx.copy().run(self._body, i, inst))
            except _FlushFailed as exc:  # another instance's work, run at this one's value request
                raise exc.error  # (its own __cause__ kept: torch's error, as with fibers)
            except BaseException as exc:
                self.failed_at = i
                self.completed = outputs
                err = _instance_error(exc, i)
                if err is exc:
                    raise
                raise err from exc
            finally:
                if not main_state.is_current():  # the instance left the thread state changed
                    fs = main_state.copy()  # (its state as it began; leave() captures what it left)
                    fs.leave(main_state)
                    fs.close()
                if rec.device_changed:
                    set_global_context(main_dctx)
                    rec.set_factory_device(factory_device())
            self._check_pending()
        return outputs

    def _runner(self, i: int, inst):
        """A fiber's body: run instance ``i``, then whichever instance the scheduler hands it next.

        Starting a greenlet costs about 5.8 µs here (Python 3.11 gives it a fresh frame stack,
        mapped on its first switch), resuming one 0.4 µs; most instances never wait (no
        value request), so one fiber runs many of them one after another.
        """
        while True:
            i, inst = self.main.switch(_Done(self._body(i, inst)))

    def _run_fibers(self, instances):
        n = len(instances)
        rec = self.rec
        main_state = self.main_state
        self.main = greenlet.getcurrent()
        ctx = contextvars.copy_context()
        fiber_of: list = [None] * n  # the runner fiber executing instance i
        resume_of: list = [None] * n  # the greenlet that waits for instance i (its fiber or a child)
        idle: list = []  # runners whose instance finished
        runners: list = []
        states = [main_state.copy() for _ in range(n)]
        main_dctx = global_context()
        dctx = [main_dctx] * n  # each fiber's torch.set_default_device context (devices.py)
        outputs: list[Any] = [None] * n
        phases = [0] * n
        steps = [0] * n
        ready = list(range(n))
        started = [False] * n
        max_pending = self.options.max_pending
        m_grad, m_inf, m_dtype = main_state.grad, main_state.inference, main_state.dtype
        m_ac, m_modes, m_po = main_state.autocast, main_state.modes, main_state.printopts
        failure = None  # the error of the earliest instance that raised (failed_at)
        try:
            while ready:
                waiting = []
                for i in ready:
                    if failure is not None and i > self.failed_at:
                        continue
                    rec.instance, rec.phase, rec.inst_steps = i, phases[i], steps[i]
                    fs = states[i]
                    # FiberState.enter's own test, inlined (per instance and wait: the hot loop of
                    # models that wait every step); else the fiber's state is already current
                    if (fs._out_guard is not None or fs.grad is not m_grad or fs.inference is not m_inf
                            or fs.dtype is not m_dtype or fs.autocast != m_ac or fs.modes != m_modes
                            or fs.printopts is not m_po):
                        fs.enter(main_state)
                    if rec.device_changed:  # some fiber set a default device: this one's is its own
                        set_global_context(dctx[i])
                        rec.set_factory_device(factory_device())
                    try:
                        if started[i]:
                            res = resume_of[i].switch()
                        else:
                            started[i] = True
                            g = idle.pop() if idle else None
                            if g is None:
                                g = greenlet.greenlet(self._runner)
                                runners.append(g)
                            g.gr_context = ctx.copy()  # instances see the caller's context variables
                            fiber_of[i] = g
                            res = g.switch(i, instances[i])
                    except BaseException as exc:
                        fs.leave(main_state)
                        if isinstance(exc, _FlushFailed):  # (batched work's error: not the instance's)
                            raise exc.error from None
                        self.failed_at = i
                        if not isinstance(exc, Exception):  # KeyboardInterrupt and the like: at once
                            raise
                        # as eager, which ran the instances in order: the earlier ones, waiting
                        # for values now, run to their end (their error, if one raises, is the
                        # call's); the later ones are not resumed
                        failure = _instance_error(exc, i)
                        continue
                    fs.leave(main_state)
                    if rec.device_changed:
                        dctx[i] = global_context()
                        set_global_context(main_dctx)
                    phases[i], steps[i] = rec.phase, rec.inst_steps
                    if type(res) is _Done:
                        outputs[i] = res.value
                        idle.append(fiber_of[i])
                        fiber_of[i] = None
                        fs.close()
                    elif fiber_of[i].dead:  # the instance code left its fiber another way
                        if isinstance(res, greenlet.GreenletExit):
                            raise res  # `raise GreenletExit` in instance code: propagates, as in eager
                        raise InstanceError(i, "the instance's fiber ended without returning (a greenlet "
                                               "switch out of instance code?)")
                    else:
                        resume_of[i] = self.waiter if self.waiter is not None else fiber_of[i]
                        self.waiter = None
                        waiting.append(i)
                    if max_pending is not None and rec.n_pending >= max_pending:
                        self.flush()
                if waiting:
                    self.stats.syncs += 1
                    self.flush()
                ready = waiting
            if failure is not None:
                self.completed = outputs[:self.failed_at]  # (each finished: the drain above)
                raise failure
        finally:
            self.main = None
            self.cancelling = True
            for j in range(n):  # unwind instances left suspended by an error
                f = fiber_of[j]  # None once its instance finished
                if f is not None and not f.dead:
                    states[j].enter(main_state)
                    if rec.device_changed:
                        set_global_context(dctx[j])
                    try:
                        # resumed as the loop resumes them, with a message that makes the value
                        # request raise GreenletExit: a fiber suspended inside torch's C++ (a wait
                        # in an __index__ torch's parser called) may make torch build an error
                        # there, whose backtrace walks past the fiber's stack into this one's, laid
                        # out as at a resumption; `throw` lays it out otherwise (reliability #270:
                        # a segmentation fault)
                        g = resume_of[j] if resume_of[j] is not None and not resume_of[j].dead else f
                        g.switch(_CANCEL)
                    except BaseException:
                        pass
                    if not f.dead:  # (the instance code kept running: end its fiber as before)
                        try:
                            f.throw(greenlet.GreenletExit)
                        except BaseException:
                            pass
                    states[j].leave(main_state)
                states[j].close()
            self.cancelling = False
            for f in runners:  # idle runners end their loop
                if not f.dead:
                    try:
                        f.throw(greenlet.GreenletExit)
                    except BaseException:
                        pass
            if rec.device_changed:
                set_global_context(main_dctx)
        return outputs

    def _check_pending(self):
        if self.options.max_pending is not None and self.rec.n_pending >= self.options.max_pending:
            self.flush()

    def _resolve(self, out, i, memo=None):
        """Instance ``i``'s output ``out`` with its lazy values resolved (``memo``: those resolved
        so far in it, so that views of its values alias them: ``recorder.resolve``)."""
        if memo is None:
            memo = {}
        t = type(out)
        if t is LazyTensor:
            if out.rec is not self.rec:
                raise InstanceError(i, "the output holds a lazy value of another recorder (a static block's "
                                       "traced value or another call's)")
            return self.rec.resolve(out, memo)
        if t is list:
            return [self._resolve(o, i, memo) for o in out]
        if t is dict:
            return {k: self._resolve(v, i, memo) for k, v in out.items()}
        if isinstance(out, tuple):
            items = [self._resolve(o, i, memo) for o in out]
            if t is tuple:
                return tuple(items)
            return t(*items) if hasattr(t, "_fields") else t(items)  # namedtuple / structseq
        if isinstance(out, (dict, list)):  # OrderedDict, defaultdict, a list subclass: a copy of it
            try:
                new = _copy.copy(out)
                if isinstance(out, dict):
                    for k, v in out.items():
                        new[k] = self._resolve(v, i, memo)
                else:
                    new[:] = [self._resolve(o, i, memo) for o in out]
            except BatchcraftError:
                raise
            except Exception as exc:
                raise InstanceError(i, f"the output is a {t.__name__} holding values batchcraft could not "
                                       f"resolve into a copy of it ({type(exc).__name__}: {exc})",
                                    hint="return a plain dict, list or tuple of the tensors") from exc
            return new
        attrs = getattr(out, "__dict__", None)
        if attrs and any(type(v) is LazyTensor for v in attrs.values()):
            raise InstanceError(i, f"the output is a {t.__name__} object holding a lazy tensor; "
                                   f"batchcraft resolves tensors in tuples, lists and dicts only",
                                hint="return the tensors (e.g. a dict of them) and build the object "
                                     "after the call")
        return out
