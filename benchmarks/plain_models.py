"""Models written as a new user would, without ``static_block``: does ``autobatch`` still pay? (issue 14)

Two dynamic models, hidden 128, over UD EWT sentences, in the plain style of a first attempt (no
batchcraft annotations, ``nn.GRUCell`` / ``nn.LSTMCell`` called per step or per node):

* ``gru-early-stop``: a GRUCell over a sentence's word embeddings that stops as soon as a
  sigmoid "confidence" of the state passes a threshold (a tensor-dependent ``break``: each instance
  waits on a value every step);
* ``dict-tree-lstm``: a recursive encoder over the sentence's dependency tree as nested dicts
  (``{"word": id, "children": [...]}``): children summed, then one LSTMCell step per node.

Each runs over batches of ``--batch-size`` instances one instance at a time (the plain loop) and
through ``batchcraft.autobatch`` (defaults), in inference (``no_grad``) and as forward+backward
(the summed outputs' gradient into the parameters), timed in an interleaved race (rotating start,
``--rounds`` rounds, each one pass over the batches); results and gradients are checked against the
plain loop first.

Usage:
    python benchmarks/plain_models.py [--sentences 256] [--batch-size 64] [--hidden 128]
                                      [--rounds 5] [--threads 2] [--write-docs]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _report import save_json, write_section  # noqa: E402
from batchcraft import autobatch  # noqa: E402
from batchcraft.data import Vocab, encode, load_sentences  # noqa: E402
from batchcraft.measure import format_table, machine_info  # noqa: E402
from batchcraft.measure.compare import batches  # noqa: E402
from batchcraft.measure.race import race  # noqa: E402


class GRUEarlyStop(nn.Module):
    """GRUCell over the words; stop once sigmoid(score(h)) > threshold (at least 2 steps)."""

    def __init__(self, vocab: int, hidden: int, threshold: float = 0.8):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.score = nn.Linear(hidden, 1)
        self.threshold = threshold

    def forward(self, ids: list[int]) -> torch.Tensor:
        h = torch.zeros(self.cell.hidden_size)
        for t, w in enumerate(ids):
            h = self.cell(self.emb(torch.tensor(w)), h)
            if t >= 1 and torch.sigmoid(self.score(h)).item() > self.threshold:
                break
        return h


class DictTreeLSTM(nn.Module):
    """Recursive LSTMCell encoder over a dict tree: children's (h, c) summed, one cell step per node."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.cell = nn.LSTMCell(hidden, hidden)

    def forward(self, node: dict) -> torch.Tensor:
        return self.encode(node)[0]

    def encode(self, node: dict):
        hs = [self.encode(c) for c in node["children"]]
        if hs:
            h = torch.stack([x[0] for x in hs]).sum(0)
            c = torch.stack([x[1] for x in hs]).sum(0)
        else:
            h = c = torch.zeros(self.cell.hidden_size)
        x = self.emb(torch.tensor(node["word"]))
        h1, c1 = self.cell(x.unsqueeze(0), (h.unsqueeze(0), c.unsqueeze(0)))
        return h1[0], c1[0]


def as_dict_tree(s) -> dict:
    def node(i):
        return {"word": s.word_ids[i], "children": [node(c) for c in s.children[i]]}

    return node(s.root)


def _check(fn, f, b, grad, params):
    with torch.set_grad_enabled(grad):
        out = f(b)
        ref = [fn(x) for x in b]
        diff = max((o - r).abs().max().item() for o, r in zip(out, ref))
        gdiff = 0.0
        if grad:
            gb = torch.autograd.grad(sum(o.sum() for o in out), params, allow_unused=True)
            ge = torch.autograd.grad(sum(r.sum() for r in ref), params, allow_unused=True)
            gdiff = max(((a - e).abs().max().item() for a, e in zip(gb, ge) if a is not None), default=0.0)
    return diff, gdiff


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sents = load_sentences(limit=args.sentences)
    vocab = Vocab.from_sentences(sents)
    encode(sents, vocab)
    torch.manual_seed(0)
    models = {
        "gru-early-stop": (GRUEarlyStop(len(vocab), args.hidden), [s.word_ids for s in sents]),
        "dict-tree-lstm": (DictTreeLSTM(len(vocab), args.hidden), [as_dict_tree(s) for s in sents]),
    }
    rows, payload = [], []
    for name, (model, instances) in models.items():
        bs = batches(instances, args.batch_size)
        f = autobatch(model)
        params = list(model.parameters())
        for mode in ("inference", "forward+backward"):
            grad = mode != "inference"
            for b in bs:  # warm-up and check: signatures, traces, kernel choices
                diff, gdiff = _check(model, f, b, grad, params)
                assert diff <= 1e-4 and gdiff <= 1e-3, (name, mode, diff, gdiff)

            def one_pass(batched):
                def run():
                    t0 = time.perf_counter()
                    with torch.set_grad_enabled(grad):
                        for b in bs:
                            outs = f(b) if batched else [model(x) for x in b]
                            if grad:
                                torch.autograd.grad(sum(o.sum() for o in outs), params, allow_unused=True)
                    return (time.perf_counter() - t0) / len(bs)
                return run

            r = race([one_pass(False), one_pass(True)], rounds=args.rounds, labels=["plain loop", "autobatch"],
                     higher_is_better=False)
            st = f.stats
            plain_ms, bc_ms = r.summary(0).median * 1e3, r.summary(1).median * 1e3
            ratio = r.ratio(1, 0)
            rows.append([name, mode, plain_ms, bc_ms, ratio.text(), st.fallbacks, st.syncs])
            payload.append({"model": name, "mode": mode, "plain_ms": plain_ms, "autobatch_ms": bc_ms,
                            "speedup": ratio.to_dict(), "fallbacks": st.fallbacks, "syncs": st.syncs,
                            "fallback_reasons": dict(st.fallback_reasons), "max_abs_diff": diff})
            print(f"{name} {mode}: {st.summary()}", flush=True)
    headers = ["model", "mode", "plain loop ms/batch", "autobatch ms/batch", "speed-up [interval] coverage",
               "fallbacks (last batch)", "syncs (last batch)"]
    table = format_table(headers, rows)
    print(table)
    m = machine_info()
    save_json("plain_models", {"machine": m, "args": vars(args), "rows": payload})
    if args.write_docs:
        cmd = " ".join(["python benchmarks/plain_models.py"] + (argv if argv is not None else sys.argv[1:]))
        write_section("plain-models", f"Command: `{cmd}`\n\nMachine: {m['cpu']}, torch {m['torch']}, "
                      f"{args.threads} threads; hidden {args.hidden}, batches of {args.batch_size} of "
                      f"{args.sentences} UD EWT sentences; {args.rounds} interleaved rounds, medians; the "
                      f"speed-up is the median paired ratio with its order-statistics interval.\n\n"
                      + format_table(headers, rows, markdown=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
