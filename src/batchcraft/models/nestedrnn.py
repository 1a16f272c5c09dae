"""Nested RNN: a word-level LSTM whose inputs come from a character-level GRU, for one instance.

Ling, Luís, Marujo, Astudillo, Amir, Dyer, Black and Trancoso, "Finding Function
in Form: Compositional Character Models for Open Vocabulary Word Representation",
EMNLP 2015, §2 (arXiv 1508.02096): a word's representation is the final state of
an RNN over its characters; a sentence-level RNN runs over those
representations. ACRoBat §7 runs this shape of model as NestedRNN: two levels of
loops with instance-dependent trip counts (words per sentence, characters per word).

The per-instance code loops over the words of one sentence and, inside, over the
characters of each word; inside :func:`batchcraft.autobatch` the c-th characters
of all words of all sentences run as one batched GRU-cell call, then the t-th
words of all sentences as one batched LSTM-cell call.
"""

from __future__ import annotations

import torch
from torch import nn

from batchcraft.autobatching import static_block


class NestedRNN(nn.Module):
    """Character GRU inside a word LSTM, over one sentence.

    Args:
        chars (str | Iterable[str]): the character inventory (id 0 = unknown character).
        hidden (int): state size of both RNNs. Default: 256.
        char_dim (int): character embedding size. Default: 64.
    Call:
        ``model(sentence)`` with a :class:`batchcraft.data.Sentence` -> the word LSTM's final
        hidden state, shape (hidden,), float32.
    """

    def __init__(self, chars, hidden: int = 256, char_dim: int = 64):
        super().__init__()
        self.char_ids = {ch: i + 1 for i, ch in enumerate(sorted(set(chars)))}
        self.hidden = hidden
        self.char_embed = static_block(nn.Embedding(len(self.char_ids) + 1, char_dim))
        # each cell step is one static block: one recorded node instead of the cell's unbatched
        # input handling (unsqueeze, cell, squeeze) as separate nodes
        self.char_rnn = static_block(nn.GRUCell(char_dim, hidden))
        self.word_rnn = static_block(nn.LSTMCell(hidden, hidden))

    def word(self, form: str):
        """Final character-GRU state of one word, shape (hidden,)."""
        h = torch.zeros(self.hidden)
        for ch in form:
            h = self.char_rnn(self.char_embed(torch.tensor(self.char_ids.get(ch, 0))), h)
        return h

    def forward(self, sentence):
        h = c = torch.zeros(self.hidden)
        for form in sentence.words:
            h, c = self.word_rnn(self.word(form), (h, c))
        return h


def build_task(sentences, hidden: int, seed: int = 0):
    """Suite entry: a NestedRNN of size ``hidden``, characters taken from ``sentences``."""
    from batchcraft.models.suite import Task

    torch.manual_seed(seed)
    model = NestedRNN("".join(w for s in sentences for w in s.words), hidden=hidden)
    return Task("nestedrnn", model, model, list(sentences), hidden,
                f"NestedRNN (character GRU inside word LSTM), hidden {hidden}, over UD sentences")
