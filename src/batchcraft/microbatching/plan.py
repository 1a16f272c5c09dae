"""The result of planning: per input planned, per layer and pass, the division chosen; saved and loaded as JSON.

A :class:`Plan` holds the settings it was made under (policy, budget, candidates, passes,
algorithms), the environment it was measured in (device name, torch version, intra-op threads)
and one :class:`InputPlan` per model input planned: the example given to ``microbatch`` first,
then every new shape, batch size, dtype or device seen later (planned on first sight).

Times are the *predicted* times (sums of measured per-micro-batch times, ms); workspaces are
the measured peaks of the configurations chosen (bytes). ``default_ms`` is PyTorch's own
algorithm on the undivided batch and ``undivided_ms`` the fastest undivided algorithm within the
same budget, both from the same measurements, so per-layer speed-ups compare like with like.
``verification`` holds the *measured* whole-model times of the variants raced after planning
(see :mod:`batchcraft.microbatching.verify`) and which one the plan now runs.

File format (``Plan.save`` / ``Plan.load``): one JSON object, ``"format": "batchcraft-microbatch-plan"``,
``"version": 1``; everything ``to_dict`` gives, enough to re-apply the plan without measuring.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from batchcraft.errors import DataFormatError
from batchcraft.measure.table import format_table
from batchcraft.microbatching.algorithms import ConvGeometry
from batchcraft.microbatching.budget import format_bytes
from batchcraft.microbatching.types import Config, InputKey, PassChoice, Step
from batchcraft.microbatching.verify import Verification

__all__ = ["PassPlan", "LayerPlan", "InputPlan", "Plan", "FILE_FORMAT", "FILE_VERSION"]

FILE_FORMAT = "batchcraft-microbatch-plan"
FILE_VERSION = 1


def _steps_to_list(choice: PassChoice | None):
    if choice is None:
        return None
    return [{"algorithm": c.algorithm, "micro_batch": c.micro_batch, "time_ms": c.time_ms,
             "workspace_bytes": c.workspace_bytes, "spread": c.spread} for c in choice.steps]


def _choice_from_list(steps) -> PassChoice | None:
    if steps is None:
        return None
    return PassChoice(tuple(Config(str(s["algorithm"]), int(s["micro_batch"]),
                                   float("inf") if s.get("time_ms") is None else float(s["time_ms"]),
                                   int(s.get("workspace_bytes", 0)), float(s.get("spread", 0.0))) for s in steps))


def _json_ms(v: float | None):
    return None if v is None or v == float("inf") else v


@dataclass
class PassPlan:
    """One layer-pass of a plan.

    Attributes:
        choice (PassChoice): steps [(algorithm, micro_batch, time_ms, workspace_bytes), ...] run.
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

    def steps(self) -> list[Step]:
        return self.choice.step_list()

    def describe(self) -> str:
        """Compact division, e.g. ``"fft 32x2"`` or ``"default 64 + im2col 16"`` (algorithm size x count)."""
        return self.choice.describe()

    def to_dict(self) -> dict:
        return {
            "steps": _steps_to_list(self.choice),
            "time_ms": _json_ms(self.time_ms), "workspace_bytes": self.workspace_bytes,
            "default_ms": self.default_ms, "default_workspace_bytes": self.default_workspace_bytes,
            "undivided_ms": self.undivided_ms, "undivided_steps": _steps_to_list(self.undivided_choice),
            "optimizer_steps": _steps_to_list(self.optimizer_choice),
            "optimizer_ms": None if self.optimizer_choice is None else _json_ms(self.optimizer_choice.time_ms),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "PassPlan":
        return cls(_choice_from_list(d["steps"]), d.get("default_ms"), d.get("default_workspace_bytes"),
                   d.get("undivided_ms"), _choice_from_list(d.get("undivided_steps")),
                   _choice_from_list(d.get("optimizer_steps")))


@dataclass
class LayerPlan:
    """Plan of one ``Conv2d`` for one input: qualified name, input, geometry and a :class:`PassPlan` per pass."""

    name: str
    geometry: ConvGeometry
    passes: dict[str, PassPlan] = field(default_factory=dict)
    key: InputKey | None = None  # the layer's own input (shape, dtype, device)

    def to_dict(self) -> dict:
        return {"name": self.name, "geometry": self.geometry.key(), "geometry_fields": _geometry_to_dict(self.geometry),
                "input": None if self.key is None else self.key.to_dict(),
                "passes": {p: pp.to_dict() for p, pp in self.passes.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "LayerPlan":
        return cls(str(d["name"]), _geometry_from_dict(d["geometry_fields"]),
                   {p: PassPlan.from_dict(pp) for p, pp in d["passes"].items()},
                   None if d.get("input") is None else InputKey.from_dict(d["input"]))


def _geometry_to_dict(g: ConvGeometry) -> dict:
    return {"in_channels": g.in_channels, "out_channels": g.out_channels, "kernel": list(g.kernel),
            "stride": list(g.stride), "padding": list(g.padding), "dilation": list(g.dilation),
            "groups": g.groups, "height": g.height, "width": g.width}


def _geometry_from_dict(d: dict) -> ConvGeometry:
    pair = lambda v: (int(v[0]), int(v[1]))  # noqa: E731
    return ConvGeometry(int(d["in_channels"]), int(d["out_channels"]), pair(d["kernel"]), pair(d["stride"]),
                        pair(d["padding"]), pair(d["dilation"]), int(d["groups"]), int(d["height"]), int(d["width"]))


@dataclass
class InputPlan:
    """The plan for one model input (or, ``alone``, for one layer called outside the planned model).

    Attributes:
        key (InputKey): the input planned (shape, dtype, device).
        layers (list[LayerPlan]): planned convolutions in call order.
        skipped (dict[str, str]): layer name -> why it runs unplanned (e.g. non-zero padding mode).
        measured (int): configurations measured for this input (the rest came from the cache).
        planning_s (float): wall time of planning it, seconds.
        verification (Verification | None): measured whole-model times of the raced variants and
            the one kept; None when verification was off (or for a layer planned alone).
        unsupported (dict[str, str]): "algorithm pass" -> why it cannot run this dtype/device (skipped).
        notes (list[str]): what the user should know (noisy measurements, a verification that
            disagreed with the cached per-layer times and what was re-measured).
        origin (str): "example" (the input given to ``microbatch``), "first sight" (planned
            lazily) or "alone" (one layer called by itself). A re-applied plan keeps its file's.
    """

    key: InputKey
    layers: list[LayerPlan] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    measured: int = 0
    planning_s: float = 0.0
    verification: Verification | None = None
    unsupported: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    origin: str = "example"

    def pass_plans(self):
        """(layer name, pass, PassPlan) for every planned layer-pass, in call order."""
        for layer in self.layers:
            for p, pp in layer.passes.items():
                yield layer.name, p, pp

    @property
    def batch_size(self) -> int:
        return self.key.batch_size

    def total_ms(self, which: str = "time_ms") -> float | None:
        """Sum over layer-passes of ``time_ms``, ``default_ms`` or ``undivided_ms`` (None if any is missing)."""
        values = [getattr(pp, which) for _, _, pp in self.pass_plans()]
        return None if any(v is None for v in values) else float(sum(values))

    def optimizer_total_ms(self) -> float:
        """Predicted time of the optimiser's own plan (its choice where verification kept another)."""
        return float(sum((pp.optimizer_choice or pp.choice).time_ms for _, _, pp in self.pass_plans()))

    @property
    def max_workspace_bytes(self) -> int:
        return max((pp.workspace_bytes for _, _, pp in self.pass_plans()), default=0)

    @property
    def total_workspace_bytes(self) -> int:
        return sum(pp.workspace_bytes for _, _, pp in self.pass_plans())

    def kept_statement(self) -> str | None:
        """A plain sentence when verification kept another variant than the optimiser's plan, else None."""
        v = self.verification
        if v is None or v.kept == "planned":
            return None
        what = {"default": "PyTorch's default convolution (no budget-driven algorithm, no micro-batching)",
                "undivided": "the best undivided plan (no layer is divided)"}.get(v.kept, v.kept)
        planned = v.times_ms.get("planned")
        than = (f" vs {planned:.1f} ms with the optimiser's plan" if planned is not None else "")
        return (f"verification kept {what}: the whole model ran in {v.times_ms[v.kept]:.1f} ms with it{than}. "
                f"The rows show what runs; the 'optimiser' columns show the optimiser's plan, not used.")

    def table(self, *, markdown: bool = False) -> str:
        """One row per layer-pass: division, predicted ms, workspace, default and undivided ms, speed-ups."""
        show_optimizer = any(pp.optimizer_choice is not None for _, _, pp in self.pass_plans())
        rows = []
        for name, p, pp in self.pass_plans():
            row = [name, p, pp.describe(), pp.time_ms, format_bytes(pp.workspace_bytes),
                   "-" if pp.default_ms is None else pp.default_ms,
                   "-" if pp.undivided_ms is None else pp.undivided_ms,
                   "-" if pp.default_ms is None else f"{pp.default_ms / pp.time_ms:.2f}x",
                   "-" if pp.undivided_ms is None else f"{pp.undivided_ms / pp.time_ms:.2f}x"]
            if show_optimizer:
                opt = pp.optimizer_choice or pp.choice
                row += [opt.describe() + ("" if pp.optimizer_choice is not None else " (same)"), opt.time_ms]
            rows.append(row)
        headers = ["layer", "pass", "division", "plan_ms", "workspace", "default_ms", "undivided_ms",
                   "vs_default", "vs_undivided"] + (["optimiser's division", "optimiser_ms"] if show_optimizer else [])
        text = format_table(headers, rows, markdown=markdown)
        statement = self.kept_statement()
        if statement:
            text = statement + "\n" + text
        return text

    def to_dict(self) -> dict:
        return {
            "input": self.key.to_dict(), "origin": self.origin, "batch_size": self.batch_size,
            "predicted_ms": self.total_ms(), "default_predicted_ms": self.total_ms("default_ms"),
            "undivided_predicted_ms": self.total_ms("undivided_ms"),
            "optimizer_predicted_ms": self.optimizer_total_ms(),
            "max_workspace_bytes": self.max_workspace_bytes, "total_workspace_bytes": self.total_workspace_bytes,
            "measured_configurations": self.measured, "planning_s": self.planning_s,
            "layers": [layer.to_dict() for layer in self.layers], "skipped": dict(self.skipped),
            "unsupported": dict(self.unsupported), "notes": list(self.notes),
            "verification": None if self.verification is None else self.verification.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "InputPlan":
        v = d.get("verification")
        return cls(InputKey.from_dict(d["input"]), [LayerPlan.from_dict(x) for x in d["layers"]],
                   dict(d.get("skipped", {})), int(d.get("measured_configurations", 0)), float(d.get("planning_s", 0.0)),
                   None if v is None else Verification.from_dict(v), dict(d.get("unsupported", {})),
                   list(d.get("notes", [])), str(d.get("origin", "example")))


@dataclass
class Plan:
    """A network's micro-batching plan: settings, environment and one :class:`InputPlan` per input planned.

    Attributes:
        policy (str): ``"wr"`` (limit per layer-pass) or ``"wd"`` (one network budget).
        workspace_limit_bytes (int): the budget.
        batch_sizes (str): candidate set, ``undivided`` / ``powerOfTwo`` / ``all``.
        passes (tuple[str, ...]): the passes planned.
        algorithms (tuple[str, ...] | None): the algorithms allowed (None: all).
        environment (dict): ``device`` (name), ``torch`` (version), ``threads`` (intra-op) measured in.
        inputs (list[InputPlan]): every input planned, the example first.
        source (str | None): where a re-applied plan came from ("plan file ..."), else None.

    The single-input attributes of earlier versions (``layers``, ``batch_size``, ``skipped``,
    ``measured``, ``planning_s``, ``verification``, ``pass_plans()``, ``total_ms()``) read the
    first input's plan (the example's).
    """

    policy: str
    workspace_limit_bytes: int
    batch_sizes: str
    passes: tuple[str, ...] = ("forward", "backward_data", "backward_filter")
    algorithms: tuple[str, ...] | None = None
    environment: dict = field(default_factory=dict)
    inputs: list[InputPlan] = field(default_factory=list)
    source: str | None = field(default=None, compare=False)  # where a re-applied plan came from (not saved)

    # --- the example's plan (single-input view) ---
    @property
    def primary(self) -> InputPlan:
        if not self.inputs:
            raise ValueError("this plan has no planned input yet")
        return self.inputs[0]

    @property
    def layers(self) -> list[LayerPlan]:
        return self.primary.layers

    @property
    def batch_size(self) -> int:
        return self.primary.batch_size

    @property
    def skipped(self) -> dict[str, str]:
        return self.primary.skipped

    @property
    def verification(self) -> Verification | None:
        return self.primary.verification

    @property
    def planning_s(self) -> float:
        return sum(i.planning_s for i in self.inputs)

    @property
    def measured(self) -> int:
        """Configurations measured for every input planned so far (0: everything came from the cache or a file)."""
        return sum(i.measured for i in self.inputs)

    def pass_plans(self):
        return self.primary.pass_plans()

    def total_ms(self, which: str = "time_ms") -> float | None:
        return self.primary.total_ms(which)

    @property
    def max_workspace_bytes(self) -> int:
        return max((i.max_workspace_bytes for i in self.inputs), default=0)

    @property
    def total_workspace_bytes(self) -> int:
        """Largest sum over one input's layer-passes (what WD bounds)."""
        return max((i.total_workspace_bytes for i in self.inputs), default=0)

    def input_plan(self, key: InputKey) -> InputPlan | None:
        return next((i for i in self.inputs if i.key == key and i.origin != "alone"), None)

    # --- report ---
    def table(self, *, markdown: bool = False) -> str:
        """Per input planned: a heading and one row per layer-pass (see :meth:`InputPlan.table`)."""
        parts = []
        for i in self.inputs:
            head = (f"input {i.key.describe()} ({i.origin}; {i.measured} configurations measured, "
                    f"{len(i.layers)} layer{'s' if len(i.layers) != 1 else ''})")
            body = i.table(markdown=markdown)
            tail = [f"note: {n}" for n in i.notes]
            parts.append("\n".join([head, body] + tail) if len(self.inputs) > 1 or i.notes else
                         "\n".join([body] + tail))
        return "\n\n".join(parts)

    def verification_table(self, *, markdown: bool = False) -> str:
        """Whole-model medians of the variants raced after planning the example, the kept one marked ("" if none)."""
        v = self.verification
        if v is None:
            return ""
        rows = []
        for name in ("default", "undivided", "planned"):
            if name in v.times_ms:
                note = f"same plan as {v.identical[name]}" if name in v.identical else ""
                if name == "planned" and v.kept != "planned":
                    note = (note + "; " if note else "") + "the optimiser's plan, not kept"
                rows.append([name + (" (kept)" if name == v.kept else ""), v.times_ms[name], v.iqr_ms[name],
                             f"{v.times_ms[name] / v.times_ms[v.kept]:.3f}", note])
            elif name in v.excluded:
                rows.append([name, "-", "-", "-", v.excluded[name]])
        return format_table(["variant", "median_ms", "iqr_ms", "time / kept", "note"], rows, markdown=markdown)

    # --- persistence ---
    def to_dict(self) -> dict:
        d = {"format": FILE_FORMAT, "version": FILE_VERSION, "policy": self.policy,
             "workspace_limit_bytes": self.workspace_limit_bytes, "batch_sizes": self.batch_sizes,
             "passes": list(self.passes), "algorithms": None if self.algorithms is None else list(self.algorithms),
             "environment": dict(self.environment), "inputs": [i.to_dict() for i in self.inputs]}
        if self.inputs:  # the example's plan at top level too (single-input readers)
            p = self.inputs[0].to_dict()
            for k in ("batch_size", "predicted_ms", "default_predicted_ms", "undivided_predicted_ms", "layers",
                      "skipped", "verification"):
                d[k] = p[k]
            d["measured_configurations"] = self.measured
            d["planning_s"] = self.planning_s
            d["max_workspace_bytes"], d["total_workspace_bytes"] = self.max_workspace_bytes, self.total_workspace_bytes
        return d

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(str(d["policy"]), int(d["workspace_limit_bytes"]), str(d["batch_sizes"]),
                   tuple(d.get("passes") or ()), None if d.get("algorithms") is None else tuple(d["algorithms"]),
                   dict(d.get("environment") or {}), [InputPlan.from_dict(i) for i in d["inputs"]])

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan as JSON to ``path`` (atomically: a temporary file renamed); returns the path."""
        path = Path(path)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read a plan written by :meth:`save`.

        Raises:
            DataFormatError: not JSON (the message names the file and line), not a plan file, a
                newer format version, or a missing field.
            FileNotFoundError: no such file.
        """
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataFormatError(path, exc.lineno, f"not valid JSON: {exc.msg} (column {exc.colno})",
                                  hint="a plan file is written by model.plan.save(path)") from None
        if not isinstance(d, dict) or d.get("format") != FILE_FORMAT:
            raise DataFormatError(path, None, f"not a batchcraft micro-batching plan (no \"format\": \"{FILE_FORMAT}\")")
        if int(d.get("version", 0)) > FILE_VERSION:
            raise DataFormatError(path, None, f"plan format version {d.get('version')} is newer than this batchcraft "
                                              f"reads ({FILE_VERSION})", hint="upgrade batchcraft")
        try:
            plan = cls.from_dict(d)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise DataFormatError(path, None, f"malformed plan: {type(exc).__name__}: {exc}") from None
        return plan

    def __str__(self) -> str:
        return self.table()
