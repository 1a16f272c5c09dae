"""Planning one input in three stages: measure, optimise, assemble.

1. :func:`measure`: each distinct (geometry, pass, batch, dtype, device) at every candidate
   micro-batch size and every algorithm that can run it, through the measurement cache;
   PyTorch's default, undivided, is always timed (the baseline).
2. :func:`optimise`: the policy's optimiser (WR: DP per layer-pass; WD: ILP over the network) and
   the best undivided plan under the same budget; WR choices are then confirmed per layer-pass
   against the undivided best and the default in interleaved rounds on the whole batch.
3. :func:`assemble`: an :class:`~batchcraft.microbatching.plan.InputPlan` of the choices.

Finding the convolutions (:mod:`batchcraft.microbatching.probe`) comes before, installing and
verifying the plan (:mod:`batchcraft.microbatching.session`) after. :func:`plan_model` runs the
three stages for an example input without changing the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from batchcraft.errors import ConfigurationError
from batchcraft.measure.progress import progress_bar
from batchcraft.microbatching.algorithms import PASSES, ConvGeometry, algorithms_for, get_algorithm, unsupported_algorithms
from batchcraft.microbatching.budget import parse_budget
from batchcraft.microbatching.cache import MeasurementCache
from batchcraft.microbatching.measure import Measurer
from batchcraft.microbatching.optimize_wr import candidate_sizes, smallest_feasible
from batchcraft.microbatching.plan import InputPlan, LayerPlan, PassPlan, Plan
from batchcraft.microbatching.policies import Policy, get_policy
from batchcraft.microbatching.probe import ConvCall, find_convolutions
from batchcraft.microbatching.types import Config, InputKey, PassChoice

__all__ = ["Settings", "LayerPass", "Measured", "Measurers", "layer_passes", "measure", "optimise", "assemble",
           "plan_input", "plan_model", "environment"]

_PASS_SETS = {"inference": ("forward",), "training": PASSES}


@dataclass(frozen=True)
class Settings:
    """What every input of one plan is planned under (see :func:`~batchcraft.microbatch` for each)."""

    policy: Policy
    limit: int
    batch_sizes: str
    passes: tuple[str, ...]
    algorithms: tuple[str, ...] | None = None
    repeats: int = 3
    confirm: bool = True
    verify: bool = True
    verify_repeats: int = 5
    progress: bool = True
    refresh: bool = False

    @classmethod
    def make(cls, workspace_limit, policy, batch_sizes, passes, algorithms, **kw) -> "Settings":
        """Validated settings. Raises ConfigurationError (bad option) or WorkspaceError (bad budget)."""
        pol = get_policy(policy)
        try:
            candidate_sizes(2, batch_sizes)
        except ValueError as exc:
            raise ConfigurationError(f"microbatch: {exc}") from None
        wanted = _PASS_SETS.get(passes, passes) if isinstance(passes, str) else tuple(passes)
        if isinstance(wanted, str) or not wanted or any(p not in PASSES for p in wanted):
            raise ConfigurationError(
                f"microbatch: passes must be 'training', 'inference' or a subset of {PASSES}, got {passes!r}")
        if algorithms is not None:
            algorithms = tuple(algorithms)
            for a in algorithms:
                try:
                    get_algorithm(a)
                except KeyError as exc:
                    raise ConfigurationError(f"microbatch: {exc.args[0]}") from None
        return cls(pol, parse_budget(workspace_limit), batch_sizes, tuple(p for p in PASSES if p in wanted),
                   algorithms, **kw)


def environment(device: torch.device | str = "cpu") -> dict:
    """What measurements depend on beyond the layer: device name, torch version, intra-op threads."""
    from batchcraft.microbatching.measure import device_name

    return {"device": device_name(torch.device(device)), "torch": torch.__version__, "threads": torch.get_num_threads()}


@dataclass(frozen=True)
class LayerPass:
    """One pass of one layer for one input; ``id`` is the optimisers' key (name, pass, input)."""

    name: str
    key: InputKey
    geometry: ConvGeometry
    pass_: str

    @property
    def id(self) -> tuple:
        return (self.name, self.pass_, self.key)

    @property
    def table_key(self) -> tuple:
        return (self.geometry, self.pass_, self.key.batch_size, self.key.dtype, self.key.device)


