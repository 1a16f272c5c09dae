"""Auto-batching on a CUDA GPU: the suite, batchcraft vs. eager vs. hand-batched, checked.

Usage (on a machine with a CUDA GPU; ``benchmarks/gpu_check.sh`` runs it on a lent one):
    python benchmarks/gpu_autobatch.py [--sentences 128] [--models treelstm,birnn,...]
                                       [--sizes small,large] [--out FILE.json] [--time-limit-s 240]
    python benchmarks/gpu_autobatch.py --render FILE.json     # the markdown table of a run

Without a CUDA device it says so and exits 0 (CI has no GPU). Every model runs as its users
would run code written without devices: built and called under ``with torch.device("cuda")``
(``torch.set_default_device``), so ``torch.tensor(word_id)`` inside the model makes a CUDA
tensor in eager and a CUDA leaf under batchcraft. For each model, size and batch size (8, 64),
ms per batch (median of 5, CUDA-synchronised) of:

* eager: the per-instance model, one instance at a time;
* batchcraft: ``autobatch(model)``, synchronised after each call (``batchcraft_ms``), its host
  time alone (``host_ms``: until the call returns, kernels still running), and 5 calls back to
  back with one synchronisation at the end (``pipelined_ms`` per call: recording of the next call
  overlaps the kernels of the previous one, since a steady call never waits for the GPU);
* hand-batched PyTorch (TreeLSTM level by level, BiRNN as one packed ``nn.LSTM``) where it exists;

and the largest absolute difference of batchcraft's outputs from eager's. TF32 is off, so the
values are float32's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch

REPEATS = 5
DEVICE = "cuda"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats=REPEATS, sync=True):
    fn()
    _sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            _sync()
        ts.append(time.perf_counter() - t0)
        if not sync:
            _sync()
    return statistics.median(ts) * 1e3


def _pipelined(fn, calls=REPEATS):
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    return (time.perf_counter() - t0) / calls * 1e3


def _diff(a, b):
    if isinstance(a, torch.Tensor):
        return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        return max((_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        return max((_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0


def render(path) -> str:
    """Markdown table of a results file written with ``--out``."""
    with open(path) as fh:
        res = json.load(fh)
    head = ["model", "size", "hidden", "batch", "eager ms", "batchcraft ms", "host ms", "pipelined ms",
            "hand-batched ms", "vs eager", "vs hand-batched", "batched calls", "syncs", "max abs diff"]
    lines = [f"{res['gpu']}, torch {res['torch']}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['size']} | {r['error']} |")
            continue
        hand = r.get("hand_batched_ms")
        cells = [r["model"], r["size"], r["hidden"], r["batch"], f"{r['eager_ms']:.1f}", f"{r['batchcraft_ms']:.1f}",
                 f"{r['host_ms']:.1f}", f"{r['pipelined_ms']:.1f}", "-" if hand is None else f"{hand:.1f}",
                 f"{r['speedup']:.2f}x", "-" if hand is None else f"{hand / r['batchcraft_ms']:.2f}x",
                 r["batched_calls"], r["syncs"], f"{r['max_abs_diff']:.1e}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--render":
        print(render(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=128)
    ap.add_argument("--models", default="")
    ap.add_argument("--sizes", default="small")
    ap.add_argument("--batch-sizes", default="8,64")
    ap.add_argument("--time-limit-s", type=float, default=240.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script (tests)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_autobatch: no CUDA device here; nothing to run (skipped)")
        return 0
    from batchcraft import autobatch
    from batchcraft.data import load_sentences
    from batchcraft.models import handbatched, suite

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    hand_refs = {"treelstm": handbatched.treelstm_levels, "birnn": handbatched.birnn_padded}
    names = [m for m in args.models.split(",") if m] or sorted(suite.BUILDERS)
    sents = load_sentences(limit=args.sentences)
    rows = []
    t_start = time.perf_counter()
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
    print(f"GPU: {gpu}, torch {torch.__version__}", flush=True)
    for size in args.sizes.split(","):
        for name in names:
            if time.perf_counter() - t_start > args.time_limit_s:
                rows.append({"model": name, "size": size, "error": "time limit"})
                continue
            try:
                with torch.device(DEVICE), torch.no_grad():
                    task = suite.build(name, list(sents), size=size)
                    hand = hand_refs.get(name)
                    for bs in (int(b) for b in args.batch_sizes.split(",")):
                        batch = task.instances[:bs]
                        f = autobatch(task.fn)
                        ref = [task.fn(x) for x in batch]
                        out = f(batch)
                        row = {"model": name, "size": size, "hidden": task.hidden, "batch": bs,
                               "max_abs_diff": max(_diff(o, r) for o, r in zip(out, ref)),
                               "eager_ms": _time(lambda: [task.fn(x) for x in batch]),
                               "batchcraft_ms": _time(lambda: f(batch)),
                               "host_ms": _time(lambda: f(batch), sync=False),
                               "pipelined_ms": _pipelined(lambda: f(batch)),
                               "batched_calls": f.stats.batched_calls, "ops_recorded": f.stats.ops_recorded,
                               "syncs": f.stats.syncs, "fallbacks": f.stats.fallbacks,
                               "record_ms": f.stats.record_s * 1e3}
                        if hand is not None:
                            hout = hand(task.model, batch)
                            row["hand_max_abs_diff"] = max(_diff(o, r) for o, r in zip(hout, ref))
                            row["hand_batched_ms"] = _time(lambda: hand(task.model, batch))
                        row["speedup"] = row["eager_ms"] / row["batchcraft_ms"]
                        row["speedup_pipelined"] = row["eager_ms"] / row["pipelined_ms"]
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            except Exception as exc:  # report and go on with the next model
                rows.append({"model": name, "size": size, "error": f"{type(exc).__name__}: {exc}"})
                traceback.print_exc()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": gpu, "torch": torch.__version__,
                       "elapsed_s": time.perf_counter() - t_start, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
