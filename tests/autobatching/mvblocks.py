"""MV-RNN-style static blocks shared by the row-product tests (test_rowmm.py, test_deadrows.py).

A word's leaf is a vector and an ``(h, h)`` matrix looked up in an embedding table; a
composition reads both children's vectors and matrices: ``a^T B^T`` and ``b^T A^T`` (vector
times each node's matrix), and ``A^T W_1^T + B^T W_2^T`` (each node's matrix times a shared
weight), as ``batchcraft.models.mvrnn.MVCompose`` does.
"""

from __future__ import annotations

import torch
from torch import nn

from batchcraft import static_block


def mv_blocks(h: int):
    """``(leaf, compose, params)`` with seeded parameters; ``leaf(word_id) -> (v, M)``,
    ``compose(a, A, b, B) -> (p, P)``."""
    torch.manual_seed(0)
    table = nn.Embedding(30, h * h)

    @static_block
    class Leaf(nn.Module):
        def __init__(self):
            super().__init__()
            self.vec = nn.Embedding(30, h)

        def forward(self, w):
            return self.vec(w), table(w).view(h, h)

    @static_block
    class Compose(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Linear(2 * h, h)
            self.W_M = nn.Parameter(torch.randn(h, 2 * h) / h)

        def forward(self, a, At, b, Bt):
            Ba = (a.unsqueeze(-2) @ Bt).squeeze(-2)
            Ab = (b.unsqueeze(-2) @ At).squeeze(-2)
            p = torch.tanh(self.W(torch.cat([Ba, Ab], -1)))
            return p, At @ self.W_M[:, :h].t() + Bt @ self.W_M[:, h:].t()

    leaf, compose = Leaf(), Compose()
    return leaf, compose, [table.weight, *leaf.parameters(), *compose.parameters()]


def compose_words(leaf, compose, words, after_each=None):
    """``(v, M)`` of ``words`` composed left to right (odd ids as the right child); ``after_each``
    (optional) maps ``v`` after each composition."""
    v, M = leaf(torch.tensor(words[0]))
    for w in words[1:]:
        cv, cM = leaf(torch.tensor(w))
        v, M = compose(v, M, cv, cM) if w % 2 else compose(cv, cM, v, M)
        if after_each is not None:
            v = after_each(v)
    return v, M
