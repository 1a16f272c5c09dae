"""Worker side of :class:`batchcraft.parallel.launcher.WorkerGroup` (runs inside an instance).

Protocol over a ``multiprocessing`` connection (pickled tuples), parent -> worker:
``("prepare", batch_size, warmup_s)`` -> ``("prepared", calls)``;
``("run", start_at_monotonic_s, duration_s)`` -> ``("result", latencies_s, items)``;
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
    x, items, inputs = None, 0, {}
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
                warm = batch_size in inputs  # already warmed up at this size: one call suffices
                if not warm:
                    inputs[batch_size] = work.make_batch(batch_size)
                x, items = inputs[batch_size], batch_size
                # First time at this size: at least one call and warmup_s; afterwards no warm-up,
                # so a configuration with second-long calls costs one call per trial.
                calls, t0 = 0, time.perf_counter()
                with torch.inference_mode():
                    while not warm and (calls < 1 or time.perf_counter() - t0 < warmup_s):
                        runner(x)
                        calls += 1
                conn.send(("prepared", calls))
            elif msg[0] == "run":
                _, start_at, duration_s = msg
                latencies = []
                while time.monotonic() < start_at:
                    time.sleep(max(0.0, min(0.01, start_at - time.monotonic())))
                end = start_at + duration_s
                with torch.inference_mode():
                    while True:
                        t0 = time.monotonic()
                        if t0 >= end and latencies:
                            break
                        runner(x)
                        latencies.append(time.monotonic() - t0)
                conn.send(("result", latencies, len(latencies) * items, time.monotonic() - start_at))
            else:
                conn.send(("error", f"unknown command {msg[0]!r}"))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
