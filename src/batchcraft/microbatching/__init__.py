"""Micro-batching of convolutions under a workspace budget (μ-cuDNN for PyTorch).

Door: :func:`microbatch`. The rest: :class:`Plan` (what was chosen, per input planned; saved with
``Plan.save``, read with ``Plan.load``), :class:`MeasurementCache` (SQLite store of
measurements), :data:`ALGORITHMS` (the convolution algorithm registry), :data:`POLICIES` (the
workspace policies ``wr`` and ``wd``), :func:`parse_budget`, :class:`WorkspaceAudit` (measured
workspace of a planned run), :class:`Verification` (whole-model times of the plan, the undivided
plan and the default, raced after planning; the fastest is kept).

Modules, in the order planning uses them: ``types`` (the plan's vocabulary), ``algorithms``,
``probe`` (find the convolutions), ``measure`` + ``memory`` + ``cache``, ``optimize_wr`` /
``optimize_wd`` behind ``policies``, ``planner`` (measure, optimise, assemble), ``plan``,
``session`` (install, plan on first sight, verify), ``verify``, ``layer`` + ``op`` + ``execute``
(running a plan: the module, the custom operators, the micro-batched passes), ``door``.

Source: Oyama, Ben-Nun, Hoefler, Matsuoka, "Accelerating Deep Learning Frameworks with
Micro-batches" (μ-cuDNN), IEEE CLUSTER 2018, arXiv 1804.04806.
"""

from batchcraft.microbatching.algorithms import ALGORITHMS, PASSES, ConvAlgorithm, ConvGeometry
from batchcraft.microbatching.budget import format_bytes, parse_budget
from batchcraft.microbatching.cache import MeasurementCache, default_cache_path
from batchcraft.microbatching.door import microbatch
from batchcraft.microbatching.execute import WorkspaceAudit
from batchcraft.microbatching.layer import PlannedConv2d
from batchcraft.microbatching.plan import InputPlan, LayerPlan, PassPlan, Plan
from batchcraft.microbatching.planner import plan_model
from batchcraft.microbatching.policies import POLICIES, Policy
from batchcraft.microbatching.types import Config, InputKey, PassChoice
from batchcraft.microbatching.verify import Verification

__all__ = ["microbatch", "plan_model", "Plan", "InputPlan", "LayerPlan", "PassPlan", "PlannedConv2d", "WorkspaceAudit",
           "MeasurementCache", "default_cache_path", "ALGORITHMS", "PASSES", "ConvAlgorithm", "ConvGeometry",
           "POLICIES", "Policy", "Config", "PassChoice", "InputKey", "parse_budget", "format_bytes", "Verification"]
