"""Side-by-side run of a per-instance model: eager loop vs. ``batchcraft.autobatch``.

Both run the same per-instance code on the same batches, in one process, one
after the other per batch; outputs are compared element-wise. Times are the
median over batches of ms per batch (after one warm-up batch that pays for
signature inference and static-block tracing).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from batchcraft.autobatching import autobatch


def _max_abs_diff(a, b) -> float:
    if isinstance(a, torch.Tensor):
        return (a.detach().float() - b.detach().float()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        return max((_max_abs_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (tuple, list)):
        return max((_max_abs_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0 if a == b else float("inf")


def batches(items: Sequence, size: int) -> list:
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def compare_eager(fn: Callable, instances: Sequence, *, batch_size: int = 64, scheduler: str = "depth",
                  progress: bool = False, warmup: bool = True, grad: bool = False,
                  reference: Callable[[list], list] | None = None,
                  work: Callable[[object], int] | None = None, split_passes: int = 0) -> dict:
    """Run ``fn`` eagerly (one instance at a time) and auto-batched; return figures.

    Args:
        fn: per-instance function.
        instances: all instances; split into batches of ``batch_size``.
        grad (bool): run with autograd on (default: inference under ``torch.no_grad``).
        reference (callable, optional): ``reference(batch) -> list`` computing a whole batch by
            hand (e.g. level by level); timed right after the other two on every batch and
            checked against the eager results (``reference_ms``, ``reference_max_abs_diff``).
        work (callable, optional): ``work(instance) -> units`` (tree nodes, tokens) for the
            recording cost per unit (``record_us_per_unit``). Default: ``len(instance)`` where the
            instance has a length, else 1.
        split_passes (int): after the timed pass, this many more auto-batched passes over the
            batches, back to back (no eager loop in between, as in a user's loop of calls): the
            per-batch medians of their time split give ``steady_record_ms`` (and schedule, gather,
            kernel) and ``steady_record_us_per_unit``; the timed pass's figures stay as they are.
            Default 0 (none).
    Returns:
        dict with ``eager_ms`` and ``batchcraft_ms`` (median ms per batch), ``speedup``,
        ``instances_per_s_eager`` / ``_batchcraft`` (instances per batch, on average, over the median batch time), ``max_abs_diff``, ``batched_calls`` and
        ``ops_recorded`` (per batch, summed then averaged), ``mean_batch``, ``fallbacks``,
        ``fused_kernels`` / ``steps_fused`` (per batch: elementwise steps run in fused kernels), the
        time split of the auto-batched runs, ``record_us_per_op`` / ``record_us_per_unit`` (host µs
        of recording), and ``first_call_ms`` (the first auto-batched call of the process on the
        first batch: signatures inferred, blocks traced, kernels chosen) with
        ``first_call_ratio`` (over that batch's steady time, ``first_batch_ms``: its first timed
        call, not the median over batches).
    """
    bs = batches(instances, batch_size)
    f = autobatch(fn, scheduler=scheduler)
    ctx = torch.enable_grad if grad else torch.no_grad
    it = bs
    if progress:
        from batchcraft.measure.progress import progress_bar

        it = progress_bar(bs, desc="batches", unit="batch")
    eager_t, bc_t, diffs, ref_t, ref_diffs = [], [], [], [], []
    totals = dict(batched_calls=0, ops_recorded=0, fallbacks=0, eager_ops=0, syncs=0, fused_kernels=0,
                  steps_fused=0, record_s=0.0, schedule_s=0.0, gather_s=0.0, kernel_s=0.0)
    first_ms = None
    with ctx():
        if warmup and bs:
            t0 = time.perf_counter()
            f(bs[0])
            first_ms = (time.perf_counter() - t0) * 1e3
            [fn(x) for x in bs[0]]  # the eager loop gets its warm-up call too (caches, allocator)
            if reference is not None:
                reference(bs[0])
        for b in it:
            t0 = time.perf_counter()
            ref = [fn(x) for x in b]
            t1 = time.perf_counter()
            out = f(b)
            t2 = time.perf_counter()
            eager_t.append(t1 - t0)
            bc_t.append(t2 - t1)
            diffs.append(max(_max_abs_diff(o, r) for o, r in zip(out, ref)))
            if reference is not None:
                t3 = time.perf_counter()
                hand = reference(b)
                ref_t.append(time.perf_counter() - t3)
                ref_diffs.append(max(_max_abs_diff(o, r) for o, r in zip(hand, ref)))
            st = f.stats
            for k in totals:
                totals[k] += getattr(st, k)
        steady = {k: [[] for _ in bs] for k in ("record_s", "schedule_s", "gather_s", "kernel_s")}
        for _ in range(split_passes):
            for i, b in enumerate(bs):
                f(b)
                for k, per_batch in steady.items():
                    per_batch[i].append(getattr(f.stats, k))
    nb = max(len(bs), 1)
    e_ms = statistics.median(eager_t) * 1e3 if eager_t else 0.0
    b_ms = statistics.median(bc_t) * 1e3 if bc_t else 0.0
    n_inst = len(instances)
    res = {
        "batch_size": batch_size,
        "batches": len(bs),
        "instances": n_inst,
        "eager_ms": e_ms,
        "batchcraft_ms": b_ms,
        "speedup": e_ms / b_ms if b_ms else 0.0,
        # from the same medians as ms/batch, so the columns agree with the speed-up; the
        # instances a batch actually holds (a short or partial batch is not batch_size)
        "instances_per_s_eager": n_inst / nb / (e_ms / 1e3) if e_ms else 0.0,
        "instances_per_s_batchcraft": n_inst / nb / (b_ms / 1e3) if b_ms else 0.0,
        "max_abs_diff": max(diffs) if diffs else 0.0,
        "batched_calls": totals["batched_calls"] / nb,
        "ops_recorded": totals["ops_recorded"] / nb,
        "mean_batch": totals["ops_recorded"] / totals["batched_calls"] if totals["batched_calls"] else 0.0,
        "fallbacks": totals["fallbacks"],
        "eager_ops": totals["eager_ops"],
        "syncs_per_batch": totals["syncs"] / nb,
        "fused_kernels": totals["fused_kernels"] / nb,
        "steps_fused": totals["steps_fused"] / nb,
        "scheduler": scheduler,
    }
    for k in ("record_s", "schedule_s", "gather_s", "kernel_s"):
        res[k.replace("_s", "_ms")] = totals[k] / nb * 1e3
    if reference is not None:
        res["reference_ms"] = statistics.median(ref_t) * 1e3 if ref_t else 0.0
        res["reference_max_abs_diff"] = max(ref_diffs) if ref_diffs else 0.0
    if work is None:
        def work(x):
            return len(x) if hasattr(x, "__len__") else 1
    units = sum(work(x) for b in bs for x in b) / nb
    res["work_units"] = units
    res["record_us_per_unit"] = totals["record_s"] / nb * 1e6 / units if units else 0.0
    if split_passes > 0 and bs:
        res["split_passes"] = split_passes
        for k, per_batch in steady.items():  # per batch: the median over the passes; then the mean per batch
            res["steady_" + k.replace("_s", "_ms")] = sum(statistics.median(v) for v in per_batch) / nb * 1e3
        res["steady_record_us_per_unit"] = res["steady_record_ms"] * 1e3 / units if units else 0.0
    if first_ms is not None:
        res["first_call_ms"] = first_ms
        steady = bc_t[0] * 1e3 if bc_t else 0.0
        res["first_batch_ms"] = steady  # that batch's first timed (steady) call, not the median
        res["first_call_ratio"] = first_ms / steady if steady else 0.0
    res["record_us_per_op"] = totals["record_s"] * 1e6 / totals["ops_recorded"] if totals["ops_recorded"] else 0.0
    return res
