"""A planned model's planning session: installs plans, plans new inputs on first sight, verifies them.

One :class:`PlanningSession` per planned model holds the :class:`~batchcraft.microbatching.planner.Settings`
(budget, policy, candidates, passes, algorithms), the measurement cache and the
:class:`~batchcraft.microbatching.plan.Plan`. It is reached two ways:

* a forward pre-hook on the planned model: an input (N, C, H, W) whose shape, dtype or device
  has no plan yet is planned before the forward runs (probe, measure, optimise, assemble,
  install, verify; μ-cuDNN plans each new layer geometry on first sight). WD divides the budget
  across the network for that input, exactly as for the example. A known input costs one dict
  lookup: nothing is measured.
* a planned layer called with an input it has no plan for (the layer called by itself, or a
  shape the probe did not predict): that layer alone is planned (WR: under the limit; WD: under
  what the other layers of the most recent model input's plan leave of the budget, the whole
  budget if there was none).

Planning runs under a forked random state with buffers and train/eval flags restored, so it
never changes the model's values, buffers or the caller's random stream. Under
``torch.compile`` the hook and a layer's first-sight planning run eagerly (graph breaks);
under ``torch.export`` nothing is planned: every traced input must already have a plan.

End-to-end verification (:mod:`batchcraft.microbatching.verify`) races the plan, the undivided
plan and the default (when the budget admits it) on the whole model and keeps the fastest.
When its times disagree with the cached per-layer predictions beyond noise, the plan says so
(``InputPlan.notes``, a warning), the configurations the variants run are measured again and
the input is planned and verified once more.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import torch
from torch import nn

from batchcraft.errors import WorkspaceError
from batchcraft.microbatching import verify as _verify
from batchcraft.microbatching.budget import format_bytes
from batchcraft.microbatching.layer import PlannedConv2d
from batchcraft.microbatching.plan import InputPlan, Plan
from batchcraft.microbatching.planner import (LayerPass, Measurers, Settings, assemble, layer_passes, measure,
                                              optimise, _note_measurements)
from batchcraft.microbatching.probe import ConvCall, find_convolutions, preserved_state
from batchcraft.microbatching.types import Config, InputKey, PassChoice

__all__ = ["PlanningSession"]


class PlanningSession:
    """Plans and installs; see the module docstring.

    Args:
        root (nn.Module): the model being planned (its convolutions are replaced in place).
        plan (Plan): where every input planned is recorded.
        settings (Settings): budget, policy and options every input is planned under.
        cache (MeasurementCache): the measurement cache.
        timer (callable | None): verification's clock (tests); None: wall clock.
    """

    def __init__(self, root: nn.Module, plan: Plan, settings: Settings, cache, timer: Callable | None = None):
        self.root, self.plan, self.settings, self.cache = root, plan, settings, cache
        self.timer = timer
        self.modules: dict[str, PlannedConv2d] = {}
        self._busy = False
        self._current: InputPlan | None = None  # the input plan of the forward in progress (for lone layers)

    # --- installing ---
    def _ensure_module(self, name: str, module: nn.Module) -> PlannedConv2d:
        if name in self.modules:
            return self.modules[name]
        if isinstance(module, PlannedConv2d):
            module.session = self
            self.modules[name] = module
            return module
        planned = PlannedConv2d(module, name, session=self)
        self.modules[name] = planned
        if name == "":
            self.root = planned
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(self.root.get_submodule(parent_name) if parent_name else self.root, child, planned)
        return planned

    def install(self, entry: InputPlan, calls: list[ConvCall] | None = None, which: str = "kept") -> None:
        """Make every planned layer run ``entry``'s choices (``which``: "kept", "undivided", "default")."""
        if calls is not None:
            for c in calls:
                if c.name in {layer.name for layer in entry.layers}:
                    self._ensure_module(c.name, c.module)
        for layer in entry.layers:
            steps = {p: _steps_of(pp, which, layer.key.batch_size) for p, pp in layer.passes.items()}
            self.modules[layer.name].set_steps(layer.key, steps)

    # --- planning an input ---
    def plan_new_input(self, x: torch.Tensor, origin: str = "first sight") -> InputPlan:
        """Plan, install and (if on) verify input ``x`` for the whole model; recorded in ``self.plan``."""
        self._busy = True
        try:
            devices = [x.device] if x.device.type == "cuda" else []
            with preserved_state(self.root, devices):
                entry = self._plan_and_verify(x, origin)
        finally:
            self._busy = False
        self.plan.inputs.append(entry)
        return entry

    def _plan_and_verify(self, x: torch.Tensor, origin: str) -> InputPlan:
        t0 = time.perf_counter()
        s = self.settings
        calls, skipped = find_convolutions(self.root, x)
        lps = layer_passes(calls, s.passes)
        measurers = Measurers(self.cache, s)
        refresh: set = set()
        notes: list[str] = []
        for attempt in (0, 1):
            measured = measure(lps, s, measurers, refresh=refresh or None)
            choices, undivided = optimise(lps, measured, s, measurers)
            entry = assemble(InputKey.of(x), lps, measured, choices, undivided, skipped, origin)
            self.install(entry, calls)
            if not (s.verify and lps):
                break
            if torch.is_inference_mode_enabled() and any(lp.pass_ != "forward" for lp in lps):
                notes.append("not verified end to end: planned inside torch.inference_mode(), where a training "
                             "step cannot run")
                break
            verification, predicted = self._verify(entry, x)
            issue = _verify.disagreement(verification, predicted)
            if issue is None:
                break
            if attempt == 0:
                notes.append(issue + "; the configurations of every variant were measured again and the input "
                                     "planned and verified again")
                warnings.warn(f"microbatch: input {entry.key.describe()}: {notes[-1]}", RuntimeWarning, stacklevel=2)
                refresh = _configs_of(entry, lps)
            else:
                notes.append(issue + " (again, after re-measuring: the per-layer times do not add up to the whole "
                                     "model here; the verification's choice stands)")
        entry.notes = notes + entry.notes
        entry.measured = measurers.measured
        _note_measurements(entry, measurers)
        entry.planning_s = time.perf_counter() - t0
        return entry

    def _verify(self, entry: InputPlan, x: torch.Tensor):
        variants, excluded = self.variants(entry)
        training = any(p != "forward" for _, p, _ in entry.pass_plans())

        def install(variant: str) -> None:
            self.install(entry, which=variant if variant != "planned" else "kept")

        verification = _verify.verify_plan(self.root, x, install, variants, training=training,
                                           repeats=self.settings.verify_repeats,
                                           timer=self.timer or _verify.wall_clock_ms, excluded=excluded,
                                           progress=self.settings.progress)
        predicted = {"planned": entry.total_ms(), "undivided": entry.total_ms("undivided_ms"),
                     "default": entry.total_ms("default_ms")}
        keep(entry, verification)
        self.install(entry)
        return verification, {k: v for k, v in predicted.items() if v is not None}

    def variants(self, entry: InputPlan) -> tuple[dict, dict]:
        """({variant: {(layer, input): {pass: steps}}} of the admissible variants, {variant: why excluded})."""
        passes = [(layer, p, pp) for layer in entry.layers for p, pp in layer.passes.items()]
        variants = {"planned": {}, "undivided": {}, "default": {}}
        excluded = {}
        for layer, p, pp in passes:
            slot = (layer.name, layer.key)
            variants["planned"].setdefault(slot, {})[p] = pp.steps()
            if pp.undivided_choice is not None:
                variants["undivided"].setdefault(slot, {})[p] = pp.undivided_choice.step_list()
            variants["default"].setdefault(slot, {})[p] = [("default", layer.key.batch_size)]
        missing = [(layer.name, p) for layer, p, pp in passes if pp.undivided_choice is None]
        if missing:
            excluded["undivided"] = f"no undivided plan fits the budget (e.g. layer {missing[0][0]}, {missing[0][1]})"
        ws = [pp.default_workspace_bytes for _, _, pp in passes]
        if any(w is None for w in ws):
            excluded["default"] = "PyTorch's default was not measured for every layer-pass"
        elif not self.settings.policy.admits(ws, self.settings.limit):
            need = self.settings.policy.network_workspace(ws)
            excluded["default"] = (f"PyTorch's default needs {format_bytes(need)} ({need} bytes) under policy "
                                   f"'{self.settings.policy.name}', over the budget")
        return {k: v for k, v in variants.items() if k not in excluded}, excluded

    # --- hooks ---
    @torch.compiler.disable
    def pre_hook(self, module: nn.Module, args) -> None:
        """Forward pre-hook of the planned model: plan an input not seen before (nothing else)."""
        if self._busy or torch.compiler.is_exporting() or not args:
            return
        x = args[0]
        if not (isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point() and x.shape[0] >= 1):
            self._current = None
            return
        key = InputKey.of(x)
        entry = self.plan.input_plan(key)
        if entry is None:
            entry = self.plan_new_input(x)
        self._current = entry

    def plan_layer(self, module: PlannedConv2d, x: torch.Tensor) -> InputPlan:
        """Plan ``module`` alone for its input ``x`` (see the module docstring); recorded in ``self.plan``."""
        if self._busy:
            raise WorkspaceError(f"layer {module.layer_name}: input {InputKey.of(x).describe()} has no plan "
                                 "while its model is being planned", hint="report this as a bug")
        t0 = time.perf_counter()
        s = self.settings
        key = InputKey.of(x)
        from batchcraft.microbatching.algorithms import ConvGeometry

        conv = module.original[0]
        call = ConvCall(module.layer_name, module, key, ConvGeometry.from_conv(conv, key.shape[2:]), x.requires_grad)
        lps = layer_passes([call], s.passes)
        limit = self._limit_alone(module.layer_name)
        self._busy = True
        try:
            with preserved_state(module):
                measurers = Measurers(self.cache, s)
                measured = measure(lps, s, measurers, limit)
                choices, undivided = optimise(lps, measured, s, measurers, limit)
        finally:
            self._busy = False
        entry = assemble(key, lps, measured, choices, undivided, origin="alone")
        if limit < s.limit:
            entry.notes.append(f"planned alone under {limit} bytes: what the other layers of input "
                               f"{self._current.key.describe()} leave of the budget (policy '{s.policy.name}')")
        module.set_steps(key, {p: pp.steps() for p, pp in entry.layers[0].passes.items()})
        entry.measured = measurers.measured
        _note_measurements(entry, measurers)
        entry.planning_s = time.perf_counter() - t0
        self.plan.inputs.append(entry)
        return entry

    def _limit_alone(self, name: str) -> int:
        s = self.settings
        if s.policy.per_layer_limit or self._current is None:
            return s.limit
        others = [pp.workspace_bytes for layer in self._current.layers if layer.name != name
                  for pp in layer.passes.values()]
        return max(0, s.limit - s.policy.network_workspace(others)) if others else s.limit

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_busy"], state["_current"] = False, None
        return state


