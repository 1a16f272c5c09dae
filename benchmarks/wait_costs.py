"""What a value wait costs in auto-batched code written without ``static_block`` (issue 14).

Each of 64 instances runs K steps; a step is one elementwise op (``mul``), an embedding + Linear +
tanh (``lin``) or an embedding + ``nn.GRUCell`` (``cell``), optionally followed by a value wait
(``if h.sum().item() > 1e9: break``: every instance waits once per step, as the GRU early-stop
model of ``plain_models.py`` does). Printed: µs of recording per instance and step (the host time
outside batched execution), and of the whole call, with and without the wait: their difference is
the wait's cost. Best of 7 calls after 3 warm-ups; 1 intra-op thread.

Usage:
    python benchmarks/wait_costs.py [--steps 20] [--instances 64] [--hidden 128]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from batchcraft import autobatch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    K, H = args.steps, args.hidden
    cell, emb, lin = nn.GRUCell(H, H), nn.Embedding(100, H), nn.Linear(H, H)

    def make(kind, wait):
        def body(x):
            h = torch.zeros(H)
            for i in range(K):
                if kind == "cell":
                    h = cell(emb(torch.tensor(i)), h)
                elif kind == "lin":
                    h = torch.tanh(lin(h + emb(torch.tensor(i))))
                else:
                    h = h * 1.01
                if wait and h.sum().item() > 1e9:
                    break
            return h
        return body

    xs = [torch.randn(16) for _ in range(args.instances)]
    print(f"{'step':6s} {'wait':5s} {'record us/inst-step':>20s} {'total us/inst-step':>19s} {'syncs':>6s}")
    for kind in ("mul", "lin", "cell"):
        for wait in (False, True):
            f = autobatch(make(kind, wait))
            with torch.no_grad():
                for _ in range(3):
                    f(xs)
                rec = tot = float("inf")
                for _ in range(7):
                    t0 = time.perf_counter()
                    f(xs)
                    tot = min(tot, time.perf_counter() - t0)
                    rec = min(rec, f.stats.record_s)
            per = args.instances * K
            print(f"{kind:6s} {str(wait):5s} {rec / per * 1e6:20.1f} {tot / per * 1e6:19.1f} {f.stats.syncs:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
