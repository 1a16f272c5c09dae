"""Training cases shared by the DDP worker processes and the one-process references.

Every case builds the same model, data and plan from a seed, so rank processes and the
reference process start from identical parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchcraft.data import Vocab, encode, load_sentences
from batchcraft.distributed import EpochPlan, plan_epoch
from batchcraft.models.berxit import Berxit, calibrate_threshold
from batchcraft.models.treelstm import TreeLSTM

N_SENTENCES = 28


def sentences():
    sents = load_sentences(limit=N_SENTENCES)
    encode(sents, Vocab.from_sentences(sents))
    return sents


class TreeTagger(nn.Module):
    """TreeLSTM over one tree; loss: cross-entropy of the root state's guess of the root's UPOS."""

    def __init__(self, vocab_size: int, hidden: int = 16):
        super().__init__()
        self.encoder = TreeLSTM(vocab_size, hidden=hidden, tag_dim=8)
        self.out = nn.Linear(hidden, 18)

    def forward(self, s):
        logits = self.out(self.encoder(s))
        return F.cross_entropy(logits, torch.tensor(s.upos_ids[s.root]), reduction="sum") * len(s)


class EarlyExitClassifier(nn.Module):
    """Berxit (early exit: later layers and most exit heads get no gradient on a step)."""

    def __init__(self, vocab_size: int, sents):
        super().__init__()
        self.model = Berxit(vocab_size, d_model=32, n_layers=3, n_heads=2, d_ff=32, pad_to=8)
        self.model.threshold = calibrate_threshold(self.model, sents)

    def forward(self, s):
        logits, _ = self.model(s)
        return F.cross_entropy(logits, torch.tensor(len(s) % 3), reduction="sum")


def build(case: str):
    """(loss module, plan, find_unused_parameters, optimizer factory) of ``case``."""
    sents = sentences()
    torch.manual_seed(0)
    vocab_size = max(max(s.word_ids) for s in sents) + 1
    if case in ("treelstm", "treelstm_uneven", "treelstm_local_mean"):
        model, find_unused = TreeTagger(vocab_size), False
    elif case == "berxit":
        model, find_unused = EarlyExitClassifier(vocab_size, sents), True
    else:
        raise KeyError(case)
    if case == "treelstm_uneven":
        # rank 0: three batches, rank 1: one (it joins early; Join shadows its all-reduces)
        plan = EpochPlan([[[0, 1, 2, 3], [4, 5, 6], [7, 8]], [[9, 10, 11, 12]]],
                         [float(len(s)) for s in sents])
    else:
        plan = plan_epoch(sents, 2, max_batch_work=120)

    def optimizer(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)

    return sents, model, plan, find_unused, optimizer


def reference(case: str, steps: int | None = None) -> dict:
    """Parameters after one process trains on the union of the ranks' batches at each step."""
    from batchcraft.distributed import AutobatchLoss

    sents, model, plan, _, optimizer = build(case)
    loss_fn = AutobatchLoss(model, grad_scale=1.0)
    opt = optimizer(model.parameters())
    for step in range(plan.steps if steps is None else steps):
        loss = loss_fn([sents[i] for i in plan.union(step)]) / plan.global_work(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