def _steps_of(pp, which: str, batch: int):
    if which == "undivided":
        return pp.undivided_choice.step_list()
    if which == "default":
        return [("default", batch)]
    return pp.steps()


def keep(entry: InputPlan, verification) -> None:
    """Make ``entry``'s choices those of the kept variant (the optimiser's stays in ``optimizer_choice``)."""
    entry.verification = verification
    if verification.kept == "planned":
        return
    for layer in entry.layers:
        for pp in layer.passes.values():
            kept = pp.undivided_choice if verification.kept == "undivided" else PassChoice(
                (Config("default", layer.key.batch_size, pp.default_ms, pp.default_workspace_bytes),))
            if kept.steps != pp.choice.steps:
                pp.optimizer_choice, pp.choice = pp.choice, kept


def _configs_of(entry: InputPlan, lps: list[LayerPass]) -> set:
    """(table key, algorithm, micro_batch) of every configuration any variant of ``entry`` runs."""
    tk = {(lp.name, lp.key, lp.pass_): lp.table_key for lp in lps}
    out = set()
    for layer in entry.layers:
        for p, pp in layer.passes.items():
            t = tk[(layer.name, layer.key, p)]
            out.add((t, "default", layer.key.batch_size))
            for choice in (pp.choice, pp.undivided_choice, pp.optimizer_choice):
                if choice is not None:
                    out.update((t, c.algorithm, c.micro_batch) for c in choice.steps)
    return out
