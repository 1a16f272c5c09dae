"""Worker side of :class:`batchcraft.parallel.launcher.WorkerGroup` (runs inside an instance).

Protocol over a ``multiprocessing`` connection (pickled tuples), parent -> worker:
``("prepare", batch_size, warmup_s)`` -> ``("prepared", calls, seconds_per_call)``;
``("run", start_at_monotonic_s, duration_s)`` -> ``("result", latencies_s, items, elapsed_s)``;
``("info",)`` -> ``("info", dict)``; ``("stop",)`` ends the worker. The worker says
``("ready", info)`` once its model is built. Any exception is sent as ``("error", text)``.
"""

from __future__ import annotations

import os
import time
import traceback
from multiprocessing.connection import Connection


def _info(spec, torch_preloaded: bool, runner) -> dict:
    import torch

    info = {
        "pid": os.getpid(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "mkl_num_threads_env": os.environ.get("MKL_NUM_THREADS"),
        "torch_loaded_before_bootstrap": torch_preloaded,
        "instance": spec.get("instance"),
    }
    info["executor_threads"] = len(getattr(runner, "_threads", ())) or 1
    return info


def serve(spec: dict, *, torch_preloaded: bool) -> None:
    import torch

    from batchcraft.parallel.executor import InterOpExecutor
    from batchcraft.parallel.workload import build_workload

    conn = Connection(spec["fd"])
    try:
        work = build_workload(spec["model"], model_kwargs=spec.get("model_kwargs"),
                              image_size=spec.get("image_size"), seed=spec.get("instance", 0))
        pools = int(spec.get("executor_threads") or 1)
        runner = work.call if pools == 1 else InterOpExecutor(work.model, pools, spec.get("intra_op_threads"))
        conn.send(("ready", _info(spec, torch_preloaded, runner)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", traceback.format_exc()))
        return
    x, items, inputs, call_s = None, 0, {}, {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # parent gone
            return
        try:
            if msg[0] == "stop":
                return
            if msg[0] == "info":
                conn.send(("info", _info(spec, torch_preloaded, runner)))
            elif msg[0] == "prepare":
                _, batch_size, warmup_s = msg
                warm = batch_size in inputs  # already warmed up at this size: nothing to do
                if not warm:
                    inputs[batch_size] = work.make_batch(batch_size)
                x, items = inputs[batch_size], batch_size
                # First time at this size: at least one call (it builds kernels and caches) and
                # warmup_s; the last call's time estimates the per-call cost.
                calls, t0 = 0, time.perf_counter()
                with torch.inference_mode():
                    while not warm and (calls < 1 or time.perf_counter() - t0 < warmup_s):
                        t1 = time.perf_counter()
                        runner(x)
                        call_s[batch_size] = time.perf_counter() - t1
                        calls += 1
                conn.send(("prepared", calls, call_s.get(batch_size, 0.0)))
            elif msg[0] == "run":
                _, start_at, duration_s = msg
                latencies = []
                with torch.inference_mode():
                    # Untimed calls while one still fits before the start: OpenMP threads that
                    # slept while other configurations were measured are awake when timing starts.
                    while time.monotonic() + call_s.get(items, 0.0) < start_at:
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
            else:
                conn.send(("error", f"unknown command {msg[0]!r}"))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
