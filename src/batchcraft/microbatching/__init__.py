"""Micro-batching of convolutions under a workspace budget (μ-cuDNN for PyTorch).

Door: :func:`microbatch`. The rest: :class:`Plan` (what was chosen), :class:`MeasurementCache`
(SQLite store of measurements), :data:`ALGORITHMS` (the convolution algorithm registry),
:func:`parse_budget`, :class:`WorkspaceAudit` (measured workspace of a planned run),
:class:`Verification` (whole-model times of the plan, the undivided plan and the default, raced
after planning; the fastest is kept).

Source: Oyama, Ben-Nun, Hoefler, Matsuoka, "Accelerating Deep Learning Frameworks with
Micro-batches" (μ-cuDNN), IEEE CLUSTER 2018, arXiv 1804.04806.
"""

from batchcraft.microbatching.algorithms import ALGORITHMS, PASSES, ConvAlgorithm, ConvGeometry
from batchcraft.microbatching.budget import format_bytes, parse_budget
from batchcraft.microbatching.cache import MeasurementCache, default_cache_path
from batchcraft.microbatching.function import PlannedConv2d, WorkspaceAudit
from batchcraft.microbatching.plan import LayerPlan, PassPlan, Plan
from batchcraft.microbatching.planner import microbatch, plan_model
from batchcraft.microbatching.verify import Verification

__all__ = ["microbatch", "plan_model", "Plan", "LayerPlan", "PassPlan", "PlannedConv2d", "WorkspaceAudit",
           "MeasurementCache", "default_cache_path", "ALGORITHMS", "PASSES", "ConvAlgorithm", "ConvGeometry",
           "parse_budget", "format_bytes", "Verification"]
