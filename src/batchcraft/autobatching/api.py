"""Public API of auto-batching: ``autobatch`` and ``phase``."""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch

from batchcraft.autobatching import stack
from batchcraft.autobatching.attrs import PlanCache
from batchcraft.autobatching.modcalls import backward_hooked
from batchcraft.autobatching.options import Options
from batchcraft.autobatching.runtime import Runtime
from batchcraft.autobatching.stats import RunStats
from batchcraft.errors import BatchcraftError, InstanceError


def caller_modes() -> list:
    """What the caller has active around the call that must see every instance's operations, as
    in eager: torch-function modes other than torch's own default-device context
    (``torch.set_default_device``, ``with torch.device(...)``: batchcraft applies it itself,
    devices.py), torch-dispatch modes (``FlopCounterMode``, counting modes: they would see the
    batched kernels), and ``DisableTorchFunction`` / ``DisableTorchFunctionSubclass`` (recording
    needs torch-function dispatch). Names for the reason, empty when none."""
    from torch.utils._device import DeviceContext

    found = []
    if not torch._C._is_torch_function_enabled():
        found.append("DisableTorchFunction")
    elif torch._C._is_torch_function_mode_enabled():
        for i in range(torch._C._len_torch_function_stack()):
            m = torch._C._get_function_stack_at(i)
            if type(m) is not DeviceContext:  # (a subclass may override what it does: the user's)
                found.append(type(m).__name__)
    for i in range(torch._C._len_torch_dispatch_stack()):
        found.append(type(torch._C._get_dispatch_stack_at(i)).__name__)
    return found


def _one_by_one(fn, instances, inline: bool = False) -> list:
    """``[fn(x) for x in instances]``; an instance's error as a batched call raises it: a
    ``BatchcraftError`` with ``.instance`` set, any other exception as an ``InstanceError``.
    ``inline``: a call made inside another call's instance code. Its ``BatchcraftError`` may be
    the outer call's (a step limit) and is left as it is; its ``InstanceError`` is marked
    ``inline``, so that the outer call, if it gets it, names its own instance (reliability #236)."""
    out = []
    for i, x in enumerate(instances):
        try:
            out.append(fn(x))
        except BatchcraftError as exc:
            if not inline and getattr(exc, "instance", None) is None:
                exc.instance = i
            raise
        except Exception as exc:
            err = InstanceError(i, f"{type(exc).__name__}: {exc}")
            err.inline = inline
            raise err from exc
    return out


class AutoBatched:
    """A per-instance function made to run over a sequence of instances; see :func:`autobatch`.

    Attributes:
        options (Options): how it records, schedules and executes.
        stats (RunStats): statistics of the last call (empty before the first).
    """

    def __init__(self, fn: Callable, options: Options):
        self.fn = fn
        self.options = options
        self.stats = RunStats()
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self._warned_modes = False
        # fibers="auto": did a call of this function see a value wait? (None: no call finished yet)
        self._waits: bool | None = None
        self._sizes: tuple | None = None  # (nodes, inputs) the last call recorded (C core)
        self._plans = PlanCache()  # the module-attribute descriptors' plan of the last call (attrs.py)

    def __call__(self, instances: Sequence) -> list:
        if isinstance(instances, torch.Tensor):
            raise TypeError(
                f"{self.__name__}: autobatch takes a sequence of instances, got one Tensor of shape "
                f"{tuple(instances.shape)}; pass a list (e.g. list(x) for one instance per row, or [x] "
                f"for a single instance)")
        if isinstance(instances, (str, bytes)) or not hasattr(instances, "__len__"):
            instances = list(instances)
        outer = stack.current()
        if outer is not None:
            # called from inside instance code of another autobatch call: run inline, so the
            # outer call records (and batches) this work with everything else; the outer call
            # also resolves what this function's modules keep (reliability #230)
            nested = getattr(getattr(outer, "runtime", None), "nested_fns", None)
            if nested is not None and not any(f is self.fn for f in nested):
                nested.append(self.fn)
            self.stats = RunStats(instances=len(instances))
            return _one_by_one(self.fn, instances, inline=True)  # (errors as a call of its own raises them)
        modes = caller_modes()
        if modes:
            return self._eager(instances, f"a mode active around the call ({', '.join(modes)}) must see every "
                                          f"operation of every instance, as in eager",
                               "to batch the rest, enter a torch-function mode inside the per-instance function "
                               "around only the code it must see: the calls under it run per instance, the others "
                               "batch")
        modules = self._plans.refresh(self.fn)  # (walked only when the module tree changed)
        hooked = backward_hooked(modules)
        if hooked:
            return self._eager(instances, f"{hooked}: backward hooks see each instance's gradients only when it "
                                          f"runs alone",
                               "to batch, remove the backward hooks while calling it (forward hooks are fine)")
        fibers = self.options.fibers
        if fibers == "auto":
            fibers = self._waits is not False
        rt = Runtime(self.fn, self.options, fibers, self._plans, modules)
        if self._sizes is not None and hasattr(rt.rec, "reserve"):
            rt.rec.reserve(*self._sizes)  # the C core's arrays, sized as the last call's
        try:
            return rt.run(instances)
        finally:
            self.stats = rt.stats
            if hasattr(rt.rec, "sizes"):
                self._sizes = rt.rec.sizes()
            if self._waits is not True and len(instances):  # a wait once: fibers from then on
                self._waits = rt.stats.syncs > 0

    def _eager(self, instances, why: str, hint: str) -> list:
        """Run the instances one at a time, as eager, counted as fallbacks with the reason; an
        instance's error names it, as in a batched call (``max_steps`` does not apply)."""
        reason = f"{why}: the instances ran one at a time"
        st = RunStats(instances=len(instances), fallbacks=len(instances), fibers=False)
        st.note_fallback(reason, len(instances))
        self.stats = st
        if not self._warned_modes:
            self._warned_modes = True
            warnings.warn(f"{self.__name__}: {reason} ({hint}; see RunStats.fallback_reasons)",
                          RuntimeWarning, stacklevel=3)
        return _one_by_one(self.fn, instances)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.as_dict().items() if v != Options().as_dict()[k])
        return f"autobatch({self.__name__}{', ' + opts if opts else ''})"


