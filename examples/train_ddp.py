"""Data-parallel training of an auto-batched model: DDP over ranks, autobatch within each rank.

Each rank trains on its shard of every step's instances (sharded by work: words of the trees),
through one DistributedDataParallel forward that runs one ``autobatch`` call; DDP all-reduces the
gradient buckets during backward. Ranks with fewer batches finish through Join.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py [--steps 20] [--model treelstm]
    python examples/train_ddp.py                        # one process, same code
    # across machines: on each of N nodes
    torchrun --nnodes N --node-rank K --nproc-per-node P --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 examples/train_ddp.py

Task (treelstm): predict each word's dependency relation from the TreeLSTM state of its subtree
(as examples/train_treelstm.py). ``--model berxit``: an early-exit encoder classifying sentence
length mod 3; its later layers and the exit heads no instance left by get no gradient on a step
(``find_unused_parameters=True``, or ``--zero-term``). Prints one JSON line from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms import Join

from batchcraft import distributed
from batchcraft.data import Vocab, encode, load_sentences
from batchcraft.models.berxit import Berxit, calibrate_threshold
from batchcraft.models.treelstm import TreeLSTM


class DeprelTagger(nn.Module):
    """TreeLSTM encoder + DEPREL classifier of each word (per instance): summed cross-entropy."""

    def __init__(self, vocab_size: int, n_labels: int, hidden: int):
        super().__init__()
        self.encoder = TreeLSTM(vocab_size, hidden=hidden)
        self.out = nn.Linear(hidden, n_labels)

    def forward(self, s):
        states = {}

        def visit(i):
            kids = [visit(c) for c in s.children[i]]
            iou_x, f_x = self.encoder.inputs(torch.tensor(s.word_ids[i]), torch.tensor(s.upos_ids[i]))
            h, c = self.encoder.cell(iou_x, f_x, [k[0] for k in kids], [k[1] for k in kids])
            states[i] = h
            return h, c

        visit(s.root)
        logits = self.out(torch.stack([states[i] for i in range(len(s))]))
        return F.cross_entropy(logits, torch.tensor(s.deprel_ids), reduction="sum")


class LengthClassifier(nn.Module):
    """Berxit early-exit encoder; loss: cross-entropy of (words mod 3) at the exit layer."""

    def __init__(self, vocab_size: int, hidden: int, sents):
        super().__init__()
        self.model = Berxit(vocab_size, d_model=hidden, n_layers=6)
        self.model.threshold = calibrate_threshold(self.model, sents[:64])

    def forward(self, s):
        logits, _ = self.model(s)
        return F.cross_entropy(logits, torch.tensor(len(s) % 3), reduction="sum") * len(s)


def init_ranks() -> distributed.Rank:
    if "RANK" in os.environ:  # under torchrun
        return distributed.init("cpu")
    store = os.path.join(tempfile.mkdtemp(), "store")
    return distributed.init("cpu", init_method=f"file://{store}", rank=0, world_size=1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["treelstm", "berxit"], default="treelstm")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after a warm-up pass)")
    ap.add_argument("--step-work", type=float, default=800, help="words per step, over all ranks")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--find-unused", action="store_true", help="find_unused_parameters=True")
    ap.add_argument("--zero-term", action="store_true", help="0 * sum(params) instead of find_unused")
    args = ap.parse_args(argv)
    rank = init_ranks()
    sents = load_sentences(limit=args.sentences)
    vocab = Vocab.from_sentences(sents, min_count=2)
    encode(sents, vocab)
    torch.manual_seed(0)  # the same initial parameters on every rank (DDP also broadcasts them)
    if args.model == "treelstm":
        labels = Vocab(sorted({d.split(":")[0] for s in sents for d in s.deprels}))
        for s in sents:
            s.deprel_ids = [labels[d.split(":")[0]] for d in s.deprels]
        model = DeprelTagger(len(vocab), len(labels), args.hidden)
    else:
        model = LengthClassifier(len(vocab), args.hidden, sents)
    # every rank computes the same plan: a step's work is split evenly over the ranks
    plan = distributed.plan_epoch(sents, rank.world_size, max_batch_work=args.step_work / rank.world_size)
    loss_module = distributed.AutobatchLoss(model, zero_term=args.zero_term)
    ddp = distributed.wrap(loss_module, find_unused_parameters=args.find_unused)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    batches = plan.rank_batches(rank.rank)
    with torch.no_grad():  # warm-up: autobatch traces each signature once per process
        for b in batches:
            loss_module.loss_fn([sents[i] for i in b])
    dist.barrier()
    steps = min(args.steps, plan.steps)
    t0, losses = time.perf_counter(), []
    with Join([ddp]):
        for step, batch in enumerate(batches[:steps]):
            loss = ddp([sents[i] for i in batch]) / plan.global_work(step)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    dist.barrier()
    elapsed = time.perf_counter() - t0
    words = sum(plan.global_work(k) for k in range(steps))
    out = {"model": args.model, "world_size": rank.world_size, "threads": torch.get_num_threads(),
           "steps": steps, "seconds": elapsed, "words_per_s": words / elapsed,
           "sentences_per_s": sum(len(plan.union(k)) for k in range(steps)) / elapsed,
           "rank_work": [plan.rank_work(r) for r in range(rank.world_size)],
           "rank0_loss_first": losses[0] if losses else None, "rank0_loss_last": losses[-1] if losses else None,
           "find_unused": args.find_unused, "zero_term": args.zero_term}
    if rank.rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
