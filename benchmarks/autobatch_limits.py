"""Where the time of auto-batched TreeLSTM goes, and what bounds the speed-up (issues 2 and 7).

Usage:
    python benchmarks/autobatch_limits.py [--sentences 512] [--hidden 256] [--batch-size 64]
                                          [--threads 2] [--repeats 3] [--write-docs]

One process, the same batches of UD EWT trees, inference. Measured side by side:

* eager: the per-instance model, one sentence at a time;
* batchcraft: ``autobatch(model)``, with its own split (recording, gathers, batched calls);
* hand-batched: ``batchcraft.models.handbatched.treelstm_levels`` (no recording at all: what
  PyTorch's kernels allow for this model and these trees);
* the per-instance Python floor: the model's own ``node`` recursion with its two blocks replaced
  by stubs, (a) with ``torch.tensor`` running for real, (b) under a minimal
  ``TorchFunctionMode`` that returns at once: (b) is what *any* recorder built on Python-level
  interception pays per node before it records anything; (c) with ``torch.tensor`` a stub too:
  the model's own Python alone, which no recorder that runs the user's code can go below;
* overlap: two ``autobatch`` calls on different batches in two threads (one intra-op thread
  each) against one after the other, to see whether recording one batch can hide behind the
  batched kernels of another (the GIL decides).

From these it prints the speed-up bounds: eager / (batchcraft recording alone), and eager /
(batchcraft recording + hand-batched execution), and the recording cost per node that a 5x
speed-up would need if execution were as fast as the hand-batched code.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from _report import save_json, write_section  # noqa: E402
from batchcraft.autobatching import autobatch  # noqa: E402
from batchcraft.data import load_sentences  # noqa: E402
from batchcraft.measure import format_table, machine_info  # noqa: E402
from batchcraft.models import suite  # noqa: E402
from batchcraft.models.handbatched import treelstm_levels  # noqa: E402
from batchcraft.models.treelstm import TreeLSTM  # noqa: E402


class _Stub(TorchFunctionMode):
    """The cheapest possible interception: every torch call returns None at once."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        return None


def _stub_model():
    """An object whose ``node`` is TreeLSTM.node, with the two blocks replaced by stubs."""
    m = types.SimpleNamespace()
    m.inputs = lambda w, u: (None, None)
    m.cell = lambda a, b, hs, cs: (None, None)
    m.node = functools.partial(TreeLSTM.node, m)
    return m


