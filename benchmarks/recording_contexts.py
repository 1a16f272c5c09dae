"""Auto-batching under the contexts and factory calls users write (issue 14, stop 48).

Two measurements, one process:

1. **Grad contexts.** Models of the suite over batches of UD EWT sentences, inference under
   ``torch.no_grad()``, ``torch.inference_mode()`` and ``torch.autocast("cpu", bfloat16)`` (with
   ``no_grad``): the plain loop (eager, one instance at a time) against ``autobatch``, interleaved
   rounds, medians, and the recording time of a batch. Until stop 48 the C core took its Python
   path for every call under inference mode or autocast (TreeLSTM 3.2x / 1.9x slower than under
   ``no_grad``).
2. **Factory calls.** What one call costs inside a recording (C core, ``no_grad``, median of
   repeated recordings of 2,000 calls per instance, 2 instances, minus an empty loop) and in eager:
   ``torch.tensor(5)``, ``torch.tensor([5])``, ``torch.as_tensor(5)``, ``torch.zeros(1, 64)``,
   ``torch.zeros((1, 64))``, ``torch.full((3,), 2.0)``, ``torch.arange(5)``.

Usage:
    python benchmarks/recording_contexts.py [--models treelstm,birnn,stackrnn] [--sentences 256]
                                            [--batch-size 64] [--rounds 5] [--threads 2] [--write-docs]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _report import save_json, write_section  # noqa: E402
from batchcraft import autobatch  # noqa: E402
from batchcraft.data import load_sentences  # noqa: E402
from batchcraft.measure import format_table, machine_info  # noqa: E402
from batchcraft.measure.compare import batches  # noqa: E402
from batchcraft.measure.race import race  # noqa: E402
from batchcraft.models import suite  # noqa: E402

CONTEXTS = {
    "no_grad": lambda: [torch.no_grad()],
    "inference_mode": lambda: [torch.inference_mode()],
    "autocast bf16 + no_grad": lambda: [torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16)],
}

FACTORIES = {
    "torch.tensor(5)": lambda: torch.tensor(5),
    "torch.tensor([5])": lambda: torch.tensor([5]),
    "torch.as_tensor(5)": lambda: torch.as_tensor(5),
    "torch.zeros(1, 64)": lambda: torch.zeros(1, 64),
    "torch.zeros((1, 64))": lambda: torch.zeros((1, 64)),
    "torch.full((3,), 2.0)": lambda: torch.full((3,), 2.0),
    "torch.arange(5)": lambda: torch.arange(5),
}


def _tensors(out) -> list:
    """The tensors of an output (tensor, or nested tuple / list / dict), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


@contextlib.contextmanager
def _entered(name):
    with contextlib.ExitStack() as stack:
        for c in CONTEXTS[name]():
            stack.enter_context(c)
        yield


def _contexts(args, rows, payload):
    sents = load_sentences(limit=args.sentences)
    for model in args.models.split(","):
        task = suite.build(model, sents, size="small")
        bs = batches(task.instances, args.batch_size)
        for ctx in CONTEXTS:
            f = autobatch(task.fn)
            with _entered(ctx):
                for b in bs:  # warm-up and check
                    for out, x in zip(f(b), b):
                        for o, r in zip(_tensors(out), _tensors(task.fn(x))):
                            assert o.dtype == r.dtype and o.is_inference() == r.is_inference(), (model, ctx)
                            torch.testing.assert_close(o, r, atol=2e-2 if "autocast" in ctx else 1e-5, rtol=1e-2)

            def one_pass(batched, f=f, bs=bs, ctx=ctx, task=task):
                def run():
                    rec = []
                    with _entered(ctx):
                        t0 = time.perf_counter()
                        for b in bs:
                            if batched:
                                f(b)
                                rec.append(f.stats.record_s)
                            else:
                                [task.fn(x) for x in b]
                        t = (time.perf_counter() - t0) / len(bs)
                    if batched:
                        one_pass.rec.append(statistics.median(rec))
                    return t
                return run
            one_pass.rec = []
            r = race([one_pass(False), one_pass(True)], rounds=args.rounds, labels=["plain loop", "autobatch"],
                     higher_is_better=False)
            eager_ms, bc_ms = r.summary(0).median * 1e3, r.summary(1).median * 1e3
            rec_ms = statistics.median(one_pass.rec) * 1e3
            ratio = r.ratio(1, 0)
            rows.append([model, ctx, eager_ms, bc_ms, ratio.text(), rec_ms])
            payload.append({"model": model, "context": ctx, "eager_ms": eager_ms, "autobatch_ms": bc_ms,
                            "speedup": ratio.to_dict(), "record_ms": rec_ms, "fallbacks": f.stats.fallbacks})
            print(rows[-1], flush=True)


def _recording_ns(make, n=2000, repeats=9):
    """ns a call of ``make()`` costs inside a recording (C core, 2 instances), an empty loop subtracted."""
    def fn(_):
        for _ in range(n):
            make()
        return torch.zeros(1) + 1

    def empty(_):
        for _ in range(n):
            pass
        return torch.zeros(1) + 1

    out = []
    for body in (empty, fn):
        f = autobatch(body, core="c")
        ts = []
        with torch.no_grad():
            for _ in range(repeats):
                f([0, 1])
                ts.append(f.stats.record_s)
        out.append(statistics.median(ts) / (2 * n) * 1e9)
    return out[1] - out[0]


def _eager_ns(make, n=2000, repeats=9):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            make()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / n * 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="treelstm,birnn,stackrnn")
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, payload = [], []
    _contexts(args, rows, payload)
    headers = ["model", "context", "plain loop ms/batch", "autobatch ms/batch", "speed-up [interval] coverage",
               "recording ms/batch"]
    table = format_table(headers, rows)
    print(table)
    frows = []
    for name, make in FACTORIES.items():
        frows.append([name, _recording_ns(make), _eager_ns(make)])
        print(frows[-1], flush=True)
    fheaders = ["call", "ns a call while recording (C core)", "ns a call in eager"]
    ftable = format_table(fheaders, frows)
    print(ftable)
    m = machine_info()
    save_json("recording_contexts", {"machine": m, "args": vars(args), "rows": payload,
                                     "factories": [dict(zip(("call", "recording_ns", "eager_ns"), r)) for r in frows]})
    if args.write_docs:
        cmd = " ".join(["python benchmarks/recording_contexts.py"] + (argv if argv is not None else sys.argv[1:]))
        write_section("recording-contexts",
                      f"Command: `{cmd}`\n\nMachine: {m['cpu']}, torch {m['torch']}, {args.threads} threads; "
                      f"suite models (small), batches of {args.batch_size} of {args.sentences} UD EWT "
                      f"sentences, inference; {args.rounds} interleaved rounds, medians; the speed-up "
                      f"(autobatch against the plain loop) is the median paired ratio with its order-statistics "
                      f"interval.\n\n" + format_table(headers, rows, markdown=True) + "\n\n"
                      + format_table(fheaders, frows, markdown=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
