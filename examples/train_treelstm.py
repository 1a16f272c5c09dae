"""Train a Child-Sum TreeLSTM on real UD trees through batchcraft.autobatch.

Task: predict each word's dependency relation (DEPREL) from the TreeLSTM state of
its subtree. The per-instance loss is ordinary PyTorch over one tree; autobatch
runs a mini-batch of trees at once; loss.backward() and the optimizer step are
unchanged.

    python examples/train_treelstm.py [--steps 300] [--batch-size 16] [--hidden 64]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from batchcraft import autobatch
from batchcraft.data import Vocab, encode, load_sentences
from batchcraft.models.treelstm import TreeLSTM


class DeprelTagger(nn.Module):
    """TreeLSTM encoder + linear classifier of each word's DEPREL (per instance)."""

    def __init__(self, vocab_size: int, n_labels: int, hidden: int):
        super().__init__()
        self.encoder = TreeLSTM(vocab_size, hidden=hidden)
        self.out = nn.Linear(hidden, n_labels)

    def forward(self, sentence):
        states = {}

        def visit(i):
            kids = [visit(c) for c in sentence.children[i]]
            iou_x, f_x = self.encoder.inputs(torch.tensor(sentence.word_ids[i]),
                                             torch.tensor(sentence.upos_ids[i]))
            h, c = self.encoder.cell(iou_x, f_x, [k[0] for k in kids], [k[1] for k in kids])
            states[i] = h
            return h, c

        visit(sentence.root)
        logits = self.out(torch.stack([states[i] for i in range(len(sentence))]))
        return F.cross_entropy(logits, torch.tensor(sentence.deprel_ids), reduction="sum")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--sentences", type=int, default=1600)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    sents = load_sentences(limit=args.sentences)
    encode(sents, Vocab.from_sentences(sents, min_count=2))
    labels = Vocab(sorted({d.split(":")[0] for s in sents for d in s.deprels}))
    for s in sents:
        s.deprel_ids = [labels[d.split(":")[0]] for d in s.deprels]
    model = DeprelTagger(len(Vocab.from_sentences(sents, min_count=2)), len(labels), args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = autobatch(model)
    t0, first, window = time.perf_counter(), None, []
    for step in range(args.steps):
        i = (step * args.batch_size) % (len(sents) - args.batch_size)
        batch = sents[i:i + args.batch_size]
        losses = loss_fn(batch)
        loss = torch.stack(losses).sum() / sum(len(s) for s in batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        window.append(loss.item())
        if (step + 1) % 50 == 0 or step == 0:
            avg = sum(window) / len(window)
            first = avg if first is None else first
            print(f"step {step + 1:4d}  loss/word {avg:.3f}  ({time.perf_counter() - t0:.1f} s)")
            window = []
    if window:
        avg = sum(window) / len(window)
    print(f"loss per word: first logged {first:.3f}, last {avg:.3f}")
    return first, avg


if __name__ == "__main__":
    main()
