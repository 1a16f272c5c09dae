"""Measure a plan end to end against PyTorch's default and the best undivided plan.

Used by ``batchcraft microbatch`` and ``benchmarks/microbatch.py``. Three variants of one model
share the same weights' values: ``default`` (the model as it is: PyTorch picks the algorithm,
no budget), ``undivided`` (the plan's best undivided alternative: the fastest algorithm per
layer-pass that fits the same budget, no division, from the same measurements) and ``planned``
(what ``microbatch`` returns: after its end-to-end verification this is the fastest of its own
plan, the undivided one and the default where the budget admits it, see ``plan.verification``).
The timed rounds here are a second, independent measurement of that choice.
They are timed in interleaved rounds (one call of each per round, the first one rotating, so
bursts of load on a shared machine hit all three alike); the median per variant is reported. Peak workspace is measured on
a separate, untimed run under :class:`~batchcraft.microbatching.execute.WorkspaceAudit`.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from batchcraft.microbatching.door import microbatch
from batchcraft.microbatching.execute import WorkspaceAudit
from batchcraft.microbatching.policies import get_policy

__all__ = ["compare", "example_input_for"]


def example_input_for(model: nn.Module, batch_size: int, image_size: int | None = None) -> torch.Tensor:
    """A random (batch, C, H, W) input: a DeepBench layer's own size, else 3 x image_size^2 (default 224)."""
    g = torch.Generator().manual_seed(0)
    shape = getattr(model, "input_size", None)
    if shape is None or image_size is not None:
        shape = (shape[0] if shape else 3, image_size or 224, image_size or 224)
    return torch.randn((batch_size, *shape), generator=g)


def _default_admitted(plan) -> bool:
    """Whether PyTorch's default, undivided, fits the budget under the plan's policy."""
    return get_policy(plan.policy).admits([pp.default_workspace_bytes for _, _, pp in plan.pass_plans()],
                                          plan.workspace_limit_bytes)


def _step(model: nn.Module, x: torch.Tensor, training: bool):
    if training:
        for p in model.parameters():
            p.grad = None
        model(x).sum().backward()
    else:
        with torch.no_grad():
            model(x)


def compare(model: nn.Module, example_input: torch.Tensor, workspace_limit, *, policy: str = "wr",
            batch_sizes: str = "powerOfTwo", training: bool = True, repeats: int = 5, cache=None,
            algorithms=None, progress: bool = True, audit: bool = True, verify: bool = True,
            verify_repeats: int = 5, plan=None, on_mismatch: str = "refuse", remeasure: bool = False) -> dict:
    """Plan ``model`` under ``workspace_limit`` and time it against the two baselines.

    Args:
        model (nn.Module): left unchanged (planned variants are deep copies).
        example_input (Tensor (N, C, H, W)): the batch timed and planned for.
        training (bool): forward + backward of ``sum(output)`` (train mode) if True, else
            forward only (eval mode, no_grad). Default: True.
        repeats (int): interleaved timed rounds. Default: 5.
        verify (bool): passed to :func:`microbatch` (end-to-end verification while planning). Default: True.
        verify_repeats (int): its timed rounds. Default: 5.
        plan, on_mismatch, remeasure: passed to :func:`microbatch` (re-apply a saved plan; measure again).
    Returns:
        dict: ``plan`` (Plan.to_dict()), ``plan_obj``, ``times_ms`` {variant: median},
        ``iqr_ms``, ``speedup_vs_default``, ``speedup_vs_undivided``, ``peak_workspace_bytes``
        {variant: max over layer-passes, measured}, ``max_abs_diff`` (eval forward, planned vs
        default), ``undivided_error`` (why no undivided plan exists, or None), ``kept`` (the
        variant the plan's verification kept, or None) and ``verification`` (its dict).
    """
    passes = "training" if training else "inference"
    planned = microbatch(copy.deepcopy(model), example_input, workspace_limit, batch_sizes=batch_sizes,
                         policy=policy, passes=passes, cache=cache, algorithms=algorithms, progress=progress,
                         verify=verify, verify_repeats=verify_repeats, plan=plan, on_mismatch=on_mismatch,
                         remeasure=remeasure)
    plan = planned.plan
    training = any(p != "forward" for p in plan.passes)  # a re-applied plan decides
    undivided, undivided_error = None, None
    missing = [(name, p) for name, p, pp in plan.pass_plans() if pp.undivided_choice is None]
    if missing:
        undivided_error = (f"no undivided algorithm fits workspace_limit={plan.workspace_limit_bytes} bytes for layer "
                           f"{missing[0][0]} ({missing[0][1]})" + (f" and {len(missing) - 1} more layer-passes"
                                                                    if len(missing) > 1 else ""))
    else:
        undivided = copy.deepcopy(planned)  # same weights' values; its session shares the cache
        for layer in undivided.plan.layers:
            module = undivided if layer.name == "" else undivided.get_submodule(layer.name)
            module.set_steps(layer.key, {p: pp.undivided_choice.step_list() for p, pp in layer.passes.items()})
    variants = {"default": model, "undivided": undivided, "planned": planned}
    variants = {k: v for k, v in variants.items() if v is not None}
    modes = {k: {m: m.training for m in v.modules()} for k, v in variants.items()}

    # same values? (eval forward, deterministic: no dropout, BN running stats)
    with torch.no_grad():
        outs = {k: v.eval()(example_input) for k, v in variants.items()}
    max_abs_diff = {k: float((o - outs["default"]).abs().max()) for k, o in outs.items() if k != "default"}
    ref_scale = float(outs["default"].abs().max())
    del outs
    for k, v in variants.items():
        v.train(training)

    peak = {}
    if audit:
        for k in ("undivided", "planned"):
            if k in variants:
                with WorkspaceAudit() as a:
                    _step(variants[k], example_input, training)
                peak[k] = max(a.peak_bytes.values(), default=0)

    times: dict[str, list[float]] = {k: [] for k in variants}
    for k, v in variants.items():  # warm-up: primitive caches, allocator
        _step(v, example_input, training)
    names = list(variants)
    for r in range(max(1, repeats)):
        for i in range(len(names)):
            k = names[(r + i) % len(names)]  # rotate who goes first: no variant always follows the same one
            v = variants[k]
            t0 = time.perf_counter()
            _step(v, example_input, training)
            times[k].append((time.perf_counter() - t0) * 1e3)
    for k, v in variants.items():  # restore the caller's train/eval flags
        for m, flag in modes[k].items():
            m.training = flag

    med = {k: statistics.median(t) for k, t in times.items()}
    iqr = {k: (statistics.quantiles(t, n=4)[2] - statistics.quantiles(t, n=4)[0]) if len(t) >= 4 else max(t) - min(t)
           for k, t in times.items()}
    return {
        "policy": plan.policy, "batch_sizes": plan.batch_sizes, "training": training,
        "workspace_limit_bytes": plan.workspace_limit_bytes, "batch_size": plan.batch_size,
        "times_ms": med, "iqr_ms": iqr, "repeats": max(1, repeats),
        "speedup_vs_default": med["default"] / med["planned"],
        "speedup_vs_undivided": (med["undivided"] / med["planned"]) if "undivided" in med else None,
        "peak_workspace_bytes": peak,
        "default_admitted": _default_admitted(plan),
        "max_abs_diff": max_abs_diff, "output_scale": ref_scale,
        "undivided_error": undivided_error,
        "kept": None if plan.verification is None else plan.verification.kept,
        "verification": None if plan.verification is None else plan.verification.to_dict(),
        "plan": plan.to_dict(), "plan_obj": plan,
    }