def _median_ms(fn, batches, repeats):
    ts = []
    for _ in range(repeats):
        for b in batches:
            t0 = time.perf_counter()
            fn(b)
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sents = load_sentences(limit=args.sentences)
    task = suite.build("treelstm", sents, hidden=args.hidden)
    bs = [task.instances[i:i + args.batch_size] for i in range(0, len(task.instances), args.batch_size)]
    nodes = statistics.median(sum(len(s) for s in b) for b in bs)
    f = autobatch(task.fn)
    stub = _stub_model()
    r = {}
    with torch.no_grad():
        f(bs[0]), treelstm_levels(task.model, bs[0])  # warm-up: inference of signatures, tracing
        split = {k: [] for k in ("record_s", "gather_s", "kernel_s")}
        eager, bc, hand = [], [], []
        for _ in range(args.repeats):  # interleaved per batch: the same conditions for all three
            for b in bs:
                t0 = time.perf_counter()
                [task.fn(x) for x in b]
                t1 = time.perf_counter()
                f(b)
                t2 = time.perf_counter()
                treelstm_levels(task.model, b)
                t3 = time.perf_counter()
                eager.append(t1 - t0), bc.append(t2 - t1), hand.append(t3 - t2)
                for k in split:
                    split[k].append(getattr(f.stats, k))
        med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        r.update(eager_ms=med(eager), batchcraft_ms=med(bc), hand_ms=med(hand),
                 record_ms=med(split["record_s"]), gather_ms=med(split["gather_s"]),
                 kernel_ms=med(split["kernel_s"]))
        r["python_floor_ms"] = _median_ms(lambda b: [stub.node(s, s.root) for s in b], bs, args.repeats)
        real_tensor = torch.tensor
        torch.tensor = lambda *a, **k: None  # (restored below: the model's Python alone)
        try:
            r["python_only_ms"] = _median_ms(lambda b: [stub.node(s, s.root) for s in b], bs, args.repeats)
        finally:
            torch.tensor = real_tensor
        with _Stub():
            r["interception_floor_ms"] = _median_ms(lambda b: [stub.node(s, s.root) for s in b], bs, args.repeats)
        # overlap: two autobatch objects, one intra-op thread each, two threads
        torch.set_num_threads(1)
        fs = [autobatch(task.fn), autobatch(task.fn)]
        run = lambda i: fs[i % 2](bs[i])  # noqa: E731
        for g in fs:
            g(bs[0])
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(run, range(len(bs))))
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                list(ex.map(run, range(len(bs))))
            r["overlap_ms"] = (time.perf_counter() - t0) / (args.repeats * len(bs)) * 1e3
        torch.set_num_threads(args.threads)
    r["nodes_per_batch"] = nodes
    per_node = lambda ms: ms * 1e3 / nodes  # noqa: E731
    rows = [
        ["eager, one instance at a time", r["eager_ms"], per_node(r["eager_ms"]), 1.0],
        ["batchcraft autobatch", r["batchcraft_ms"], per_node(r["batchcraft_ms"]), r["eager_ms"] / r["batchcraft_ms"]],
        ["  of which recording", r["record_ms"], per_node(r["record_ms"]), "-"],
        ["  of which gathers", r["gather_ms"], per_node(r["gather_ms"]), "-"],
        ["  of which batched calls", r["kernel_ms"], per_node(r["kernel_ms"]), "-"],
        ["hand-batched (no recording)", r["hand_ms"], per_node(r["hand_ms"]), r["eager_ms"] / r["hand_ms"]],
        ["model's own Python (blocks stubbed)", r["python_floor_ms"], per_node(r["python_floor_ms"]), "-"],
        ["same + cheapest torch-call interception", r["interception_floor_ms"],
         per_node(r["interception_floor_ms"]), "-"],
        ["model's own Python alone (blocks and torch.tensor stubbed)", r["python_only_ms"],
         per_node(r["python_only_ms"]), "-"],
        ["2 autobatch calls in 2 threads (1 intra-op thread each), per batch", r["overlap_ms"],
         per_node(r["overlap_ms"]), r["eager_ms"] / r["overlap_ms"]],
    ]
    bound_rec = r["eager_ms"] / r["record_ms"]
    bound_hand = r["eager_ms"] / (r["record_ms"] + r["hand_ms"])
    need_us = (r["eager_ms"] / 5 - r["hand_ms"]) * 1e3 / nodes
    table = format_table(["what", "ms per batch", "us per node", "speed-up over eager"], rows, markdown=True)
    bounds = (f"Bounds at this size: with batchcraft's recording as measured, the speed-up cannot pass "
              f"{bound_rec:.1f}x even if execution were free, and {bound_hand:.1f}x if execution were as "
              f"fast as the hand-batched code. A 5x speed-up with hand-batched execution needs recording "
              f"of at most {need_us:.1f} us per node; the model's own Python plus the cheapest "
              f"interception of its torch calls already costs "
              f"{per_node(r['interception_floor_ms']):.1f} us per node.")
    print(format_table(["what", "ms per batch", "us per node", "speed-up over eager"], rows))
    print(bounds)
    m = machine_info()
    save_json("autobatch_limits", {"machine": m, "args": vars(args), "results": r})
    if args.write_docs:
        text = (f"### What bounds the auto-batched TreeLSTM's speed-up (issues 2 and 7)\n\n"
                f"Command: `python benchmarks/autobatch_limits.py --sentences {args.sentences} --hidden "
                f"{args.hidden} --batch-size {args.batch_size} --threads {args.threads} --repeats "
                f"{args.repeats} --write-docs`\n\nMachine: {m['cpu']}, {m['usable_cpus']} usable CPUs, "
                f"torch {m['torch']}, {args.threads} intra-op threads (1 per thread in the overlap row). "
                f"TreeLSTM hidden {args.hidden}, UD EWT dev first {args.sentences} sentences, batches of "
                f"{args.batch_size} ({nodes:.0f} nodes per batch, median); medians over "
                f"{args.repeats} passes of all batches, eager / batchcraft / hand-batched interleaved "
                f"per batch.\n\n{table}\n\n{bounds}\n")
        write_section("autobatch_limits", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
