"""Bidirectional LSTM tagger predicting UPOS per word, written for one instance.

Graves and Schmidhuber, "Framewise phoneme classification with bidirectional
LSTM and other neural network architectures", Neural Networks 18(5), 2005
(the BiLSTM); as a POS tagger: Plank, Søgaard and Goldberg, "Multilingual
Part-of-Speech Tagging with Bidirectional LSTM Models", ACL 2016, §2
(arXiv 1604.05529), and the DyNet benchmark ``bilstm-tagger`` (Neubig et al.
2017) that ACRoBat §7 runs as BiRNN.

Each word's input is its word embedding; a forward and a backward LSTM run over
the sentence; a linear layer maps each word's two states to UPOS logits. The
per-instance code loops over one sentence; inside :func:`batchcraft.autobatch`
the t-th steps of all sentences run as one batched LSTM-cell call.
:func:`batchcraft.models.handbatched.birnn_padded` runs the same parameters as one
packed ``nn.LSTM`` call (the hand-batched reference).
"""

from __future__ import annotations

import torch
from torch import nn

from batchcraft.autobatching import static_block


class BiRNNTagger(nn.Module):
    """BiLSTM tagger of one sentence.

    Args:
        vocab_size (int): word vocabulary size (id 0 = unknown).
        hidden (int): LSTM state size of each direction. Default: 256.
        word_dim (int | None): word embedding size. Default: ``hidden``.
        n_tags (int): output classes. Default: 18 (17 UPOS tags + unknown).
    Call:
        ``model(sentence)`` with a :class:`batchcraft.data.Sentence` whose ``word_ids`` are
        filled -> UPOS logits per word, shape (len(sentence), n_tags), float32.
    Attributes:
        fwd, bwd (nn.LSTMCell): the two directions; their parameters have the layout of
            ``nn.LSTM``'s ``*_l0`` and ``*_l0_reverse`` (used by the hand-batched reference).
    """

    def __init__(self, vocab_size: int, hidden: int = 256, word_dim: int | None = None, n_tags: int = 18):
        super().__init__()
        word_dim = hidden if word_dim is None else word_dim
        self.hidden = hidden
        self.embed = static_block(nn.Embedding(vocab_size, word_dim))
        # each cell step is one static block: one recorded node instead of LSTMCell's six
        # (unsqueeze x3, lstm_cell, squeeze x2) for unbatched inputs
        self.fwd = static_block(nn.LSTMCell(word_dim, hidden))
        self.bwd = static_block(nn.LSTMCell(word_dim, hidden))
        self.out = static_block(nn.Linear(2 * hidden, n_tags))

    def forward(self, sentence):
        xs = [self.embed(torch.tensor(w)) for w in sentence.word_ids]
        h = c = torch.zeros(self.hidden)
        fw = []
        for x in xs:
            h, c = self.fwd(x, (h, c))
            fw.append(h)
        h = c = torch.zeros(self.hidden)
        bw = [None] * len(xs)
        for t in range(len(xs) - 1, -1, -1):
            h, c = self.bwd(xs[t], (h, c))
            bw[t] = h
        return torch.stack([self.out(torch.cat([f, b])) for f, b in zip(fw, bw)])


def build_task(sentences, hidden: int, seed: int = 0):
    """Suite entry: a BiLSTM UPOS tagger of size ``hidden`` over ``sentences`` (encoded in place)."""
    from batchcraft.data import Vocab, encode
    from batchcraft.models.suite import Task

    vocab = Vocab.from_sentences(sentences)
    encode(sentences, vocab)
    torch.manual_seed(seed)
    model = BiRNNTagger(len(vocab), hidden=hidden)
    return Task("birnn", model, model, list(sentences), hidden,
                f"BiLSTM UPOS tagger, hidden {hidden} per direction, over UD sentences")