def layer_passes(calls: Sequence[ConvCall], passes: Sequence[str]) -> list[LayerPass]:
    """The layer-passes to plan. backward_filter only where the weight requires grad (autograd never asks
    otherwise); backward_data even for the first layer (a caller may differentiate with respect to the input)."""
    out = []
    for c in calls:
        for p in passes:
            if p == "backward_filter" and not c.module.weight.requires_grad:
                continue
            out.append(LayerPass(c.name, c.key, c.geometry, p))
    return out


class Measurers:
    """One :class:`Measurer` per (dtype, device), sharing a cache; counts what they measured."""

    def __init__(self, cache: MeasurementCache, settings: Settings):
        self.cache, self.settings = cache, settings
        self._by: dict[tuple[str, str], Measurer] = {}

    def __call__(self, key: InputKey) -> Measurer:
        k = (key.dtype, key.device)
        if k not in self._by:
            self._by[k] = Measurer(self.cache, dtype=key.torch_dtype, repeats=self.settings.repeats,
                                   device=key.device, refresh=self.settings.refresh)
        return self._by[k]

    @property
    def measured(self) -> int:
        return sum(m.measured for m in self._by.values())

    @property
    def remeasured_noisy(self) -> int:
        return sum(m.remeasured_noisy for m in self._by.values())

    @property
    def noisy(self) -> list:
        return [k for m in self._by.values() for k in m.noisy]


@dataclass
class Measured:
    """What stage 1 measured, per table key (geometry, pass, batch, dtype, device).

    Attributes:
        tables: {table key: {micro_batch: [Config]}} timed configurations within the budget.
        all_ws: the same with every configuration measured (untimed ones with time inf).
        defaults: {table key: (time_ms or None, workspace_bytes)} of PyTorch's default, undivided.
        unsupported: {"algorithm pass": why} of the algorithms skipped for a dtype or device.
    """

    tables: dict = field(default_factory=dict)
    all_ws: dict = field(default_factory=dict)
    defaults: dict = field(default_factory=dict)
    unsupported: dict = field(default_factory=dict)


def measure(lps: Sequence[LayerPass], settings: Settings, measurers: Measurers, limit: int | None = None,
            refresh: set | None = None) -> Measured:
    """Stage 1: measure every configuration the optimisers may choose from (cache first).

    ``refresh``: configurations ``(table key, algorithm, micro_batch)`` to measure again even if cached.
    """
    limit = settings.limit if limit is None else limit
    out = Measured()
    jobs = []
    for tk in dict.fromkeys(lp.table_key for lp in lps):
        geom, p, batch, dtype, device = tk
        key = next(lp.key for lp in lps if lp.table_key == tk)
        out.unsupported.update(unsupported_algorithms((p,), key.torch_dtype, device, settings.algorithms))
        for n in candidate_sizes(batch, settings.batch_sizes):
            names = [a.name for a in algorithms_for(geom, p, n, key.torch_dtype, settings.algorithms, device)]
            if n == batch and "default" not in names:
                names.append("default")  # always measured undivided: the baseline
            jobs += [(tk, key, n, a) for a in sorted(names, key=lambda a: a != "default")]
    for tk, key, n, a in progress_bar(jobs, desc="microbatch: measuring", unit="config", enabled=settings.progress):
        geom, p, batch = tk[0], tk[1], tk[2]
        # the default, undivided, is always timed: it is the baseline even when it exceeds the budget
        baseline = n == batch and a == "default"
        rec = measurers(key).measure(geom, p, a, n, divided=n < batch, limit_bytes=None if baseline else limit,
                                     refresh=refresh is not None and (tk, a, n) in refresh)
        if baseline:
            out.defaults[tk] = (rec.time_ms, rec.workspace_bytes)
            if settings.algorithms is not None and "default" not in settings.algorithms:
                continue
        cfg = Config(a, n, rec.time_ms if rec.time_ms is not None else float("inf"), rec.workspace_bytes, rec.spread)
        out.all_ws.setdefault(tk, {}).setdefault(n, []).append(cfg)
        if rec.time_ms is not None:
            out.tables.setdefault(tk, {}).setdefault(n, []).append(cfg)
    return out


