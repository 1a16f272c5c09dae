"""The door: :func:`microbatch` plans (or re-applies a saved plan to) a model's convolutions."""

from __future__ import annotations

import copy
import os
from typing import Sequence

import torch
from torch import nn

from batchcraft.errors import ConfigurationError
from batchcraft.microbatching.algorithms import ConvGeometry
from batchcraft.microbatching.plan import Plan
from batchcraft.microbatching.planner import Settings, environment, open_cache
from batchcraft.microbatching.probe import _conv_of
from batchcraft.microbatching.session import PlanningSession
from batchcraft.microbatching.types import InputKey

__all__ = ["microbatch", "check_inputs", "environment_differences"]

_MISMATCH = ("refuse", "remeasure")


def check_inputs(model, example_input) -> None:
    """ConfigurationError unless ``model`` is a Module and ``example_input`` a floating (N, C, H, W) tensor, N >= 1."""
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"microbatch: model must be a torch.nn.Module, got {type(model).__name__}")
    if (not isinstance(example_input, torch.Tensor) or example_input.dim() != 4 or example_input.shape[0] < 1
            or not example_input.is_floating_point()):
        raise ConfigurationError("microbatch: example_input must be a floating 4-D tensor (N, C, H, W) with N >= 1, "
                                 f"got {getattr(example_input, 'shape', type(example_input).__name__)}"
                                 + (f" {example_input.dtype}" if isinstance(example_input, torch.Tensor) else ""))


def environment_differences(recorded: dict, current: dict) -> list[str]:
    """["threads: 4 (plan) vs 2 (here)", ...] for every field of the environment that differs."""
    names = {"device": "device", "torch": "torch version", "threads": "intra-op threads"}
    return [f"{names[k]}: {recorded.get(k)!r} (plan) vs {current.get(k)!r} (here)"
            for k in names if recorded.get(k) != current.get(k)]


