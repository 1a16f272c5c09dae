"""Training through autobatch: a step leaves the same parameters as eager; loss falls."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch

from batchcraft import autobatch
from batchcraft.models.treelstm import TreeLSTM


def _head_loss(model, head):
    def loss(sentence):
        return (head(model(sentence)) ** 2).sum()
    return loss


def test_optimizer_step_matches_eager(ud_sentences):
    torch.manual_seed(0)
    vocab = max(max(s.word_ids) for s in ud_sentences) + 1
    m1 = TreeLSTM(vocab, hidden=16, word_dim=12, tag_dim=4)
    h1 = torch.nn.Linear(16, 3)
    m2, h2 = copy.deepcopy(m1), copy.deepcopy(h1)
    # deepcopy keeps the static-block wrappers bound to the copies
    batch = ud_sentences[:16]
    for model, head, batched in ((m1, h1, True), (m2, h2, False)):
        opt = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=0.1)
        for _ in range(3):
            fn = _head_loss(model, head)
            losses = autobatch(fn)(batch) if batched else [fn(s) for s in batch]
            opt.zero_grad()
            torch.stack(losses).sum().backward()
            opt.step()
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=n)


def test_example_training_loss_falls():
    path = Path(__file__).resolve().parents[2] / "examples" / "train_treelstm.py"
    spec = importlib.util.spec_from_file_location("train_treelstm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    first, last = mod.main(["--steps", "60", "--batch-size", "8", "--hidden", "32", "--sentences", "300"])
    assert last < first * 0.8
