"""Unary maths on a strided CPU view vs. a contiguous copy (why batched chunks are copied first).

Usage:
    python benchmarks/strided_unary.py [--rows 256] [--threads 2]

Per-instance code often chunks a vector (``i, o, u = iou.chunk(3)``): each instance's chunk is
contiguous, but the batched chunk of a (rows, 3 * width) tensor is a row-strided view, and torch
computes several unary functions much more slowly on such views (MKL's vector library only
takes contiguous inputs). For each function: median µs on the view, on a contiguous copy, the
copy plus the call, and whether all three give the same bits. ``autobatching.rules._STRIDED_SLOW``
lists the functions the lowering copies first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchcraft.measure import format_table, machine_info

FUNCS = ("tanh", "exp", "log", "sqrt", "sin", "cos", "erf", "atan", "log2", "log10", "tan", "trunc",
         "sigmoid", "relu", "abs", "rsqrt", "expm1", "log1p")


def _us(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(20):
            fn()
        ts.append((time.perf_counter() - t) / 20 * 1e6)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch = torch.rand(args.rows, 3 * args.width) + 0.5
    view = batch.chunk(3, dim=-1)[2]
    rows = []
    for name in FUNCS:
        f = getattr(torch, name)
        dense = view.contiguous()
        t_view, t_dense = _us(lambda: f(view), args.reps), _us(lambda: f(dense), args.reps)
        t_copy = _us(lambda: f(view.contiguous()), args.reps)
        same = torch.equal(f(view), f(dense))
        rows.append([name, t_view, t_dense, t_copy, t_view / t_copy, "yes" if same else "NO"])
    m = machine_info()
    print(f"{m['cpu']}, {args.threads} threads, torch {m['torch']}; view = chunk 3 of 3 of a "
          f"({args.rows}, {3 * args.width}) float32 tensor")
    print(format_table(["function", "view µs", "contiguous µs", "copy + call µs", "view / (copy + call)",
                        "same bits"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
