"""The result of planning: per layer and pass, the division chosen, as a table and as JSON.

Times are the *predicted* times (sums of measured per-micro-batch times, ms); workspaces are
the measured peaks of the configurations chosen (bytes). ``default_ms`` is PyTorch's own
algorithm on the undivided batch and ``undivided_ms`` the fastest undivided algorithm within the
same budget, both from the same measurements, so per-layer speed-ups compare like with like.
``verification`` holds the *measured* whole-model times of the variants raced after planning
(see :mod:`batchcraft.microbatching.verify`) and which one the plan now runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from batchcraft.measure.table import format_table
from batchcraft.microbatching.algorithms import ConvGeometry
from batchcraft.microbatching.budget import format_bytes
from batchcraft.microbatching.optimize_wr import PassChoice
from batchcraft.microbatching.verify import Verification

__all__ = ["PassPlan", "LayerPlan", "Plan"]


@dataclass
class PassPlan:
    """One layer-pass of a plan.

    Attributes:
        choice (PassChoice): steps [(algorithm, micro_batch, time_ms, workspace_bytes), ...].
        default_ms (float | None): PyTorch's default algorithm, undivided (None if not measured).
        default_workspace_bytes (int | None): its measured workspace.
        undivided_ms (float | None): fastest undivided algorithm within the budget (None: none fits).
        undivided_choice (PassChoice | None): that undivided plan's step (WD: the network ILP's).
        optimizer_choice (PassChoice | None): the optimiser's choice when end-to-end verification
            kept another variant (then ``choice`` is the kept one); None otherwise.
    """

    choice: PassChoice
    default_ms: float | None = None
    default_workspace_bytes: int | None = None
    undivided_ms: float | None = None
    undivided_choice: PassChoice | None = None
    optimizer_choice: PassChoice | None = None

    @property
    def time_ms(self) -> float:
        return self.choice.time_ms

    @property
    def workspace_bytes(self) -> int:
        return self.choice.workspace_bytes

    def steps(self) -> list[tuple[str, int]]:
        return [(c.algorithm, c.micro_batch) for c in self.choice.steps]

    def describe(self) -> str:
        """Compact division, e.g. ``"fft 32x2"`` or ``"default 64 + im2col 16"`` (algorithm size x count)."""
        groups: list[list] = []
        for c in self.choice.steps:
            if groups and groups[-1][0] == c.algorithm and groups[-1][1] == c.micro_batch:
                groups[-1][2] += 1
            else:
                groups.append([c.algorithm, c.micro_batch, 1])
        return " + ".join(f"{a} {n}" + (f"x{k}" if k > 1 else "") for a, n, k in groups)

    def to_dict(self) -> dict:
        return {
            "steps": [{"algorithm": c.algorithm, "micro_batch": c.micro_batch, "time_ms": c.time_ms,
                       "workspace_bytes": c.workspace_bytes} for c in self.choice.steps],
            "time_ms": self.time_ms, "workspace_bytes": self.workspace_bytes,
            "default_ms": self.default_ms, "default_workspace_bytes": self.default_workspace_bytes,
            "undivided_ms": self.undivided_ms,
            "optimizer_steps": None if self.optimizer_choice is None else [
                {"algorithm": c.algorithm, "micro_batch": c.micro_batch} for c in self.optimizer_choice.steps],
        }


@dataclass
class LayerPlan:
    """Plan of one ``Conv2d``: its qualified name, geometry and a :class:`PassPlan` per planned pass."""

    name: str
    geometry: ConvGeometry
    passes: dict[str, PassPlan] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "geometry": self.geometry.key(),
                "passes": {p: pp.to_dict() for p, pp in self.passes.items()}}


@dataclass
class Plan:
    """A network's micro-batching plan.

    Attributes:
        policy (str): ``"wr"`` (limit per layer-pass) or ``"wd"`` (one network budget).
        workspace_limit_bytes (int): the budget.
        batch_size (int): the mini-batch the plan divides.
        batch_sizes (str): candidate set, ``undivided`` / ``powerOfTwo`` / ``all``.
        layers (list[LayerPlan]): planned convolutions in model order.
        skipped (dict[str, str]): layer name -> why it runs unplanned (e.g. non-zero padding mode).
        measured (int): configurations measured now (the rest came from the cache).
        planning_s (float): wall time of planning, seconds.
        verification (Verification | None): measured whole-model times of the raced variants and
            the one kept; None when ``microbatch(..., verify=False)`` or from ``plan_model``.
    """

    policy: str
    workspace_limit_bytes: int
    batch_size: int
    batch_sizes: str
    layers: list[LayerPlan] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    measured: int = 0
    planning_s: float = 0.0
    verification: Verification | None = None

    def pass_plans(self):
        """(layer name, pass, PassPlan) for every planned layer-pass, in model order."""
        for layer in self.layers:
            for p, pp in layer.passes.items():
                yield layer.name, p, pp

    def total_ms(self, which: str = "time_ms") -> float | None:
        """Sum over layer-passes of ``time_ms``, ``default_ms`` or ``undivided_ms`` (None if any is missing)."""
        values = [getattr(pp, which) for _, _, pp in self.pass_plans()]
        return None if any(v is None for v in values) else float(sum(values))

    @property
    def max_workspace_bytes(self) -> int:
        return max((pp.workspace_bytes for _, _, pp in self.pass_plans()), default=0)

    @property
    def total_workspace_bytes(self) -> int:
        return sum(pp.workspace_bytes for _, _, pp in self.pass_plans())

    def table(self, *, markdown: bool = False) -> str:
        """One row per layer-pass: division, predicted ms, workspace, default and undivided ms, speed-ups."""
        rows = []
        for name, p, pp in self.pass_plans():
            rows.append([name, p, pp.describe(), pp.time_ms, format_bytes(pp.workspace_bytes),
                         "-" if pp.default_ms is None else pp.default_ms,
                         "-" if pp.undivided_ms is None else pp.undivided_ms,
                         "-" if pp.default_ms is None else f"{pp.default_ms / pp.time_ms:.2f}x",
                         "-" if pp.undivided_ms is None else f"{pp.undivided_ms / pp.time_ms:.2f}x"])
        headers = ["layer", "pass", "division", "plan_ms", "workspace", "default_ms", "undivided_ms",
                   "vs_default", "vs_undivided"]
        text = format_table(headers, rows, markdown=markdown)
        v = self.verification
        if v is not None and v.kept != "planned":
            # say why the table shows the default or undivided choices, not the optimiser's
            planned = v.times_ms.get("planned")
            vs = f" vs {planned:.1f} ms for the optimiser's plan" if planned is not None else ""
            text += (f"\nkept: the {v.kept} variant after the whole-model check ({v.times_ms[v.kept]:.1f} ms"
                     f"{vs}; see verification_table()); the rows show the kept choices")
        return text

    def to_dict(self) -> dict:
        return {
            "policy": self.policy, "workspace_limit_bytes": self.workspace_limit_bytes,
            "batch_size": self.batch_size, "batch_sizes": self.batch_sizes,
            "predicted_ms": self.total_ms(), "default_predicted_ms": self.total_ms("default_ms"),
            "undivided_predicted_ms": self.total_ms("undivided_ms"),
            "max_workspace_bytes": self.max_workspace_bytes, "total_workspace_bytes": self.total_workspace_bytes,
            "measured_configurations": self.measured, "planning_s": self.planning_s,
            "layers": [layer.to_dict() for layer in self.layers], "skipped": dict(self.skipped),
            "verification": None if self.verification is None else self.verification.to_dict(),
        }

    def verification_table(self, *, markdown: bool = False) -> str:
        """Whole-model medians of the variants raced after planning, the kept one marked ("" if none)."""
        v = self.verification
        if v is None:
            return ""
        rows = []
        for name in ("default", "undivided", "planned"):
            if name in v.times_ms:
                note = f"same plan as {v.identical[name]}" if name in v.identical else ""
                rows.append([name + (" (kept)" if name == v.kept else ""), v.times_ms[name], v.iqr_ms[name],
                             f"{v.times_ms[name] / v.times_ms[v.kept]:.3f}", note])
            elif name in v.excluded:
                rows.append([name, "-", "-", "-", v.excluded[name]])
        return format_table(["variant", "median_ms", "iqr_ms", "time / kept", "note"], rows, markdown=markdown)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return self.table()
