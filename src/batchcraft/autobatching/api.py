"""Public API of auto-batching: ``autobatch`` and ``phase``."""

from __future__ import annotations

from typing import Callable, Sequence

from batchcraft.autobatching import recorder as _rec
from batchcraft.autobatching.runtime import Runtime
from batchcraft.autobatching.schedule import SCHEDULERS
from batchcraft.autobatching.stats import RunStats


class AutoBatched:
    """A per-instance function made to run over a sequence of instances; see :func:`autobatch`.

    Attributes:
        stats (RunStats | None): statistics of the last call.
    """

    def __init__(self, fn: Callable, options: dict):
        self.fn = fn
        self.options = options
        self.stats: RunStats | None = None
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, instances: Sequence) -> list:
        if isinstance(instances, (str, bytes)) or not hasattr(instances, "__len__"):
            instances = list(instances)
        if _rec.current() is not None:
            # called from inside instance code of another autobatch call: run inline, so the
            # outer call records (and batches) this work with everything else
            self.stats = None
            return [self.fn(x) for x in instances]
        rt = Runtime(self.fn, **self.options)
        try:
            return rt.run(instances)
        finally:
            self.stats = rt.stats

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"autobatch({self.__name__}, {opts})"


def autobatch(fn: Callable, *, scheduler: str = "depth", fibers: bool = True,
              max_steps: int | None = None, max_pending: int | None = None,
              direct_blocks: bool = True, compile_blocks: bool = False) -> AutoBatched:
    """Return a callable that runs per-instance ``fn`` over many instances in batches.

    ``fn`` is ordinary PyTorch code for *one* instance: torch functions, Tensor
    methods and operators, ``nn.Module`` calls, recursion and loops whose structure
    depends on the instance, and branches on tensor values (each instance runs in a
    fiber that waits while pending work runs batched). Tensors that ``fn`` receives
    inside its instance or creates (``torch.tensor(word_id)``) are per-instance data
    and are batched too; parameters and other tensors from outside are shared and
    passed once to each batched call.

    Args:
        fn (callable): ``fn(instance) -> tensor | nested tuple/list/dict of tensors``.
        scheduler (str): ``"depth"`` (default) or ``"agenda"`` (DyNet's agenda-based
            batching: lowest average depth first).
        fibers (bool): run each instance in a fiber (default). With ``False`` instances run
            one after another and a value request executes all pending work at once.
        max_steps (int | None): stop an instance that records more operations plus
            synchronisations than this without finishing (StepLimitError).
        max_pending (int | None): execute pending work early once this many nodes wait,
            bounding the memory of the recorded graph.
        direct_blocks (bool): call a static block's own code on batched inputs when every
            operation in it is batch-transparent (default); False always replays op by op.
        compile_blocks (bool): run such blocks through ``torch.compile(dynamic=True)``, compiled
            once per signature. Off by default: on the CPU it was slower than the direct call at
            the suite's sizes (see docs/benchmarks.md, ablation), and compiling takes seconds.
    Returns:
        AutoBatched: ``f(instances) -> list`` with ``f(xs)[i]`` equal to ``fn(xs[i])``
        (as ordinary tensors, differentiable); ``f.stats`` describes the last call.
    Raises:
        ValueError: unknown option value.
        InstanceError: ``fn`` raised for an instance (``.instance`` is its index); the whole
            call fails and returns nothing.
    Differences from eager:
        The outputs of one call share one autograd graph (that is what batching means): sum
        the losses and call ``backward()`` once, or pass ``retain_graph=True`` to backward
        through several outputs separately. A NaN/inf in one instance's input makes the
        gradients of shared weights NaN for the whole call (0 * NaN in the batched weight
        gradient), even for other instances' losses; forward values stay per instance.
        Outputs are views (rows) of the batched results, as ``torch.unbind`` gives: keeping one
        output keeps its whole batch's result tensor alive, so ``.clone()`` what you keep long.
        Outputs that share memory in eager (``(a, a.t())``) come back equal but separate.
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
    if scheduler not in SCHEDULERS:
        raise ValueError(f"autobatch: scheduler must be one of {sorted(SCHEDULERS)}, got {scheduler!r}")
    for name, v in (("max_steps", max_steps), ("max_pending", max_pending)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"autobatch: {name} must be a positive int or None, got {v!r}")
    return AutoBatched(fn, dict(scheduler=scheduler, fibers=bool(fibers), max_steps=max_steps,
                                max_pending=max_pending, direct_blocks=bool(direct_blocks),
                                compile_blocks=bool(compile_blocks)))


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
    rec = _rec.current()
    if rec is not None and hasattr(rec, "phase"):
        rec.phase += 1
    return _PhaseMark(name)
