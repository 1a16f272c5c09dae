"""Child-Sum TreeLSTM over dependency trees, written for one instance.

Tai, Socher and Manning, "Improved Semantic Representations From
Tree-Structured Long Short-Term Memory Networks", ACL 2015, §3.1
(arXiv 1503.00075). Each word is a node; its input is the concatenation of a
word and a UPOS embedding; its children are its dependents.

The model is plain per-instance PyTorch: ``model(sentence)`` recurses over one
tree. The node computation is a :func:`batchcraft.static_block`, so inside
:func:`batchcraft.autobatch` all nodes of the same height and number of
children, across all sentences, run as one batched call.
"""

from __future__ import annotations

import torch
from torch import nn

from batchcraft.autobatching import static_block


@static_block
class NodeInput(nn.Module):
    """Word and UPOS embeddings, concatenated, and their input projections.

    Per instance: ``word_id`` (), ``upos_id`` () int64 -> ``(W_iou x + b_iou, W_f x + b_f)``,
    shapes (3 * hidden,) and (hidden,). The projections do not depend on the children, so
    they run for every node at once (as DGL's TreeLSTM does).
    """

    def __init__(self, vocab_size: int, n_tags: int, word_dim: int, tag_dim: int, hidden: int):
        super().__init__()
        self.word = nn.Embedding(vocab_size, word_dim)
        self.tag = nn.Embedding(n_tags, tag_dim)
        self.W_iou = nn.Linear(word_dim + tag_dim, 3 * hidden)
        self.W_f = nn.Linear(word_dim + tag_dim, hidden)

    def forward(self, word_id, upos_id):
        x = torch.cat([self.word(word_id), self.tag(upos_id)], dim=-1)
        return self.W_iou(x), self.W_f(x)


@static_block
class ChildSumCell(nn.Module):
    """Child-Sum TreeLSTM cell (Tai et al. 2015, eqs. 2-8), input projections precomputed.

    Per instance: ``iou_x`` (3 * hidden,), ``f_x`` (hidden,), ``child_h`` and ``child_c``:
    lists of k tensors (hidden,) (k >= 0) -> ``(h, c)``, each (hidden,).
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.U_iou = nn.Linear(hidden, 3 * hidden, bias=False)
        self.U_f = nn.Linear(hidden, hidden, bias=False)

    def forward(self, iou_x, f_x, child_h, child_c):
        iou = iou_x
        if child_h:
            # last-dimension style (dim=-2, not 0): the block then also runs as written on a
            # batch of nodes, so batchcraft calls it directly instead of replaying it op by op
            hs = torch.stack(child_h, dim=-2)  # (k, hidden)
            cs = torch.stack(child_c, dim=-2)
            iou = iou + self.U_iou(hs.sum(-2))
            f = torch.sigmoid(f_x.unsqueeze(-2) + self.U_f(hs))  # one forget gate per child, (k, hidden)
        i, o, u = iou.chunk(3, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u)
        if child_h:
            c = c + (f * cs).sum(-2)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c


class TreeLSTM(nn.Module):
    """Child-Sum TreeLSTM encoder of one dependency tree.

    Args:
        vocab_size (int): word vocabulary size (id 0 = unknown).
        n_tags (int): UPOS vocabulary size. Default: 18 (17 tags + unknown).
        hidden (int): hidden size. Default: 256.
        word_dim (int | None): word embedding size. Default: ``hidden``.
        tag_dim (int): UPOS embedding size. Default: 32.
    Call:
        ``model(sentence)`` with a :class:`batchcraft.data.Sentence` whose ``word_ids`` and
        ``upos_ids`` are filled -> root hidden state, shape (hidden,), float32.
    """

    def __init__(self, vocab_size: int, n_tags: int = 18, hidden: int = 256,
                 word_dim: int | None = None, tag_dim: int = 32):
        super().__init__()
        word_dim = hidden if word_dim is None else word_dim
        self.hidden = hidden
        self.inputs = NodeInput(vocab_size, n_tags, word_dim, tag_dim, hidden)
        self.cell = ChildSumCell(hidden)

    def node(self, sentence, i: int, device=None):
        """(h, c) of word ``i``'s subtree (recursive, per instance)."""
        states = [self.node(sentence, c, device) for c in sentence.children[i]]
        iou_x, f_x = self.inputs(torch.tensor(sentence.word_ids[i], device=device),
                                 torch.tensor(sentence.upos_ids[i], device=device))
        return self.cell(iou_x, f_x, [h for h, _ in states], [c for _, c in states])

    def forward(self, sentence):
        return self.node(sentence, sentence.root, self.cell.U_f.weight.device)[0]
