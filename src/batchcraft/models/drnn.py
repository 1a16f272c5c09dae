"""Doubly-recurrent tree decoder (DRNN), written for one instance.

Alvarez-Melis and Jaakkola, "Tree-structured Decoding with Doubly-recurrent
Neural Networks", ICLR 2017, §3 (eqs. 1-7). A tree grows top-down from an
encoding. Each node has an ancestral state (from its parent) and a fraternal
state (from its previous sibling):

    h_a = GRU_a(emb(parent label), h_a(parent))     h_f = GRU_f(emb(previous sibling label), h_f(previous))
    h   = tanh(U_a h_a + U_f h_f)
    p_a = sigmoid(u_a . h)   (the node has children)     p_f = sigmoid(u_f . h)   (a next sibling follows)
    o   = W h + v_a p_a + v_f p_f                         (label logits; label = argmax o)

Decoding decides with ``if p_a > 0.5`` / ``if p_f > 0.5`` on the predicted
probabilities and ``int(argmax(o))`` for the label: tensor-dependent control
flow, so every instance grows a different tree. Inside
:func:`batchcraft.autobatch` each instance runs as a fiber that waits at those
decisions while the pending nodes of all instances run as batched calls.

The encoding is the final state of a GRU over the sentence's word + UPOS
embeddings; labels are UPOS tags (the decoder would be trained to regrow the
sentence's dependency tree). Growth is capped at ``max_nodes`` nodes and
``max_depth`` levels. Untrained, the decisions hardly depend on the input;
:func:`calibrate_decisions` (used by :func:`build_task`) centres them so that
trees vary in size and shape from instance to instance.
"""

from __future__ import annotations

import torch
from torch import nn

from batchcraft.autobatching import phase, static_block


@static_block
class TokenInput(nn.Module):
    """Per instance: ``word_id``, ``upos_id`` () int64 -> concatenated embeddings (word_dim + tag_dim,)."""

    def __init__(self, vocab_size: int, n_tags: int, word_dim: int, tag_dim: int):
        super().__init__()
        self.word = nn.Embedding(vocab_size, word_dim)
        self.tag = nn.Embedding(n_tags, tag_dim)

    def forward(self, word_id, upos_id):
        return torch.cat([self.word(word_id), self.tag(upos_id)], dim=-1)


@static_block
class NodePredict(nn.Module):
    """Per instance: ``h_a``, ``h_f`` (hidden,) -> ``(o, p_a, p_f)``: (n_labels,), (), () (eqs. 3-6)."""

    def __init__(self, hidden: int, n_labels: int):
        super().__init__()
        self.U_a = nn.Linear(hidden, hidden)
        self.U_f = nn.Linear(hidden, hidden, bias=False)
        self.u_a = nn.Linear(hidden, 1)
        self.u_f = nn.Linear(hidden, 1)
        self.W = nn.Linear(hidden, n_labels)
        self.v_a = nn.Parameter(0.1 * torch.randn(n_labels))
        self.v_f = nn.Parameter(0.1 * torch.randn(n_labels))
        # Untrained, the default init makes p_a and p_f nearly constant (their bias dominates), so
        # every tree would stop at the root. Zero bias and a wider weight put the decisions around
        # 0.5 and make them depend on the state: each instance grows its own tree.
        for lin in (self.u_a, self.u_f):
            nn.init.normal_(lin.weight, std=2.0 / hidden ** 0.5)
            nn.init.zeros_(lin.bias)

    def forward(self, h_a, h_f):
        h = torch.tanh(self.U_a(h_a) + self.U_f(h_f))
        p_a = torch.sigmoid(self.u_a(h)).squeeze(-1)
        p_f = torch.sigmoid(self.u_f(h)).squeeze(-1)
        return self.W(h) + self.v_a * p_a.unsqueeze(-1) + self.v_f * p_f.unsqueeze(-1), p_a, p_f