def _confirm(choices: dict, undivided: dict, lps: Sequence[LayerPass], measured: Measured, measurers: Measurers,
             limit: int, progress: bool) -> None:
    """Race each layer-pass's choice against the undivided best and PyTorch's default (when the
    default fits the limit) on the whole batch; keep the fastest (policies with a per-layer limit only).

    Per-configuration timings are sums of separate measurements; on a loaded machine one noisy
    sample can make a division (or another algorithm) look faster than it is. Racing the whole
    divisions in interleaved rounds guards the promises that a plan is never slower than the
    undivided one, nor than the default where the budget admits it.
    """
    todo = {}
    for lp in lps:
        options = [choices[lp.id]]
        if undivided.get(lp.id) is not None:
            options.append(undivided[lp.id])
        d_ms, d_ws = measured.defaults[lp.table_key]
        if d_ms is not None and d_ws <= limit:
            options.append(PassChoice((Config("default", lp.key.batch_size, d_ms, d_ws),)))
        options = list({o.steps: o for o in options}.values())  # distinct divisions, order kept
        if len(options) > 1:
            todo.setdefault((lp.table_key, tuple(o.steps for o in options)), ([], options, lp.key))[0].append(lp.id)
    for (tk, _), (ids, options, key) in progress_bar(todo.items(), desc="microbatch: confirming", enabled=progress):
        times = measurers(key).race(tk[0], tk[1], tk[2], [o.step_list() for o in options])
        best = options[min(range(len(options)), key=lambda i: (times[i], i))]
        for i in ids:
            choices[i] = best


def optimise(lps: Sequence[LayerPass], measured: Measured, settings: Settings, measurers: Measurers,
             limit: int | None = None) -> tuple[dict, dict]:
    """Stage 2: ({layer-pass id: PassChoice}, {id: best undivided PassChoice or None}) under the policy.

    Raises:
        WorkspaceError: no division fits (names the layer and the smallest feasible budget).
        ConfigurationError: the allowed algorithms cannot run some layer-pass at all.
    """
    limit = settings.limit if limit is None else limit
    policy = settings.policy
    for lp in lps:
        if not measured.all_ws.get(lp.table_key):
            raise ConfigurationError(
                f"microbatch: layer {lp.name} ({lp.pass_}, {lp.geometry.key()}, {lp.key.dtype}): none of the "
                f"algorithms {settings.algorithms} can run it", hint="add 'default' to algorithms")
    if not lps:
        return {}, {}
    batch = {lp.key.batch_size for lp in lps}
    tables = {lp.id: measured.tables.get(lp.table_key, {}) for lp in lps}
    # one optimiser call per batch size (a plan's layers normally share one)
    choices, undivided = {}, {}
    for b in sorted(batch):
        part = {i: t for i, t in tables.items() if i[2].batch_size == b}
        chosen = policy.optimise(part, b, limit)
        if chosen is None:
            minimum = {lp.id: smallest_feasible(measured.all_ws[lp.table_key], b) or 0 for lp in lps
                       if lp.key.batch_size == b}
            raise policy.explain_infeasible(minimum, limit, settings.batch_sizes)
        choices.update(chosen)
        undivided.update(policy.undivided(part, b, limit))
    if policy.per_layer_limit and settings.confirm:
        _confirm(choices, undivided, lps, measured, measurers, limit, settings.progress)
    return choices, undivided


