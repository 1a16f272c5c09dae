"""Per-instance 0-d integers as an index, a size or a count: the plain loop against ``autobatch``.

Usage:
    python benchmarks/value_arguments.py [--instances 64] [--rounds 5] [--threads 2] [--write-docs]

Each case is a per-instance function over a list of 20 word ids (Python ints) that it turns into
``torch.tensor(w)`` as a model written for one sentence does; inference (``torch.no_grad``):

* ``E[i]`` of a shared table, 20 ids an instance (before stop 49: an eager run per call, as the
  output was inferred on ``meta`` tensors, where torch cannot read the id);
* ``F.embedding(i, E)``, the same lookups through an embedding (batched before too);
* ``torch.zeros(n, 8)`` and ``h.repeat(n, 1)`` with ``n`` per instance: the output's shape depends
  on ``n``, so each call waits for its value and runs on it (correct, not batched).

One process; autobatch and the plain loop interleaved per round; medians; the speed-up is the
plain loop's time over autobatch's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _report import save_json, write_section  # noqa: E402
from batchcraft.autobatching import autobatch  # noqa: E402
from batchcraft.measure import format_table, machine_info  # noqa: E402

E = torch.randn(1000, 64)
H = torch.randn(8)


def rows_by_index(words):
    return sum(E[torch.tensor(w)] for w in words)


def rows_by_embedding(words):
    return sum(F.embedding(torch.tensor(w), E) for w in words)


def zeros_of_count(words):
    n = torch.tensor(words[0]) % 5 + 1  # (computed: its value is a wait)
    return torch.zeros(n, 8).sum(0) + n


def repeat_count(words):
    return H.repeat(torch.tensor(words[0]) % 5 + 1, 1).sum(0)


CASES = {"E[i], 20 ids": rows_by_index, "F.embedding(i, E), 20 ids": rows_by_embedding,
         "torch.zeros(n, 8)": zeros_of_count, "H.repeat(n, 1)": repeat_count}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    insts = [[int(v) for v in torch.randint(0, 1000, (20,), generator=g)] for _ in range(args.instances)]
    rows, payload = [], []
    with torch.no_grad():
        for name, fn in CASES.items():
            f = autobatch(fn)
            out = f(insts)  # warm-up: signatures
            ref = [fn(x) for x in insts]
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, ref)), name
            plain, batched = [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                [fn(x) for x in insts]
                t1 = time.perf_counter()
                f(insts)
                t2 = time.perf_counter()
                plain.append(t1 - t0)
                batched.append(t2 - t1)
            p, b = statistics.median(plain) * 1e3, statistics.median(batched) * 1e3
            rows.append([name, round(p, 2), round(b, 2), round(p / b, 2), f.stats.eager_ops, f.stats.batched_calls])
            payload.append(dict(zip(("case", "plain_ms", "autobatch_ms", "speedup", "eager_ops", "batched_calls"),
                                    rows[-1])))
    headers = ["case", "plain loop ms", "autobatch ms", "speed-up", "eager ops", "batched calls"]
    print(format_table(headers, rows))
    m = machine_info()
    save_json("value_arguments", {"machine": m, "args": vars(args), "results": payload})
    if args.write_docs:
        text = (f"Command: `python benchmarks/value_arguments.py --instances {args.instances} --rounds "
                f"{args.rounds} --threads {args.threads} --write-docs`\n\nMachine: {m['cpu']}, torch "
                f"{m['torch']}, {args.threads} threads; {args.instances} instances, inference; medians of "
                f"{args.rounds} interleaved rounds.\n\n{format_table(headers, rows, markdown=True)}\n")
        write_section("value-arguments", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
