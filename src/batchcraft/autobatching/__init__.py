"""Auto-batching of dynamic models (merge): the door is :func:`autobatch`.

Write the model for one instance, with ordinary Python control flow; run it over many
instances; same-shaped work of all instances runs as batched kernels, with results equal to
running each instance alone.

Stages, one module each: ``lazy`` (lazy values), ``recorder`` / ``ccore`` (recording: the
Python and C cores), ``signature`` (signatures and their cache), ``blocks`` (static blocks
and their tracer), ``ragged`` (ragged groups), ``program`` / ``lower`` (programs compiled to
batched functions), ``rules`` (batching rules), ``kernels`` (kernel selection), ``plan`` /
``gather`` (where rows come from), ``execute`` (groups), ``schedule`` (depth and agenda),
``runtime`` (fibers), ``threadstate`` (per-fiber torch state), ``functional`` / ``views``
(in-place writes, hooks).
"""

from batchcraft.autobatching import _native
from batchcraft.autobatching.api import AutoBatched, autobatch, phase
from batchcraft.autobatching.blocks import static_block
from batchcraft.autobatching.lazy import LazyTensor
from batchcraft.autobatching.options import Options
from batchcraft.autobatching.rules import register_rule
from batchcraft.autobatching.stats import RunStats

if _native.available:  # give the C core the torch objects it needs, once per process
    from batchcraft.autobatching import ccore as _ccore  # noqa: F401

__all__ = ["autobatch", "AutoBatched", "static_block", "phase", "RunStats", "LazyTensor", "register_rule",
           "Options"]
