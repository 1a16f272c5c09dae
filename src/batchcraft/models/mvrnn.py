"""Matrix-Vector RNN (MV-RNN) over dependency trees, written for one instance.

Socher, Huval, Manning and Ng, "Semantic Compositionality through Recursive
Matrix-Vector Spaces", EMNLP 2012, §2 (eqs. 2-3). Every word carries a vector
``a`` (hidden,) and a matrix ``A`` (hidden, hidden); two constituents combine as

    p = tanh(W [B a; A b] + b_W)        P = W_M [A; B]

Socher et al. compose along binary constituency trees; here a dependency head
absorbs its dependents one at a time, in word order (a dependent left of its
head is the left operand, one to its right the right operand), so the model
runs on the UD trees as they are. Word matrices start at the identity plus
small noise (§2.1) and ``W_M`` at ``[I I] / 2``, so a composed matrix stays near
the identity however deep the tree.

``model(sentence)`` recurses over one tree; the leaf lookup and the composition
are :func:`batchcraft.static_block` cells, so inside :func:`batchcraft.autobatch`
all compositions at the same depth, across all sentences, run as one batched call.
ACRoBat §7 sizes: hidden 64 (small) and 128 (large).
"""

from __future__ import annotations

import torch
from torch import nn

from batchcraft.autobatching import static_block


@static_block
class WordLeaf(nn.Module):
    """Per instance: ``word_id`` () int64 -> ``(a, A^T)``, shapes (hidden,) and (hidden, hidden)."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.vector = nn.Embedding(vocab_size, hidden)
        self.matrix = nn.Embedding(vocab_size, hidden * hidden)
        with torch.no_grad():  # identity plus N(0, 0.01) noise (Socher et al. §2.1)
            eye = torch.eye(hidden).reshape(-1)
            self.matrix.weight.copy_(eye + 0.01 * torch.randn(vocab_size, hidden * hidden))

    def forward(self, word_id):
        return self.vector(word_id), self.matrix(word_id).view(self.hidden, self.hidden)


@static_block
class MVCompose(nn.Module):
    """Compose (a, A) on the left with (b, B) on the right (Socher et al. eqs. 2-3).

    Matrices travel transposed: per instance ``a``, ``b`` (hidden,), ``At`` = A^T, ``Bt`` = B^T
    (hidden, hidden) -> ``(p, P^T)`` of the same shapes. With W_M = [W_1 W_2],
    ``P^T = A^T W_1^T + B^T W_2^T`` and ``(B a)^T = a^T B^T``: every product has the per-instance
    operand on the left, so a batch of compositions folds into plain matrix multiplies with no
    transposed copies, and the same code reads right for one composition and for a batch.
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.W = nn.Linear(2 * hidden, hidden)
        self.W_M = nn.Parameter(torch.cat([torch.eye(hidden), torch.eye(hidden)], 1) / 2
                                + 0.01 * torch.randn(hidden, 2 * hidden))

    def forward(self, a, At, b, Bt):
        h = self.W_M.shape[0]
        Ba = (a.unsqueeze(-2) @ Bt).squeeze(-2)  # (1, hidden) @ (hidden, hidden)
        Ab = (b.unsqueeze(-2) @ At).squeeze(-2)
        p = torch.tanh(self.W(torch.cat([Ba, Ab], -1)))
        Pt = At @ self.W_M[:, :h].t() + Bt @ self.W_M[:, h:].t()
        return p, Pt


class MVRNN(nn.Module):
    """MV-RNN encoder of one dependency tree.

    Args:
        vocab_size (int): word vocabulary size (id 0 = unknown).
        hidden (int): size of word vectors; word matrices are (hidden, hidden). Default: 64.
    Call:
        ``model(sentence)`` with a :class:`batchcraft.data.Sentence` whose ``word_ids`` are
        filled -> the root's composed vector, shape (hidden,), float32.
    """

    def __init__(self, vocab_size: int, hidden: int = 64):
        super().__init__()
        self.hidden = hidden
        self.leaf = WordLeaf(vocab_size, hidden)
        self.compose = MVCompose(hidden)

    def node(self, sentence, i: int):
        """(p, P^T) of word ``i``'s subtree: the head absorbs its dependents in word order."""
        v, M = self.leaf(torch.tensor(sentence.word_ids[i]))
        for c in sentence.children[i]:
            cv, cM = self.node(sentence, c)
            if c < i:
                v, M = self.compose(cv, cM, v, M)
            else:
                v, M = self.compose(v, M, cv, cM)
        return v, M

    def forward(self, sentence):
        return self.node(sentence, sentence.root)[0]


def build_task(sentences, hidden: int, seed: int = 0):
    """Suite entry: an MV-RNN of size ``hidden`` over ``sentences`` (encoded in place)."""
    from batchcraft.data import Vocab, encode
    from batchcraft.models.suite import Task

    vocab = Vocab.from_sentences(sentences)
    encode(sentences, vocab)
    torch.manual_seed(seed)
    model = MVRNN(len(vocab), hidden=hidden)
    return Task("mvrnn", model, model, list(sentences), hidden,
                f"MV-RNN, hidden {hidden} (word matrices {hidden}x{hidden}), over UD dependency trees")