def microbatch(model: nn.Module, example_input: torch.Tensor, workspace_limit="64MiB", policy: str = "wr",
               batch_sizes: str = "powerOfTwo", *, passes="training", cache=None,
               algorithms: Sequence[str] | None = None, repeats: int = 3, progress: bool = True,
               confirm: bool = True, verify: bool = True, verify_repeats: int = 5,
               plan: Plan | str | os.PathLike | None = None, on_mismatch: str = "refuse",
               remeasure: bool = False) -> nn.Module:
    """Replace every ``Conv2d`` of ``model`` by a micro-batched one planned under a workspace budget.

    Each convolution's mini-batch is divided into micro-batches so that faster algorithms fit the
    budget; values and gradients stay those of the original layers (to the rounding of the input's
    dtype). Only ``Conv2d`` is split: BatchNorm and every other layer see the whole batch, and
    planning runs the model once in eval mode on one sample with buffers and the random state
    restored, so running statistics and the caller's random stream are unchanged.

    The returned model plans every new input on first sight: an input of another spatial size,
    batch size, dtype (float32, float64, bfloat16, float16 where the device has kernels) or device
    is planned under the same budget and policy when first seen (``model.plan.inputs`` lists
    them); an input already planned measures nothing. Planning a new input costs what planning
    the example did (measuring what the cache lacks, then the verification's whole-model rounds,
    inside that forward call): a short last batch of an epoch pauses once. ``torch.compile(model)`` and
    ``torch.export.export(model, (x,))`` work (each planned convolution is the custom operator
    ``batchcraft::planned_conv2d``); export needs ``x``'s shape planned already.

    Args:
        model (nn.Module): modified in place and returned. Convolutions with non-zero padding
            modes, or not called by the example, stay as they are (listed in ``plan.skipped``).
        example_input (Tensor of shape (N, C, H, W)): a floating batch of the size, dtype and device
            to plan for first; N is the mini-batch divided.
        workspace_limit (int | str): bytes or "64MiB", "1.5GiB", ... Default: "64MiB".
        policy (str): "wr" (every layer-pass within the limit, DP) or "wd" (the sum over
            layer-passes within the limit, ILP); see :data:`~batchcraft.microbatching.policies.POLICIES`.
            Default: "wr".
        batch_sizes (str): micro-batch candidates "undivided", "powerOfTwo" or "all". Default: "powerOfTwo".
        passes (str | tuple): "training" (forward, backward_data, backward_filter) or "inference"
            (forward only; a backward then raises WorkspaceError). Default: "training".
        cache (None | str | Path | MeasurementCache | False | "refresh"): measurement cache; None:
            the user's cache directory; False: in memory only; "refresh": the user's cache, but
            every configuration is measured again (and overwritten). Default: None.
        algorithms (sequence of str | None): restrict to these algorithm names. Default: all.
        repeats (int): timed calls per configuration. Default: 3.
        progress (bool): progress bar on stderr while measuring. Default: True.
        confirm (bool): policies with a per-layer limit (WR): race each layer-pass's choice against
            the undivided best and PyTorch's default (if it fits) on the whole batch, interleaved;
            keep the fastest. Default: True.
        verify (bool): after planning an input, time the whole model (the passes planned) with the
            plan, with the best undivided plan under the same budget and, when its measured
            workspace fits the budget, with PyTorch's default; interleaved rounds, median; keep the
            fastest (a more elaborate variant must lead by more than 1% and two standard errors).
            When these times disagree with the cached per-layer times beyond noise, the plan says
            so and the configurations involved are measured again. Default: True.
        verify_repeats (int): timed rounds of the verification (>= 1). Default: 5.
        plan (Plan | str | Path | None): a plan to re-apply (a :class:`Plan` or a file written by
            ``model.plan.save(path)``): its inputs are installed without measuring, and its settings
            (budget, policy, candidates, passes, algorithms) replace the arguments above. Default: None.
        on_mismatch (str): a ``plan`` made on another device, torch version or intra-op thread
            count is refused ("refuse", ConfigurationError naming the differences) or planned again
            here under its settings ("remeasure"). Default: "refuse".
        remeasure (bool): measure everything again: ignore cached measurements and the choices of
            ``plan``. Default: False.
    Returns:
        nn.Module: ``model`` (or its replacement if ``model`` is itself a ``Conv2d``), with
        ``model.plan`` (a :class:`Plan`; ``model.plan.save(path)`` writes it).
    Raises:
        WorkspaceError: malformed budget, or no algorithm/division fits it; the message names the
            layer and the smallest feasible budget.
        ConfigurationError: bad policy, batch_sizes, passes, algorithm name or example input; a
            plan from another environment (``on_mismatch="refuse"``) or for another model.
        DataFormatError: a plan file that cannot be read (names the file and line).
    Source:
        μ-cuDNN (Oyama et al., arXiv 1804.04806), §III (WR: DP, WD: ILP; planning on first sight).
    Example:
        >>> m = batchcraft.models.get("resnet18")
        >>> m = batchcraft.microbatch(m, torch.randn(64, 3, 112, 112), "64MiB")  # doctest: +SKIP
        >>> print(m.plan.table())  # doctest: +SKIP
        >>> m.plan.save("resnet18.plan.json")  # doctest: +SKIP
    """
    check_inputs(model, example_input)
    if on_mismatch not in _MISMATCH:
        raise ConfigurationError(f"microbatch: on_mismatch must be one of {_MISMATCH}, got {on_mismatch!r}")
    cache_obj, refresh = open_cache(cache)
    options = dict(repeats=repeats, confirm=confirm, verify=verify, verify_repeats=verify_repeats, progress=progress,
                   refresh=refresh or remeasure)
    env = environment(example_input.device)
    if plan is None:
        settings = Settings.make(workspace_limit, policy, batch_sizes, passes, algorithms, **options)
        return _plan_fresh(model, example_input, settings, cache_obj, env)

    source = "the given plan" if isinstance(plan, Plan) else f"plan file {os.fspath(plan)}"
    loaded = copy.deepcopy(plan) if isinstance(plan, Plan) else Plan.load(plan)
    settings = Settings.make(loaded.workspace_limit_bytes, loaded.policy, loaded.batch_sizes, loaded.passes,
                             loaded.algorithms, **options)
    differences = environment_differences(loaded.environment, env)
    if differences and not (remeasure or on_mismatch == "remeasure"):
        raise ConfigurationError(
            f"microbatch: {source} was measured in another environment ({'; '.join(differences)}); its times "
            "and choices may not hold here",
            hint="pass on_mismatch='remeasure' (CLI: --remeasure) to plan again here under its settings, "
                 "or run with the plan's torch version and torch.set_num_threads()")
    if differences or remeasure:
        return _plan_fresh(model, example_input, settings, cache_obj, env)
    return _apply(model, example_input, loaded, settings, cache_obj, source)


def _finish(session: PlanningSession) -> nn.Module:
    root = session.root
    root.register_forward_pre_hook(session.pre_hook)
    root.plan = session.plan
    return root


def _plan_fresh(model, example_input, settings: Settings, cache, env) -> nn.Module:
    plan = Plan(settings.policy.name, settings.limit, settings.batch_sizes, settings.passes, settings.algorithms, env)
    session = PlanningSession(model, plan, settings, cache)
    session.plan_new_input(example_input, origin="example")
    return _finish(session)


def _apply(model, example_input, plan: Plan, settings: Settings, cache, source: str) -> nn.Module:
    """Install every input of ``plan`` without measuring (checked against the model's layers)."""
    modules = dict(model.named_modules())
    for entry in plan.inputs:
        for layer in entry.layers:
            conv = _conv_of(modules[layer.name]) if layer.name in modules else None
            if conv is None:
                raise ConfigurationError(f"microbatch: {source} plans layer {layer.name!r}, which this model "
                                         "does not have as a Conv2d", hint="was the plan made for another model?")
            want = ConvGeometry.from_conv(conv, (layer.geometry.height, layer.geometry.width))
            if want != layer.geometry:
                raise ConfigurationError(f"microbatch: {source}: layer {layer.name!r} is {want.key()} in this model "
                                         f"but {layer.geometry.key()} in the plan",
                                         hint="was the plan made for another model?")
    inputs, plan.inputs = plan.inputs, []
    session = PlanningSession(model, plan, settings, cache)
    for entry in inputs:
        for layer in entry.layers:
            session._ensure_module(layer.name, modules[layer.name])
        session.install(entry)
        plan.inputs.append(entry)
    plan.source = source
    if plan.input_plan(InputKey.of(example_input)) is None:  # the example itself was not in the file
        session.plan_new_input(example_input, origin="example")
    return _finish(session)
