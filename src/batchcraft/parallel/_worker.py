"""Worker side of :class:`batchcraft.parallel.workers.WorkerGroup` (runs inside an instance).

Protocol over a ``multiprocessing`` connection (pickled tuples), parent -> worker:
``("prepare", batch_size, warmup_s, variant)`` -> ``("prepared", calls, seconds_per_call)``;
``("run", start_at_monotonic_s, duration_s)`` -> ``("result", latencies_s, items, elapsed_s)``;
``("vrace", batch_size, variants, start_at, duration_s, block_s, min_rounds)`` ->
``("vraced", blocks)`` with blocks ``(round, variant index, calls, seconds)``: the variants
(already prepared) take turns in blocks of at least ``block_s`` seconds and one call, the first of
each round rotating, from ``start_at`` until ``duration_s`` and ``min_rounds`` rounds are done;
``("info",)`` -> ``("info", dict)``; ``("stop",)`` ends the worker. The worker says
``("ready", info)`` once its model is built. Any exception is sent as ``("error", text)``.

``variant`` is (matmul, conv, compile): the model-level knobs. Each variant's runner is built
the first time it is asked for (backends: :func:`batchcraft.parallel.backends.convert`, sharing
the weights; compile: ``torch.compile``) and checked against the default variant's output on the
batch before it is timed; a variant whose values differ beyond float32 rounding is an error.
"""

from __future__ import annotations

import os
import time
import traceback
from multiprocessing.connection import Connection

DEFAULT_VARIANT = ("default", "default", False)