def autobatch(fn: Callable, *, scheduler: str = "depth", fibers: bool | str = "auto", max_steps: int | None = None,
              max_pending: int | None = None, core: str = "auto", ragged: bool = True, hoist: bool = True,
              kernels: str = "auto", arenas: bool = True, packed_order: bool = True,
              consumer_order: bool = True, dedup: bool = True, fuse_recurrences: bool = True,
              fuse_elementwise: bool = True, fast_attributes: bool = True, fast_factories: bool = True,
              fast_modules: bool = True, retain_memory: bool = True, compile_blocks: bool | None = None) -> AutoBatched:
    """Return a callable that runs per-instance ``fn`` over many instances in batches.

    ``fn`` is ordinary PyTorch code for *one* instance: torch functions, Tensor methods and
    operators, ``nn.Module`` calls, recursion and loops whose structure depends on the instance,
    branches on tensor values (each instance runs in a fiber that waits while pending work runs
    batched), in-place updates of its own tensors. Tensors that ``fn`` receives in its instance
    or creates (``torch.tensor(word_id)``) are per-instance data and are batched too;
    parameters and other tensors from outside are shared and passed once to each batched call.

    Args:
        fn (callable): ``fn(instance) -> tensor | nested tuple/list/dict of tensors``.
        scheduler (str): ``"depth"`` (default) or ``"agenda"`` (DyNet's agenda-based batching:
            lowest average depth first).
        fibers (bool | str): ``True``: run each instance in a fiber, so that instances that wait
            for a value (``if h.sum() > 0``, ``.item()``) wait together and their pending work
            runs batched. ``False``: instances run one after another, and a value request
            executes all pending work at once (correct; the waits do not batch). ``"auto"``
            (default): fibers until a call finishes in which no instance waited, then one after
            another (no fiber switches: about 3% of a TreeLSTM batch here), and fibers for good
            once an instance of a later call waits. Either way each instance starts from the
            caller's thread state (grad and inference mode, default dtype, autocast, modes, print
            options), context variables and default device, and an error of pending work run at
            a value request ends the call (instance code's ``except`` does not see it).
        max_steps (int | None): stop an instance that records more operations plus
            synchronisations than this without finishing (StepLimitError).
        max_pending (int | None): execute pending work early once this many nodes wait,
            bounding the memory of the recorded graph.
        core (str): ``"auto"`` (default: the C recording core when it was built), ``"c"``,
            ``"python"`` (the pure-Python reference core).
        ragged (bool): static blocks' list arguments keyed as empty / non-empty where the trace
            allows it, so nodes with any number of children run as one group. Default: True.
        hoist (bool): run input projections of recurrent cells for all steps at once. Default: True.
        kernels (str): batched matrix multiplies: ``"auto"`` (the backend measured fastest here,
            cached per machine), ``"default"`` (PyTorch's) or ``"onednn"``.
        arenas (bool): in inference, groups of one operation write into shared buffers.
        packed_order (bool): depth scheduler: the nodes of a recurrence (a cell called once per
            step) run longest instance first, as in a packed sequence, so each step reads the
            previous step's state as a view instead of gathering it. Default: True.
        consumer_order (bool): depth scheduler: the rows of a signature that runs as one group
            in a flush (per-node input projections) are laid out in the order later groups read
            them, which then read views instead of gathering rows. Default: True.
        dedup (bool): in inference, a group whose per-instance inputs are integer scalars
            (``torch.tensor(word_id)``) and that does matrix products runs once per distinct
            input tuple, and each node reads its input's row (per call; nothing is cached
            across calls); a group that only looks big rows up in embedding tables (MV-RNN's word
            matrices) is not run at all: its nodes are the tables' rows, read by their readers'
            gathers (``lookup.py``, ``stats.groups_looked_up``). Default: True.
        fuse_recurrences (bool): depth scheduler, C core: all per-step chains of a recurrent cell
            block (``static_block(nn.LSTMCell(...))``, ``GRUCell``, ``RNNCell``) in a flush run as
            one packed ``nn.LSTM``-kind layer call, where the recording proves it equivalent
            (``chains.py``; ACRoBat/DyNet run one batched cell per step). Default: True.
        fuse_elementwise (bool): in a batched program, runs of elementwise steps (``sigmoid``,
            ``tanh``, ``+``, ``*``, ``chunk``...) on float32 CPU values run as one C kernel pass
            over the rows (``fuse.py``) when nothing needs autograd; sigmoid / tanh / exp then
            agree with torch's within a few float32 units in the last place. Default: True.
        compile_blocks: deprecated, no effect (it did nothing since the v2 core; ``fuse_elementwise``
            is what fuses a block's elementwise tail). Passing it warns.
        fast_attributes (bool): C core: while the call records, ``self.cell`` (a submodule,
            parameter or buffer read) is found on the module's class by a C descriptor doing
            ``nn.Module.__getattr__``'s lookups, instead of through Python 3.11's formatted-and-
            dropped ``AttributeError`` and ``__getattr__`` (about 1 µs a read). Default: True.
        fast_factories (bool): C core: while the call records, ``torch``'s class is a module
            subclass whose ``torch.tensor`` reads, in the recording thread with the recording
            mode innermost and from a function of the instance code, as a C function that makes
            ``torch.tensor(python scalar)`` leaves without torch's dispatch to the mode (about
            1 µs -> 0.4 µs a call). Every other reader (other threads, module and class bodies,
            a torch-function mode's handler, torch's own code such as TorchScript, code under
            ``DisableTorchFunction``) gets the real ``torch.tensor`` object. Visible difference:
            inside instance functions ``torch.tensor is t`` is False for a ``t`` read before
            the call (the function is named ``torch.tensor``); ``type(torch)`` is not
            ``types.ModuleType`` meanwhile. The same descriptors make the common torch functions
            (``torch.sigmoid``, ``torch.cat``, ``torch.sum``...: ``ccore.FAST_TORCH_FUNCTIONS``)
            record a call on a lazy value directly (about 1.0 -> 0.6 µs); read in instance code
            they are equal to torch's functions but not identical (reliability #151). Default: True.
        fast_modules (bool): while the call records, ``nn.LSTMCell``, ``nn.GRUCell`` and
            ``nn.RNNCell`` called on this call's per-instance values record their input
            projection and gates directly instead of running torch's Python ``forward`` (two
            operations instead of five: 14 -> 7 µs a call here), and the Python functions of
            ``torch.nn.functional`` (``F.relu``, ``F.embedding``, ``F.layer_norm``, so
            ``nn.ReLU``, ``nn.Embedding``...) reach the recorder without torch's Python dispatch
            (1.7 µs a call); with the C core, ``nn.Linear``, ``nn.Embedding`` and the cells called
            on a lazy value skip ``Module.__call__`` when no hook or wrapper would run (1.75 -> 0.9
            µs for a Linear). Other threads, calls outside recording and subclasses with their own
            ``forward`` see torch's own functions. Default: True.
        retain_memory (bool): where the C library is glibc, while the call runs ``malloc`` takes
            memory from the heap instead of fresh ``mmap`` pages (``mallopt(M_MMAP_MAX, 0)``,
            restored after the call), and up to 1 GiB of free heap stays mapped between calls,
            so a call reuses the previous call's pages instead of faulting its working set in
            again: MV-RNN h128 here went from 73,000 page faults and 0.7 s of kernel time a call
            to none. The process keeps that memory between calls, as a caching allocator would;
            ``batchcraft.autobatching.memory.release()`` returns it. Default: True.
    Returns:
        AutoBatched: ``f(instances) -> list`` with ``f(xs)[i]`` equal to ``fn(xs[i])``
        (as ordinary tensors, differentiable); ``f.stats`` describes the last call. Called with a
        torch-function or torch-dispatch mode of the caller's active (``with Mode(): f(xs)``,
        ``FlopCounterMode``) or torch-function dispatch disabled around it, the instances run one
        at a time as in eager, so that the mode sees each of their operations (counted in
        ``f.stats.fallbacks``, a ``RuntimeWarning`` once). A torch-function mode entered inside
        ``fn`` sees the calls under it on the instance's values (they run per instance, counted in
        ``f.stats.fallback_reasons``; the rest of ``fn`` batches); a static block called under it,
        and a ``TorchDispatchMode`` of the user's entered inside ``fn``, raise ``AutobatchError``.
    Raises:
        ValueError: unknown option value.
        TypeError: ``instances`` is one Tensor (pass a list of instances).
        InstanceError: ``fn`` raised for an instance (``.instance`` is its index); the whole
            call fails and returns nothing. The work recorded before the error runs first, so
            modules, buffers and inputs written in place are left as eager leaves them, and the
            error's ``completed`` holds the results of the instances before the failing one
            (None where that work failed too).
    Differences from eager:
        The outputs of one call share one autograd graph (that is what batching means): sum
        the losses and call ``backward()`` once, or pass ``retain_graph=True`` to backward
        through several outputs separately. A NaN/inf in one instance's input makes the
        gradients of shared weights NaN for the whole call (0 * NaN in the batched weight
        gradient), even for other instances' losses; forward values stay per instance.
        Outputs are views (rows) of the batched results, as ``torch.unbind`` gives: keeping one
        output keeps its whole batch's result tensor alive, so ``.clone()`` what you keep long.
        Outputs that are views of other outputs, of inputs or of shared tensors (``(a, a.t())``,
        ``x[1:]``, ``E[i]``) alias them as in eager; lazy values have no strides of their own
        and get a new ``data_ptr()`` when written in place. Set the default dtype around the
        call, not inside instance code.
        Context variables set by instance code stay in that instance (each fiber runs in a copy
        of the caller's context).
    Source:
        ACRoBat (Fegade et al., MLSys 2024, arXiv 2305.10611); DyNet auto-batching
        (Neubig et al., NeurIPS 2017, arXiv 1705.07860).
    Example:
        >>> lin = torch.nn.Linear(3, 2)
        >>> f = autobatch(lambda x: torch.tanh(lin(x)))     # per instance: (3,) -> (2,)
        >>> ys = f([torch.randn(3) for _ in range(5)])      # 5 tensors of shape (2,)
    """
    if not callable(fn):
        raise TypeError(f"autobatch: fn must be callable, got {type(fn).__name__}")
    if compile_blocks is not None:
        warnings.warn("autobatch: compile_blocks has no effect (elementwise tails are fused by "
                      "fuse_elementwise=True, the default) and will be removed", DeprecationWarning, stacklevel=2)
    return AutoBatched(fn, Options(scheduler=scheduler, fibers=fibers, max_steps=max_steps, max_pending=max_pending,
                                   core=core, ragged=ragged, hoist=hoist, kernels=kernels, arenas=arenas,
                                   packed_order=packed_order, consumer_order=consumer_order, dedup=dedup, fuse_recurrences=fuse_recurrences,
                                   fuse_elementwise=fuse_elementwise, fast_attributes=fast_attributes,
                                   fast_factories=fast_factories, fast_modules=fast_modules,
                                   retain_memory=retain_memory))


class _PhaseMark:
    """Returned by :func:`phase` so that ``with phase("decoder"):`` reads naturally too."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def phase(name: str | None = None) -> _PhaseMark:
    """Mark a program-phase boundary in instance code (e.g. between encoder and classifier).

    Work recorded after the call is scheduled after all instances' work of earlier phases,
    each phase on its own (ACRoBat §4.4, program phases). Outside ``autobatch`` it does nothing.
    ``phase("x")`` and ``with phase("x"):`` are the same: the boundary is where it is called
    (leaving the ``with`` block does not end the phase).
    """
    rec = stack.current()
    if rec is not None and not getattr(rec, "is_tracer", False):
        rec.phase += 1
    return _PhaseMark(name)
