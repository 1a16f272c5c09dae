"""One system, one model size, all batch sizes, in a fresh process (worker of vs_dynet.py).

Usage (from vs_dynet.py, not by hand):
    python benchmarks/vs_dynet_worker.py SPEC.json OUT.json

SPEC holds: ``system`` (``dynet-<0..3>``, ``eager``, ``handbatched``, ``batchcraft-<scheduler>``),
``model``, ``hidden``, ``batch_sizes``, ``sentences``, ``params_npz``, ``dynet_instances_json``,
``warmup``, ``repeats``, ``modes``, ``threads``, ``dump_dir``, ``grad_param``.

Per batch size (largest first) and mode (inference, then train): one check batch whose outputs
(inference) or one parameter's gradient after one step from zero (train, largest batch size only)
are saved as .npy for the cross-check, ``warmup`` passes, then ``repeats`` timed passes over all
batches; ms per batch = pass time / batches. Peak resident memory is ``VmHWM`` (peak RSS of this process image) read after
set-up, after inference and after training of the largest batch size, before anything else ran;
a fresh process per system keeps the systems' peaks apart. DyNet workers import numpy and
DyNet only (no torch), so their memory is DyNet's own.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def peak_rss_bytes() -> int:
    """Peak resident set size of this process image so far, bytes.

    ``VmHWM`` of /proc/self/status, not ``ru_maxrss``: Linux keeps ``ru_maxrss`` across
    ``execve``, so a worker started from the (torch-importing) parent would inherit the
    parent's resident size at fork time.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: KiB on most Unixes


def batches_of(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def time_passes(run_batch, batches, warmup: int, repeats: int) -> list[float]:
    """ms per batch of each timed pass over ``batches`` (after ``warmup`` untimed passes)."""
    for _ in range(warmup):
        for b in batches:
            run_batch(b)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in batches:
            run_batch(b)
        out.append((time.perf_counter() - t0) / len(batches) * 1e3)
    return out


def _dynet_system(spec):
    import numpy as np

    import dynet_models as dm

    dy = dm.import_dynet(int(spec["system"].split("-", 1)[1]), mem_mb=spec.get("dynet_mem_mb"))
    params = dict(np.load(spec["params_npz"]))
    model = dm.MODELS[spec["model"]](dy, params)
    instances = json.loads(Path(spec["dynet_instances_json"]).read_text())

    def infer(b):
        return dm.run_inference(model, b)

    def train(b):
        dm.run_train_step(model, b)

    def grad_of_one_step(b):
        dm.run_train_step(model, b)  # fresh process: the first backward, so gradients start at zero
        return model.named[spec["grad_param"]].grad_as_array()

    return instances, infer, train, grad_of_one_step, {"dynet_threads": 1, "dynet_mem_mb": spec.get("dynet_mem_mb")}


def _torch_system(spec):
    import numpy as np
    import torch

    from batchcraft.data import load_sentences
    from batchcraft.models import suite

    torch.set_num_threads(spec["threads"])
    task = suite.build(spec["model"], load_sentences(limit=spec["sentences"]), hidden=spec["hidden"])
    state = {k: torch.from_numpy(v) for k, v in np.load(spec["params_npz"]).items()}
    task.model.load_state_dict(state)
    system = spec["system"]
    if system == "eager":
        fn = lambda b: [task.fn(x) for x in b]  # noqa: E731
    elif system == "handbatched":
        import _handbatched

        fn = _handbatched.batched_fn(task)
    elif system.startswith("batchcraft-"):
        import batchcraft

        sched, *flags = system.split("-")[1:]  # batchcraft-depth, batchcraft-depth-nodedup (ablation)
        fn = batchcraft.autobatch(task.fn, scheduler=sched, dedup="nodedup" not in flags)
    else:
        raise SystemExit(f"vs_dynet_worker: unknown system {system!r}")
    model = task.model

    def infer(b):
        with torch.no_grad():
            return fn(b)

    def train(b):
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            outs = fn(b)
            loss = torch.stack([o.sum() for o in outs]).sum()
            loss.backward()

    def grad_of_one_step(b):
        train(b)
        return model.get_parameter(spec["grad_param"]).grad.numpy()

    return task.instances, infer, train, grad_of_one_step, {"torch_threads": torch.get_num_threads()}


def main(spec_path: str, out_path: str) -> int:
    import numpy as np

    spec = json.loads(Path(spec_path).read_text())
    system = spec["system"]
    setup = _dynet_system if system.startswith("dynet-") else _torch_system
    instances, infer, train, grad_of_one_step, extra = setup(spec)
    rss_setup = peak_rss_bytes()
    dump = Path(spec["dump_dir"])
    out = []
    # Largest batch size first: its memory peaks are read before any other work has run.
    for i, size in enumerate(sorted(spec["batch_sizes"], reverse=True)):
        bs = batches_of(list(instances), size)
        res = {"system": system, "model": spec["model"], "hidden": spec["hidden"], "batch_size": size,
               "batches": len(bs), **extra}
        if i == 0:
            res["rss_setup_bytes"] = rss_setup
        tag = f"{system}-{spec['model']}-h{spec['hidden']}-b{size}"
        for mode in spec["modes"]:
            if mode == "inference":
                outs = infer(bs[0])
                np.save(dump / f"{tag}-out.npy",
                        np.concatenate([np.asarray(o, dtype=np.float32).reshape(-1) for o in outs]))
                times = time_passes(infer, bs, spec["warmup"], spec["repeats"])
            elif mode == "train":
                if i == 0:  # gradients of one step from zero: DyNet accumulates until an update
                    np.save(dump / f"{tag}-grad.npy", np.asarray(grad_of_one_step(bs[0]), dtype=np.float32))
                times = time_passes(train, bs, spec["warmup"], spec["repeats"])
            else:
                raise SystemExit(f"vs_dynet_worker: unknown mode {mode!r}")
            res[f"{mode}_ms"] = statistics.median(times)
            res[f"{mode}_ms_all"] = times
            if i == 0:
                res[f"rss_peak_{mode}_bytes"] = peak_rss_bytes()
        out.append(res)
    Path(out_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
