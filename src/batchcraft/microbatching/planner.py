"""Plan and apply micro-batching to every ``Conv2d`` of a model (the work behind ``microbatch``).

Phases: (1) find the convolutions and their input shapes with one batch-1 run of the example in
eval mode (BatchNorm statistics untouched); (2) measure each distinct (geometry, pass) at every
candidate micro-batch size and algorithm, through the cache; (3) optimise per layer-pass (WR) or
across the network (WD); (4) replace each ``Conv2d`` by a :class:`PlannedConv2d`; (5) verify
end to end (:mod:`batchcraft.microbatching.verify`): time the whole model with the plan, the best
undivided plan and (if it fits the budget) PyTorch's default, and keep the fastest.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from batchcraft.errors import ConfigurationError, WorkspaceError
from batchcraft.microbatching.algorithms import PASSES, ConvGeometry, algorithms_for, get_algorithm
from batchcraft.microbatching.budget import format_bytes, parse_budget
from batchcraft.microbatching.cache import MeasurementCache
from batchcraft.microbatching.function import PlannedConv2d
from batchcraft.microbatching.measure import Measurer
from batchcraft.microbatching.optimize_wd import optimize_wd, pareto_front
from batchcraft.microbatching.optimize_wr import Config, PassChoice, candidate_sizes, optimize_wr
from batchcraft.microbatching.plan import LayerPlan, PassPlan, Plan
from batchcraft.microbatching import verify as _verify
from batchcraft.measure.progress import progress_bar

__all__ = ["find_convolutions", "plan_model", "microbatch", "install_plan"]

_PASS_SETS = {"inference": ("forward",), "training": PASSES}


def find_convolutions(model: nn.Module, example_input: torch.Tensor):
    """[(name, conv, geometry, input_requires_grad)] in call order, and {name: reason} for skipped ones."""
    seen: dict[str, list] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Conv2d):
            def hook(m, args, _name=name):
                seen.setdefault(_name, []).append((tuple(args[0].shape[1:]), args[0].requires_grad))
            hooks.append(mod.register_forward_pre_hook(hook))
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()  # eval: BatchNorm neither uses nor updates batch statistics here
        with torch.enable_grad():
            model(example_input[:1])
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes.items():
            m.training = training
    found, skipped = [], {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Conv2d):
            continue
        calls = seen.get(name)
        if not calls:
            skipped[name] = "not called by the example input"
        elif len({c[0] for c in calls}) > 1:
            skipped[name] = "called with several input shapes"
        elif isinstance(mod.padding, str) or mod.padding_mode != "zeros":
            skipped[name] = f"padding={mod.padding!r}, padding_mode={mod.padding_mode!r} (only zero padding is planned)"
        else:
            shape = calls[0][0]
            found.append((name, mod, ConvGeometry.from_conv(mod, shape[1:]), any(c[1] for c in calls)))
    return found, skipped


def _open_cache(cache) -> MeasurementCache:
    if isinstance(cache, MeasurementCache):
        return cache
    if cache is False:
        return MeasurementCache(":memory:")
    return MeasurementCache(cache)


def _smallest_feasible(table: dict[int, list[Config]], batch_size: int) -> int:
    """Smallest limit under which some division exists (times ignored)."""
    flat = {s: [Config(c.algorithm, c.micro_batch, 1.0, c.workspace_bytes) for c in cs] for s, cs in table.items()}
    for m in sorted({c.workspace_bytes for cs in flat.values() for c in cs}):
        if optimize_wr(flat, batch_size, m) is not None:
            return m
    raise WorkspaceError("no algorithm can run this layer at all")  # pragma: no cover - default always can


def _confirm_against_undivided(choices, undivided, defaults, layer_passes, measurer, batch, limit,
                               progress) -> None:
    """WR only: race each choice against the undivided best and PyTorch's default (when the
    default fits the limit) on the whole batch; keep the fastest.

    Per-configuration timings are sums of separate measurements; on a loaded machine one noisy
    sample can make a division (or another algorithm) look faster than it is. Racing the whole
    divisions in interleaved rounds guards the promises that a plan is never slower than the
    undivided one, nor than the default where the budget admits it.
    """
    todo = {}
    for name, _, g, p in layer_passes:
        options = [choices[(name, p)]]
        if undivided.get((name, p)) is not None:
            options.append(undivided[(name, p)])
        d_ms, d_ws = defaults[(g, p)]
        if d_ms is not None and d_ws <= limit:
            options.append(PassChoice((Config("default", batch, d_ms, d_ws),)))
        options = list({o.steps: o for o in options}.values())  # distinct divisions, order kept
        if len(options) > 1:
            todo.setdefault((g, p, tuple(o.steps for o in options)), ([], options))[0].append(name)
    for (g, p, _), (names, options) in progress_bar(todo.items(), desc="microbatch: confirming",
                                                    enabled=progress):
        steps = [[(s.algorithm, s.micro_batch) for s in o.steps] for o in options]
        times = measurer.race(g, p, batch, steps)
        best = options[min(range(len(options)), key=lambda i: (times[i], i))]
        for name in names:
            choices[(name, p)] = best


def plan_model(model: nn.Module, example_input: torch.Tensor, *, workspace_limit="64MiB", policy: str = "wr",
               batch_sizes: str = "powerOfTwo", passes="training", cache=None,
               algorithms: Sequence[str] | None = None, repeats: int = 3, progress: bool = True,
               confirm: bool = True):
    """Plan without changing the model; returns (Plan, [(name, conv)]). See :func:`microbatch`."""
    t_start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"microbatch: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_input, torch.Tensor) or example_input.dim() != 4 or example_input.shape[0] < 1:
        raise ConfigurationError("microbatch: example_input must be a 4-D tensor (N, C, H, W) with N >= 1, got "
                                 f"{getattr(example_input, 'shape', type(example_input).__name__)}")
    if policy not in ("wr", "wd"):
        raise ConfigurationError(f"microbatch: policy must be 'wr' or 'wd', got {policy!r}")
    try:
        sizes = candidate_sizes(int(example_input.shape[0]), batch_sizes)
    except ValueError as exc:
        raise ConfigurationError(f"microbatch: {exc}") from None
    wanted = _PASS_SETS.get(passes, passes) if isinstance(passes, str) else tuple(passes)
    if isinstance(wanted, str) or not wanted or any(p not in PASSES for p in wanted):
        raise ConfigurationError(f"microbatch: passes must be 'training', 'inference' or a subset of {PASSES}, got {passes!r}")
    if algorithms is not None:
        for a in algorithms:
            try:
                get_algorithm(a)
            except KeyError as exc:
                raise ConfigurationError(f"microbatch: {exc.args[0]}") from None
    limit = parse_budget(workspace_limit)
    batch, dtype = int(example_input.shape[0]), example_input.dtype

    convs, skipped = find_convolutions(model, example_input)
    layer_passes = []  # (name, conv, geom, pass)
    for name, conv, geom, input_grad in convs:
        for p in wanted:
            if p == "backward_filter" and not conv.weight.requires_grad:
                continue  # autograd will never ask for it (backward_data is planned even for the first
                # layer: a caller may differentiate with respect to the input)
            layer_passes.append((name, conv, geom, p))

    # measurement: each distinct (geometry, pass) once
    measurer = Measurer(_open_cache(cache), dtype=dtype, repeats=repeats, device=example_input.device)
    jobs = []
    for geom, p in dict.fromkeys((g, p) for _, _, g, p in layer_passes):
        for n in sizes:
            names = [a.name for a in algorithms_for(geom, p, n, dtype, None if algorithms is None else tuple(algorithms))]
            if n == batch and "default" not in names:
                names.append("default")  # always measured undivided: the baseline
            jobs += [(geom, p, n, a) for a in sorted(names, key=lambda a: a != "default")]
    tables: dict[tuple, dict[int, list[Config]]] = {}
    all_ws: dict[tuple, dict[int, list[Config]]] = {}
    defaults: dict[tuple, tuple[float | None, int]] = {}
    for geom, p, n, a in progress_bar(jobs, desc="microbatch: measuring", unit="config", enabled=progress):
        # the default, undivided, is always timed: it is the baseline even when it exceeds the budget
        baseline = n == batch and a == "default"
        rec = measurer.measure(geom, p, a, n, divided=n < batch, limit_bytes=None if baseline else limit)
        if n == batch and a == "default":
            defaults[(geom, p)] = (rec.time_ms, rec.workspace_bytes)
            if algorithms is not None and "default" not in algorithms:
                continue
        cfg = Config(a, n, rec.time_ms if rec.time_ms is not None else float("inf"), rec.workspace_bytes)
        all_ws.setdefault((geom, p), {}).setdefault(n, []).append(cfg)
        if rec.time_ms is not None:
            tables.setdefault((geom, p), {}).setdefault(n, []).append(cfg)

    # optimisation
    choices: dict[tuple[str, str], object] = {}
    for name, _, g, p in layer_passes:
        if batch not in all_ws.get((g, p), {}) and not any(s < batch for s in all_ws.get((g, p), {})):
            raise ConfigurationError(
                f"microbatch: layer {name} ({p}, {g.key()}): none of the algorithms {tuple(algorithms)} can run it",
                hint="add 'default' to algorithms")
    minimum = {(name, p): _smallest_feasible(all_ws[(g, p)], batch) for name, _, g, p in layer_passes}
    if policy == "wr":
        for name, _, g, p in layer_passes:
            choices[(name, p)] = optimize_wr(tables.get((g, p), {}), batch, limit)
        bad = [(k, minimum[k]) for k, c in choices.items() if c is None]
        if bad:
            (name, p), need = max(bad, key=lambda kv: kv[1])
            raise WorkspaceError(
                f"microbatch: layer {name} ({p}) cannot run within workspace_limit={format_bytes(limit)} "
                f"({limit} bytes, policy 'wr') with any algorithm and micro-batch candidates '{batch_sizes}'; "
                f"the smallest feasible budget for this model is {max(minimum.values())} bytes "
                f"({format_bytes(max(minimum.values()))})",
                hint="raise workspace_limit, or allow more algorithms / batch_sizes='all'")
    else:
        fronts = {(name, p): pareto_front(tables.get((g, p), {}), batch, limit) for name, _, g, p in layer_passes}
        result = None if any(not f for f in fronts.values()) else optimize_wd(fronts, limit)
        if result is None:
            need = sum(minimum.values())
            (name, p) = max(minimum, key=minimum.get)
            raise WorkspaceError(
                f"microbatch: the layers' smallest workspaces add up to {need} bytes ({format_bytes(need)}), over "
                f"workspace_limit={format_bytes(limit)} ({limit} bytes, policy 'wd'); the largest share is layer "
                f"{name} ({p}, {format_bytes(minimum[(name, p)])}); the smallest feasible budget is {need} bytes",
                hint="raise workspace_limit or use policy='wr' (limit per layer)")
        choices = result

    # baseline: the best *undivided* plan under the same budget and policy
    undivided_tables = {k: {batch: t.get(batch, [])} for k, t in tables.items()}
    if policy == "wr":
        undivided = {(name, p): optimize_wr(undivided_tables.get((g, p), {}), batch, limit)
                     for name, _, g, p in layer_passes}
    else:
        fronts_u = {(name, p): pareto_front(undivided_tables.get((g, p), {}), batch, limit)
                    for name, _, g, p in layer_passes}
        undivided = (None if any(not f for f in fronts_u.values()) else optimize_wd(fronts_u, limit)) or {}

    if policy == "wr" and confirm:
        _confirm_against_undivided(choices, undivided, defaults, layer_passes, measurer, batch, limit, progress)

    plan = Plan(policy, limit, batch, batch_sizes, skipped=skipped, measured=measurer.measured)
    by_name: dict[str, LayerPlan] = {}
    for name, conv, g, p in layer_passes:
        layer = by_name.get(name)
        if layer is None:
            layer = by_name[name] = LayerPlan(name, g)
            plan.layers.append(layer)
        default_ms, default_ws = defaults[(g, p)]
        und = undivided.get((name, p))
        layer.passes[p] = PassPlan(choices[(name, p)], default_ms, default_ws, None if und is None else und.time_ms,
                                   und)
    plan.planning_s = time.perf_counter() - t_start
    return plan, [(name, conv) for name, conv, _, _ in convs]


def _variants(plan: Plan) -> tuple[dict, dict]:
    """{variant: {layer: {pass: steps}}} of the admissible variants, and {variant: why excluded}."""
    passes = list(plan.pass_plans())
    variants = {"planned": {}, "undivided": {}, "default": {}}
    excluded = {}
    for name, p, pp in passes:
        variants["planned"].setdefault(name, {})[p] = pp.steps()
        if pp.undivided_choice is not None:
            variants["undivided"].setdefault(name, {})[p] = [(c.algorithm, c.micro_batch)
                                                             for c in pp.undivided_choice.steps]
        variants["default"].setdefault(name, {})[p] = [("default", plan.batch_size)]
    missing = [(name, p) for name, p, pp in passes if pp.undivided_choice is None]
    if missing:
        excluded["undivided"] = (f"no undivided plan fits the budget (e.g. layer {missing[0][0]}, "
                                 f"{missing[0][1]})")
    ws = [pp.default_workspace_bytes for _, _, pp in passes]
    if any(w is None for w in ws):
        excluded["default"] = "PyTorch's default was not measured for every layer-pass"
    else:
        need = sum(ws) if plan.policy == "wd" else max(ws, default=0)
        if need > plan.workspace_limit_bytes:
            excluded["default"] = (f"PyTorch's default needs {format_bytes(need)} "
                                   f"({'sum' if plan.policy == 'wd' else 'largest layer-pass'}), over the budget")
    return {k: v for k, v in variants.items() if k not in excluded}, excluded


def _keep(plan: Plan, verification) -> None:
    """Make the plan's choices those of the kept variant (the optimiser's stays in optimizer_choice)."""
    from batchcraft.microbatching.optimize_wr import Config, PassChoice

    plan.verification = verification
    if verification.kept == "planned":
        return
    for _, _, pp in plan.pass_plans():
        kept = pp.undivided_choice if verification.kept == "undivided" else PassChoice(
            (Config("default", plan.batch_size, pp.default_ms, pp.default_workspace_bytes),))
        if kept.steps != pp.choice.steps:
            pp.optimizer_choice, pp.choice = pp.choice, kept


def microbatch(model: nn.Module, example_input: torch.Tensor, workspace_limit="64MiB", policy: str = "wr",
               batch_sizes: str = "powerOfTwo", *, passes="training", cache=None,
               algorithms: Sequence[str] | None = None, repeats: int = 3, progress: bool = True,
               confirm: bool = True, verify: bool = True, verify_repeats: int = 5) -> nn.Module:
    """Replace every ``Conv2d`` of ``model`` by a micro-batched one planned under a workspace budget.

    Each convolution's mini-batch is divided into micro-batches so that faster algorithms fit the
    budget; values and gradients stay those of the original layers (to float32 rounding). Only
    ``Conv2d`` is split: BatchNorm and every other layer see the whole batch, and planning runs
    the model once in eval mode on one sample, so running statistics are not changed.

    Args:
        model (nn.Module): modified in place and returned. Convolutions with non-zero padding
            modes, or not called by the example, stay as they are (listed in ``plan.skipped``).
        example_input (Tensor of shape (N, C, H, W)): a batch of the size and dtype to plan for;
            N is the mini-batch divided. Other batch sizes still run (micro-batches are reused).
        workspace_limit (int | str): bytes or "64MiB", "1.5GiB", ... Default: "64MiB".
        policy (str): "wr" (every layer-pass within the limit, DP) or "wd" (the sum over
            layer-passes within the limit, ILP). Default: "wr".
        batch_sizes (str): micro-batch candidates "undivided", "powerOfTwo" or "all". Default: "powerOfTwo".
        passes (str | tuple): "training" (forward, backward_data, backward_filter) or "inference"
            (forward only; a backward then raises WorkspaceError). Default: "training".
        cache (None | str | Path | MeasurementCache | False): measurement cache; None: the user's
            cache directory; False: in memory only. Default: None.
        algorithms (sequence of str | None): restrict to these algorithm names. Default: all.
        repeats (int): timed calls per configuration. Default: 3.
        progress (bool): tqdm progress bar on stderr while measuring. Default: True.
        confirm (bool): WR only: race each layer-pass's choice against the undivided best and
            PyTorch's default (if it fits) on the whole batch, interleaved; keep the fastest.
            Default: True.
        verify (bool): after planning, time the whole model (the passes planned: forward, or
            forward + backward) with the plan, with the best undivided plan under the same
            budget and, when its measured workspace fits the budget, with PyTorch's default;
            interleaved rounds, median; keep the fastest, except that a more elaborate variant
            must lead a simpler one by more than 1% and two standard errors. The result
            is ``plan.verification``. A training plan is timed as a train-mode step; buffers,
            ``.grad``, the random state and train/eval flags are restored after. Default: True.
        verify_repeats (int): timed rounds of the verification (>= 1). Default: 5.
    Returns:
        nn.Module: ``model``, with ``model.plan`` (a :class:`Plan`).
    Raises:
        WorkspaceError: malformed budget, or no algorithm/division fits it; the message names the
            layer and the smallest feasible budget.
        ConfigurationError: bad policy, batch_sizes, passes, algorithm name or example input.
    Source:
        μ-cuDNN (Oyama et al., arXiv 1804.04806), §III (WR: DP, WD: ILP).
    Example:
        >>> m = batchcraft.models.get("resnet18")
        >>> m = batchcraft.microbatch(m, torch.randn(64, 3, 112, 112), "64MiB")  # doctest: +SKIP
        >>> print(m.plan.table())  # doctest: +SKIP
    """
    plan, convs = plan_model(model, example_input, workspace_limit=workspace_limit, policy=policy,
                             batch_sizes=batch_sizes, passes=passes, cache=cache, algorithms=algorithms,
                             repeats=repeats, progress=progress, confirm=confirm)
    model, modules = install_plan(model, plan, convs)
    if verify and modules:
        variants, excluded = _variants(plan)
        training = any(p != "forward" for _, p, _ in plan.pass_plans())
        t0 = time.perf_counter()
        verification = _verify.verify_plan(model, example_input, modules, variants, training=training,
                                           repeats=verify_repeats, timer=_verify.wall_clock_ms,
                                           excluded=excluded, progress=progress)
        _keep(plan, verification)
        plan.planning_s += time.perf_counter() - t0
    model.plan = plan
    return model


def install_plan(model: nn.Module, plan: Plan, convs, which: str = "kept"):
    """Replace each planned ``Conv2d`` of ``model`` by a :class:`PlannedConv2d`; returns (model, {name: module}).

    ``which``: ``"kept"`` runs ``plan``'s choices, ``"undivided"`` the best undivided plan's
    (every layer-pass must have one). ``convs``: [(name, Conv2d)] as returned by :func:`plan_model`.
    """
    layers = {layer.name: layer for layer in plan.layers}
    modules = {}
    for name, conv in convs:
        layer = layers[name]
        steps = {p: (pp.steps() if which == "kept" else [(c.algorithm, c.micro_batch) for c in pp.undivided_choice.steps])
                 for p, pp in layer.passes.items()}
        planned = modules[name] = PlannedConv2d(conv, name, layer.geometry, steps)
        if name == "":
            model = planned
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, planned)
    return model, modules