def assemble(key: InputKey, lps: Sequence[LayerPass], measured: Measured, choices: dict, undivided: dict,
             skipped: dict | None = None, origin: str = "example") -> InputPlan:
    """Stage 3: the :class:`InputPlan` of ``choices`` (layers in call order, one LayerPlan per layer and input)."""
    entry = InputPlan(key, skipped=dict(skipped or {}), unsupported=dict(measured.unsupported), origin=origin)
    by_layer: dict[tuple, LayerPlan] = {}
    for lp in lps:
        layer = by_layer.get((lp.name, lp.key))
        if layer is None:
            layer = by_layer[(lp.name, lp.key)] = LayerPlan(lp.name, lp.geometry, key=lp.key)
            entry.layers.append(layer)
        default_ms, default_ws = measured.defaults[lp.table_key]
        und = undivided.get(lp.id)
        layer.passes[lp.pass_] = PassPlan(choices[lp.id], default_ms, default_ws,
                                          None if und is None else und.time_ms, und)
    return entry


def plan_input(model: nn.Module, example_input: torch.Tensor, settings: Settings, cache: MeasurementCache,
               origin: str = "example") -> tuple[InputPlan, list[ConvCall], Measurers]:
    """Probe, measure, optimise, assemble for one input; the model is not changed."""
    t0 = time.perf_counter()
    calls, skipped = find_convolutions(model, example_input)
    lps = layer_passes(calls, settings.passes)
    measurers = Measurers(cache, settings)
    measured = measure(lps, settings, measurers)
    choices, undivided = optimise(lps, measured, settings, measurers)
    entry = assemble(InputKey.of(example_input), lps, measured, choices, undivided, skipped, origin)
    entry.measured = measurers.measured
    _note_measurements(entry, measurers)
    entry.planning_s = time.perf_counter() - t0
    return entry, calls, measurers


def _note_measurements(entry: InputPlan, measurers: Measurers) -> None:
    if measurers.remeasured_noisy:
        entry.notes.append(f"{measurers.remeasured_noisy} cached measurements had a large spread (taken while the "
                           "machine was busy) and were measured again")
    if measurers.noisy:
        entry.notes.append(f"{len(measurers.noisy)} configurations still had a spread above the limit after "
                           "re-timing (busy machine?): plan on quiet cores or re-measure (cache='refresh')")


def open_cache(cache) -> tuple[MeasurementCache, bool]:
    """(cache, refresh) from ``microbatch``'s ``cache`` argument (None, path, MeasurementCache, False, "refresh")."""
    if isinstance(cache, MeasurementCache):
        return cache, False
    if cache is False:
        return MeasurementCache(":memory:"), False
    if cache == "refresh":
        return MeasurementCache(None), True
    return MeasurementCache(cache), False


def plan_model(model: nn.Module, example_input: torch.Tensor, *, workspace_limit="64MiB", policy: str = "wr",
               batch_sizes: str = "powerOfTwo", passes="training", cache=None,
               algorithms: Sequence[str] | None = None, repeats: int = 3, progress: bool = True,
               confirm: bool = True) -> tuple[Plan, list[tuple[str, nn.Module]]]:
    """Plan ``model`` for ``example_input`` without changing it (no verification; see :func:`~batchcraft.microbatch`).

    Returns:
        (Plan, [(layer name, Conv2d)]): the plan and the convolutions it covers.
    Raises:
        WorkspaceError, ConfigurationError: as :func:`~batchcraft.microbatch`.
    """
    from batchcraft.microbatching.door import check_inputs

    check_inputs(model, example_input)
    cache_obj, refresh = open_cache(cache)
    settings = Settings.make(workspace_limit, policy, batch_sizes, passes, algorithms, repeats=repeats,
                             confirm=confirm, verify=False, progress=progress, refresh=refresh)
    entry, calls, _ = plan_input(model, example_input, settings, cache_obj)
    plan = Plan(settings.policy.name, settings.limit, settings.batch_sizes, settings.passes, settings.algorithms,
                environment(example_input.device), [entry])
    return plan, list({c.name: c.module for c in calls}.items())
