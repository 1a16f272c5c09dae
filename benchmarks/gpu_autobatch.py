"""Auto-batching on a CUDA GPU: the suite, batchcraft vs. eager (vs. hand-batched), checked.

Usage (on a machine with a CUDA GPU; finishes in well under 5 minutes):
    python benchmarks/gpu_autobatch.py [--sentences 128] [--models treelstm,birnn,...] [--out FILE.json]

Without a CUDA device it says so and exits 0 (CI has no GPU). For each suite model and
batch size 8 and 64: ms per batch (median, CUDA-synchronised) for eager one-at-a-time,
batchcraft.autobatch and the hand-batched reference where one exists, and the largest
absolute difference from eager.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch


def _sync():
    torch.cuda.synchronize()


def _time(fn, repeats=3):
    fn()
    _sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _diff(a, b):
    if isinstance(a, torch.Tensor):
        return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        return max((_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        return max((_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=128)
    ap.add_argument("--models", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_autobatch: no CUDA device here; nothing to run (skipped)")
        return 0
    from batchcraft import autobatch
    from batchcraft.data import load_sentences
    from batchcraft.models import suite

    dev = torch.device("cuda")
    names = [m for m in args.models.split(",") if m] or sorted(suite.BUILDERS)
    sents = load_sentences(limit=args.sentences)
    rows = []
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for name in names:
        try:
            task = suite.build(name, sents, size="small")
            task.model.to(dev)
            hand = getattr(task, "hand_batched", None)
            for bs in (8, 64):
                batch = task.instances[:bs]
                f = autobatch(task.fn)
                with torch.no_grad():
                    ref = [task.fn(x) for x in batch]
                    out = f(batch)
                    row = {"model": name, "batch": bs, "max_abs_diff": max(_diff(o, r) for o, r in zip(out, ref)),
                           "eager_ms": _time(lambda: [task.fn(x) for x in batch]),
                           "batchcraft_ms": _time(lambda: f(batch))}
                    if hand is not None:
                        row["hand_batched_ms"] = _time(lambda: hand(batch))
                row["speedup"] = row["eager_ms"] / row["batchcraft_ms"]
                rows.append(row)
                print(json.dumps(row))
        except Exception as exc:  # report and go on with the next model
            rows.append({"model": name, "error": f"{type(exc).__name__}: {exc}"})
            traceback.print_exc()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
