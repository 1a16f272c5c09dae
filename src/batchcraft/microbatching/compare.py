"""Measure a plan end to end against PyTorch's default and the best undivided plan.

Used by ``batchcraft microbatch`` and ``benchmarks/microbatch.py``. Three variants of one model
share the same weights' values: ``default`` (the model as it is: PyTorch picks the algorithm,
no budget), ``undivided`` (our planner restricted to ``batch_sizes="undivided"``: the fastest
algorithm per layer that fits the same budget, no division) and ``planned`` (micro-batched).
They are timed in interleaved rounds (one call of each per round, so bursts of load on a shared
machine hit all three alike); the median per variant is reported. Peak workspace is measured on
a separate, untimed run under :class:`~batchcraft.microbatching.function.WorkspaceAudit`.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from batchcraft.errors import WorkspaceError
from batchcraft.microbatching.function import WorkspaceAudit
from batchcraft.microbatching.planner import microbatch

__all__ = ["compare", "example_input_for"]


def example_input_for(model: nn.Module, batch_size: int, image_size: int | None = None) -> torch.Tensor:
    """A random (batch, C, H, W) input: a DeepBench layer's own size, else 3 x image_size^2 (default 224)."""
    g = torch.Generator().manual_seed(0)
    shape = getattr(model, "input_size", None)
    if shape is None or image_size is not None:
        shape = (shape[0] if shape else 3, image_size or 224, image_size or 224)
    return torch.randn((batch_size, *shape), generator=g)


def _default_admitted(plan) -> bool:
    """Whether PyTorch's default, undivided, fits the budget (WR: every layer-pass; WD: their sum)."""
    ws = [pp.default_workspace_bytes for _, _, pp in plan.pass_plans()]
    if any(w is None for w in ws):
        return False
    return (sum(ws) if plan.policy == "wd" else max(ws, default=0)) <= plan.workspace_limit_bytes


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
            algorithms=None, progress: bool = True, audit: bool = True) -> dict:
    """Plan ``model`` under ``workspace_limit`` and time it against the two baselines.

    Args:
        model (nn.Module): left unchanged (planned variants are deep copies).
        example_input (Tensor (N, C, H, W)): the batch timed and planned for.
        training (bool): forward + backward of ``sum(output)`` (train mode) if True, else
            forward only (eval mode, no_grad). Default: True.
        repeats (int): interleaved timed rounds. Default: 5.
    Returns:
        dict: ``plan`` (Plan.to_dict()), ``plan_obj``, ``times_ms`` {variant: median},
        ``iqr_ms``, ``speedup_vs_default``, ``speedup_vs_undivided``, ``peak_workspace_bytes``
        {variant: max over layer-passes, measured}, ``max_abs_diff`` (eval forward, planned vs
        default), ``undivided_error`` (why no undivided plan exists, or None).
    """
    passes = "training" if training else "inference"
    opts = dict(policy=policy, passes=passes, cache=cache, algorithms=algorithms, progress=progress)
    planned = microbatch(copy.deepcopy(model), example_input, workspace_limit, batch_sizes=batch_sizes, **opts)
    undivided, undivided_error = None, None
    try:
        undivided = microbatch(copy.deepcopy(model), example_input, workspace_limit, batch_sizes="undivided", **opts)
    except WorkspaceError as exc:
        undivided_error = exc.message
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
    for _ in range(max(1, repeats)):
        for k, v in variants.items():
            t0 = time.perf_counter()
            _step(v, example_input, training)
            times[k].append((time.perf_counter() - t0) * 1e3)
    for k, v in variants.items():  # restore the caller's train/eval flags
        for m, flag in modes[k].items():
            m.training = flag

    med = {k: statistics.median(t) for k, t in times.items()}
    iqr = {k: (statistics.quantiles(t, n=4)[2] - statistics.quantiles(t, n=4)[0]) if len(t) >= 4 else max(t) - min(t)
           for k, t in times.items()}
    plan = planned.plan
    return {
        "policy": policy, "batch_sizes": batch_sizes, "training": training,
        "workspace_limit_bytes": plan.workspace_limit_bytes, "batch_size": plan.batch_size,
        "times_ms": med, "iqr_ms": iqr, "repeats": max(1, repeats),
        "speedup_vs_default": med["default"] / med["planned"],
        "speedup_vs_undivided": (med["undivided"] / med["planned"]) if "undivided" in med else None,
        "peak_workspace_bytes": peak,
        "default_admitted": _default_admitted(plan),
        "max_abs_diff": max_abs_diff, "output_scale": ref_scale,
        "undivided_error": undivided_error,
        "plan": plan.to_dict(), "plan_obj": plan,
    }
