"""A long auto-batched run: 100,000 instances in batches; is memory flat between batches? (issue 6)

Usage:
    python benchmarks/memory_long_run.py [--instances 100000] [--batch-size 500] [--write-docs]

Each instance is a short RNN over a random-length sequence with a branch on a tensor value
(so fibers, syncs and static blocks all take part). After every batch the resident set size
(/proc/self/statm) and Python's traced allocations are sampled; the report gives their growth
from the end of the warm-up (batch 10) to the last batch.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _report import write_section  # noqa: E402
from batchcraft import autobatch, static_block  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=100_000)
    ap.add_argument("--batch-size", type=int, default=500)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cell = static_block(nn.GRUCell(8, 16))
    head = nn.Linear(16, 1)

    def fn(seq):
        h = torch.zeros(16)
        for t in range(seq.shape[0]):
            h = cell(seq[t], h)
        return h * 2 if head(h) > 0 else h

    rng = random.Random(0)
    f = autobatch(fn)
    n_batches = args.instances // args.batch_size
    samples = []
    tracemalloc.start()
    t0 = time.perf_counter()
    with torch.no_grad():
        for b in range(n_batches):
            batch = [torch.randn(rng.randint(1, 4), 8) for _ in range(args.batch_size)]
            out = f(batch)
            del out, batch
            gc.collect()
            samples.append((rss_bytes(), tracemalloc.get_traced_memory()[0]))
    secs = time.perf_counter() - t0
    tracemalloc.stop()
    w = min(10, len(samples) - 1)
    rss_growth = samples[-1][0] - samples[w][0]
    py_growth = samples[-1][1] - samples[w][1]
    lines = [
        f"Command: `python benchmarks/memory_long_run.py --instances {args.instances} --batch-size "
        f"{args.batch_size}`",
        "",
        f"{n_batches * args.batch_size:,} instances in {n_batches} batches of {args.batch_size} "
        f"({secs:.0f} s; {f.stats.ops_recorded} ops recorded in the last batch).",
        "",
        "| after batch | RSS (MiB) | Python traced (KiB) |",
        "|---|---|---|",
    ]
    for i in sorted({w, len(samples) // 4, len(samples) // 2, 3 * len(samples) // 4, len(samples) - 1}):
        lines.append(f"| {i + 1} | {samples[i][0] / 2**20:.1f} | {samples[i][1] / 1024:.0f} |")
    lines += ["", f"Growth from batch {w + 1} to {len(samples)}: RSS {rss_growth / 2**20:+.2f} MiB, "
              f"Python allocations {py_growth / 1024:+.1f} KiB."]
    text = "\n".join(lines)
    print(text)
    if args.write_docs:
        write_section("long_run", text, Path(__file__).resolve().parent.parent / "docs" / "reliability.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