def _info(spec, torch_preloaded: bool, pools: int) -> dict:
    import torch

    return {
        "pid": os.getpid(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "mkl_num_threads_env": os.environ.get("MKL_NUM_THREADS"),
        "omp_wait_policy_env": os.environ.get("OMP_WAIT_POLICY"),
        "ld_preload_env": os.environ.get("LD_PRELOAD"),
        "torch_loaded_before_bootstrap": torch_preloaded,
        "instance": spec.get("instance"),
        "executor_threads": pools,
    }


def check_close(got, want, what: str) -> None:
    """Raise AssertionError unless every tensor of ``got`` equals ``want``'s to float32 rounding."""
    import torch
    from torch.utils._pytree import tree_flatten

    g, _ = tree_flatten(got)
    w, _ = tree_flatten(want)
    if len(g) != len(w):
        raise AssertionError(f"{what}: {len(g)} outputs, the default variant gives {len(w)}")
    for a, b in zip(g, w):
        if isinstance(b, torch.Tensor):
            scale = max(1.0, float(b.detach().abs().max())) if b.numel() and b.is_floating_point() else 1.0
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


class Variants:
    """The runners of one workload, by variant (built on first use, checked against the default)."""

    def __init__(self, work, pools: int, intra: int | None):
        self.work, self.pools, self.intra = work, pools, intra
        self.runners = {DEFAULT_VARIANT: self._build(DEFAULT_VARIANT)}

    def _build(self, variant):
        from batchcraft.parallel.backends import convert
        from batchcraft.parallel.executor import InterOpExecutor

        matmul, conv, compiled = variant
        work = self.work
        if variant == DEFAULT_VARIANT:
            model = work.model
            if self.pools == 1:
                return work.call
        elif compiled:
            import torch

            model = torch.compile(work.model)
        else:
            from batchcraft.parallel.analysis import trace

            model = convert(work.model if self.pools == 1 else trace(work.model), matmul=matmul, conv=conv)
        if self.pools == 1:
            from batchcraft.parallel.workload import invoke

            return lambda x: invoke(model, x)
        ex = InterOpExecutor(model, self.pools, self.intra)
        return lambda x: ex(*x) if isinstance(x, (tuple, list)) else ex(x)

    def get(self, variant, x):
        variant = tuple(variant)
        runner = self.runners.get(variant)
        if runner is None:
            runner = self._build(variant)
            import torch

            with torch.inference_mode():
                check_close(runner(x), self.runners[DEFAULT_VARIANT](x), f"variant {variant}")
            self.runners[variant] = runner
        return runner


def _variant_race(runners, x, start_at, duration_s, block_s, min_rounds, first_call_s):
    """Blocks (round, variant, calls, seconds) of the variants taking turns (see the protocol)."""
    import torch

    blocks, k = [], len(runners)
    with torch.inference_mode():
        while time.monotonic() + first_call_s < start_at:  # keep the threads awake until the start
            runners[0](x)
        while time.monotonic() < start_at:
            time.sleep(max(0.0, min(0.002, start_at - time.monotonic())))
        end, r = start_at + duration_s, 0
        while r < min_rounds or time.monotonic() < end:
            for j in [(r + i) % k for i in range(k)]:
                n, t0 = 0, time.monotonic()
                while n < 1 or time.monotonic() - t0 < block_s:
                    runners[j](x)
                    n += 1
                blocks.append((r, j, n, time.monotonic() - t0))
            r += 1
    return blocks


def serve(spec: dict, *, torch_preloaded: bool) -> None:
    import torch

    from batchcraft.parallel.workload import build_workload

    conn = Connection(spec["fd"])
    try:
        work = build_workload(spec["model"], seed=spec.get("instance", 0))
        pools = int(spec.get("executor_threads") or 1)
        variants = Variants(work, pools, spec.get("intra_op_threads"))
        conn.send(("ready", _info(spec, torch_preloaded, pools)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", traceback.format_exc()))
        return
    runner, x, items, inputs, call_s, key = None, None, 0, {}, {}, None
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # parent gone
            return
        try:
            if msg[0] == "stop":
                return
            if msg[0] == "info":
                conn.send(("info", _info(spec, torch_preloaded, pools)))
            elif msg[0] == "prepare":
                _, batch_size, warmup_s, variant = msg
                key = (batch_size, tuple(variant))
                if batch_size not in inputs:
                    inputs[batch_size] = work.make_batch(batch_size)
                x, items = inputs[batch_size], batch_size
                warm = key in call_s  # already warmed up: nothing to do
                runner = variants.get(variant, x)
                # First time: at least one call (it builds kernels, packs weights, compiles) and
                # warmup_s; the last call's time estimates the per-call cost.
                calls, t0 = 0, time.perf_counter()
                with torch.inference_mode():
                    while not warm and (calls < 1 or time.perf_counter() - t0 < warmup_s):
                        t1 = time.perf_counter()
                        runner(x)
                        call_s[key] = time.perf_counter() - t1
                        calls += 1
                conn.send(("prepared", calls, call_s.get(key, 0.0)))
            elif msg[0] == "run":
                _, start_at, duration_s = msg
                latencies = []
                with torch.inference_mode():
                    # Untimed calls while one still fits before the start: OpenMP threads that
                    # slept while other configurations were measured are awake when timing starts.
                    while time.monotonic() + call_s.get(key, 0.0) < start_at:
                        runner(x)
                    while time.monotonic() < start_at:
                        time.sleep(max(0.0, min(0.002, start_at - time.monotonic())))
                    end = start_at + duration_s
                    while True:
                        t0 = time.monotonic()
                        # Stop when the next call would end more than half a call after the end:
                        # throughput counts whole calls over their own time, so this only keeps
                        # slow calls from overrunning the trial by up to one call.
                        if latencies and t0 + 0.5 * latencies[-1] >= end:
                            break
                        runner(x)
                        latencies.append(time.monotonic() - t0)
                conn.send(("result", latencies, len(latencies) * items, time.monotonic() - start_at))
            elif msg[0] == "vrace":
                _, batch_size, variant_list, start_at, duration_s, block_s, min_rounds = msg
                xb = inputs[batch_size]
                runners = [variants.get(v, xb) for v in variant_list]
                conn.send(("vraced", _variant_race(runners, xb, start_at, duration_s, block_s, min_rounds,
                                                   call_s.get((batch_size, tuple(variant_list[0])), 0.0))))
            else:
                conn.send(("error", f"unknown command {msg[0]!r}"))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