class DRNN(nn.Module):
    """Sentence encoder plus doubly-recurrent tree decoder.

    Args:
        vocab_size (int): word vocabulary size (id 0 = unknown).
        hidden (int): state size of the encoder and both decoder recurrences. Default: 256.
        n_labels (int): node labels (UPOS + unknown). Default: 18. Label ``n_labels`` is
            the start symbol fed to the root and to first children.
        max_nodes (int): at most this many nodes per decoded tree. Default: 24.
        max_depth (int): at most this many levels. Default: 6.
    Call:
        ``model(sentence)`` -> ``{"logits": (k, n_labels), "p_a": (k,), "p_f": (k,),
        "parents": list[int]}`` for the k decoded nodes in creation order (``parents[0] = -1``).
    """

    def __init__(self, vocab_size: int, hidden: int = 256, n_labels: int = 18, word_dim: int | None = None,
                 tag_dim: int = 32, max_nodes: int = 24, max_depth: int = 6):
        super().__init__()
        word_dim = hidden if word_dim is None else word_dim
        self.hidden, self.n_labels = hidden, n_labels
        self.max_nodes, self.max_depth = max_nodes, max_depth
        self.inputs = TokenInput(vocab_size, 18, word_dim, tag_dim)
        # RNN cells as static blocks: one recorded node per step (see birnn.py)
        self.encoder = static_block(nn.GRUCell(word_dim + tag_dim, hidden))
        self.label = static_block(nn.Embedding(n_labels + 1, hidden))
        self.ancestral = static_block(nn.GRUCell(hidden, hidden))
        self.fraternal = static_block(nn.GRUCell(hidden, hidden))
        self.predict = NodePredict(hidden, n_labels)

    def encode(self, sentence):
        h = torch.zeros(self.hidden)
        for w, t in zip(sentence.word_ids, sentence.upos_ids):
            h = self.encoder(self.inputs(torch.tensor(w), torch.tensor(t)), h)
        return h

    def _children(self, h_a_parent, parent_label: int, parent: int, depth: int, out: dict) -> None:
        """Grow the children of node ``parent`` (and, recursively, their subtrees)."""
        h_a = self.ancestral(self.label(torch.tensor(parent_label)), h_a_parent)
        h_f = torch.zeros(self.hidden)
        prev = self.n_labels  # start symbol
        while len(out["parents"]) < self.max_nodes:
            h_f = self.fraternal(self.label(torch.tensor(prev)), h_f)
            me = self._node(h_a, h_f, parent, out)
            label = int(torch.argmax(out["logits"][-1]))  # fiber waits here
            grow, more = out["p_a"][-1] > 0.5, out["p_f"][-1] > 0.5
            if grow and depth + 1 < self.max_depth:
                self._children(h_a, label, me, depth + 1, out)
            if not more:
                break
            prev = label

    def _node(self, h_a, h_f, parent: int, out: dict) -> int:
        logits, p_a, p_f = self.predict(h_a, h_f)
        out["logits"].append(logits)
        out["p_a"].append(p_a)
        out["p_f"].append(p_f)
        out["parents"].append(parent)
        return len(out["parents"]) - 1

    def forward(self, sentence):
        enc = self.encode(sentence)
        phase("decoder")
        out = {"logits": [], "p_a": [], "p_f": [], "parents": []}
        h_a = enc  # the root's ancestral state is the encoding; it has no siblings
        self._node(h_a, torch.zeros(self.hidden), -1, out)
        label = int(torch.argmax(out["logits"][0]))
        if out["p_a"][0] > 0.5 and self.max_depth > 1:
            self._children(h_a, label, 0, 1, out)
        return {"logits": torch.stack(out["logits"]), "p_a": torch.stack(out["p_a"]),
                "p_f": torch.stack(out["p_f"]), "parents": out["parents"]}


def calibrate_decisions(model: DRNN, sentences, rounds: int = 3) -> None:
    """Shift the biases of ``u_a`` and ``u_f`` so that about half of the decisions are "yes".

    An untrained decoder's topology decisions hardly depend on the input (most trees stop at
    the root). Each round decodes ``sentences`` eagerly, collects the decision logits of all
    nodes, and subtracts their median (the midpoint of the two middle logits) from the bias: trees then branch about as often as they
    stop and vary from instance to instance, as a trained decoder's do. In place.
    """
    pred = model.predict
    for _ in range(rounds):
        z_a, z_f = [], []
        with torch.no_grad():
            for s in sentences:
                out = model(s)
                z_a += torch.logit(out["p_a"], eps=1e-6).tolist()
                z_f += torch.logit(out["p_f"][1:], eps=1e-6).tolist()  # a root's p_f is unused
            pred.u_a.bias -= _gap_median(z_a)
            pred.u_f.bias -= _gap_median(z_f)


def _gap_median(values: list[float]) -> float:
    """Midpoint between the two middle values: after the shift no decision sits exactly at 0.5,
    where float32 rounding differences (batched vs. one-at-a-time kernels) could flip it."""
    if not values:
        return 0.0
    z = sorted(values)
    k = len(z) // 2
    return (z[k - 1] + z[k]) / 2 if k else z[0] - 1.0


def build_task(sentences, hidden: int, seed: int = 0):
    """Suite entry: a DRNN of size ``hidden`` decoding a tree from each of ``sentences``."""
    from batchcraft.data import Vocab, encode
    from batchcraft.models.suite import Task

    vocab = Vocab.from_sentences(sentences)
    encode(sentences, vocab)
    torch.manual_seed(seed)
    model = DRNN(len(vocab), hidden=hidden)
    calibrate_decisions(model, list(sentences)[:32])
    return Task("drnn", model, model, list(sentences), hidden,
                f"DRNN tree decoder (stops on predicted probabilities), hidden {hidden}, from UD sentences")
