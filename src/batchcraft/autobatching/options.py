"""Options of one auto-batched function: a frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields

SCHEDULER_NAMES = ("depth", "agenda")
CORE_NAMES = ("auto", "c", "python")
KERNEL_NAMES = ("auto", "default", "onednn")


@dataclass(frozen=True)
class Options:
    """How :func:`batchcraft.autobatch` records, schedules and executes.

    Attributes:
        scheduler (str): ``"depth"`` (default) or ``"agenda"`` (DyNet §3.2).
        fibers (bool | str): run each instance in a fiber (True), one after another (False), or
            ``"auto"`` (default): in fibers until a call of the function finishes without any
            instance waiting for a value, then one after another until one waits (fibers again from
            then on; see :func:`~batchcraft.autobatching.autobatch`).
        max_steps (int | None): per-instance bound on operations + synchronisations.
        max_pending (int | None): run pending work once this many nodes wait.
        core (str): recording core: ``"auto"`` (the C core when it was built), ``"c"`` or
            ``"python"`` (the pure-Python reference core).
        ragged (bool): key list arguments of static blocks as empty / non-empty and run nodes
            with any number of list members as one group, where the block's trace allows it.
        hoist (bool): run the parts of recurrent cells and static blocks that depend only on
            early inputs (e.g. input projections) for all instances at once.
        kernels (str): batched matrix multiplies: ``"auto"`` (the backend measured fastest on
            this machine for the shape, cached), ``"default"`` (PyTorch's) or ``"onednn"``.
        arenas (bool): write the outputs of one kind of group into shared buffers (inference).
        packed_order (bool): depth scheduler: order the nodes of recurrences longest instance
            first, so that each step reads the previous step's state as a view (``order.py``).
        consumer_order (bool): depth scheduler: lay out the rows of a signature that runs as one
            group in the order later groups read them, so they read views (``order.py``).
        dedup (bool): a group whose per-instance inputs are integer scalars (token ids) runs once
            per distinct input in inference (``dedup.py``); one that only looks big rows up in
            embedding tables is placed in the tables instead (``lookup.py``).
        fuse_recurrences (bool): depth scheduler, C core: the per-step chains of a recurrent cell
            block (``static_block(nn.LSTMCell)``, GRU, RNN) run as one packed recurrent-layer call
            where the trace proves it equivalent (``chains.py``).
        fuse_elementwise (bool): runs of elementwise steps of a batched program run as one C kernel
            (``fuse.py``; float32 CPU values, nothing needing autograd).
        fast_attributes (bool): C core: during the call, the classes of the modules ``fn`` reaches
            hold a C descriptor per submodule / parameter / buffer name doing
            ``nn.Module.__getattr__``'s lookups (same values and errors; see ``attrs.py``).
        fast_factories (bool): C core: while the call records, ``torch.tensor`` reads as the C
            core's ``fast_tensor`` in the recording thread only (``ccore.FAST_FACTORIES``).
        fast_modules (bool): while the call records, ``nn.LSTMCell`` / ``GRUCell`` / ``RNNCell``
            called on this call's lazy values record projection + gates directly (``cells.py``),
            and ``torch.nn.functional``'s Python functions reach the recorder without torch's
            Python dispatch (``dispatch.py``).
        retain_memory (bool): glibc: while the call runs, memory comes from the heap rather than
            fresh ``mmap`` pages, so the next call reuses it instead of faulting it in again
            (``memory.py``).
    """

    scheduler: str = "depth"
    fibers: bool | str = "auto"
    max_steps: int | None = None
    max_pending: int | None = None
    core: str = "auto"
    ragged: bool = True
    hoist: bool = True
    kernels: str = "auto"
    arenas: bool = True
    packed_order: bool = True
    consumer_order: bool = True
    dedup: bool = True
    fuse_recurrences: bool = True
    fuse_elementwise: bool = True
    fast_attributes: bool = True
    fast_factories: bool = True
    fast_modules: bool = True
    retain_memory: bool = True

    def __post_init__(self):
        for name, allowed in (("scheduler", SCHEDULER_NAMES), ("core", CORE_NAMES), ("kernels", KERNEL_NAMES)):
            v = getattr(self, name)
            if v not in allowed:
                raise ValueError(f"autobatch: {name} must be one of {sorted(allowed)}, got {v!r}")
        for name in ("max_steps", "max_pending"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1):
                raise ValueError(f"autobatch: {name} must be a positive int or None, got {v!r}")
        if self.fibers != "auto" and not isinstance(self.fibers, bool):
            raise ValueError(f"autobatch: fibers must be True, False or 'auto', got {self.fibers!r}")
        for name in ("ragged", "hoist", "arenas", "packed_order", "consumer_order", "dedup",
                     "fuse_recurrences", "fuse_elementwise", "fast_attributes", "fast_factories", "fast_modules",
                     "retain_memory"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"autobatch: {name} must be a bool, got {v!r}")

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
