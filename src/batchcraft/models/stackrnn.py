"""StackRNN: a transition-based dependency parser with stack LSTMs, written for one instance.

Dyer, Ballesteros, Ling, Matthews and Smith, "Transition-Based Dependency
Parsing with Stack Long Short-Term Memory", ACL 2015, §2-3 (arXiv 1505.08075).
An arc-standard parser keeps a stack, a buffer and the action history, each
summarised by an LSTM; the stack LSTM pushes by running one cell step from the
top's state and pops by dropping back to the state below. At every step a
parser state ``p = relu(W [s; b; a] + d)`` scores SHIFT, LEFT-ARC and
RIGHT-ARC; the parser takes the best *legal* action,
``int(torch.argmax(scores + illegal_mask))``, so the number of each action and
the tree built depend on the network's values (tensor-dependent control flow).
An arc composes head and dependent, ``c = tanh(C [h; d] + e)`` (§3.4), and the
composed vector replaces the head on the stack.

Simplifications: no relation labels and no pretrained embeddings; the buffer
LSTM runs once right to left over the sentence (its state at word i summarises
the buffer starting at i, which the arc-standard buffer only ever pops from the
front). A sentence of n words takes 2n - 1 transitions.

Inside :func:`batchcraft.autobatch` each sentence is a fiber that waits at the
argmax while the pending steps of all sentences run as batched calls
(the case that got no batching at all in DyNet, issue #1407).
"""

from __future__ import annotations

import torch
from torch import nn

from batchcraft.autobatching import phase, static_block

SHIFT, LEFT_ARC, RIGHT_ARC = 0, 1, 2
ACTIONS = ("SHIFT", "LEFT-ARC", "RIGHT-ARC")


@static_block
class TokenInput(nn.Module):
    """Per instance: ``word_id``, ``upos_id`` () int64 -> ``relu(V [w; t] + b)``, (hidden,)."""

    def __init__(self, vocab_size: int, n_tags: int, word_dim: int, tag_dim: int, hidden: int):
        super().__init__()
        self.word = nn.Embedding(vocab_size, word_dim)
        self.tag = nn.Embedding(n_tags, tag_dim)
        self.V = nn.Linear(word_dim + tag_dim, hidden)

    def forward(self, word_id, upos_id):
        return torch.relu(self.V(torch.cat([self.word(word_id), self.tag(upos_id)], -1)))


@static_block
class ParserState(nn.Module):
    """Parser state and action choice (§3.1).

    Per instance: stack, buffer, history summaries (hidden,) each, and ``illegal`` (3,) (0 for a
    legal action, -inf otherwise) -> ``(scores, best)``: scores (3,) before masking, and the
    best legal action () int64.
    """

    def __init__(self, hidden: int):
        super().__init__()
        self.W = nn.Linear(3 * hidden, hidden)
        self.score = nn.Linear(hidden, len(ACTIONS))
        nn.init.zeros_(self.score.bias)  # untrained, a random bias alone would pick one arc direction

    def forward(self, s, b, a, illegal):
        scores = self.score(torch.relu(self.W(torch.cat([s, b, a], -1))))
        return scores, torch.argmax(scores + illegal, -1)


@static_block
class HistoryStep(nn.Module):
    """Per instance: action id () int64, history LSTM state (h, c) -> next (h, c), (hidden,) each."""

    def __init__(self, hidden: int):
        super().__init__()
        self.action = nn.Embedding(len(ACTIONS), hidden)
        self.rnn = nn.LSTMCell(hidden, hidden)

    def forward(self, action, state):
        return self.rnn(self.action(action), state)


@static_block
class Compose(nn.Module):
    """Per instance: head, dependent (hidden,) -> composed head representation (hidden,) (§3.4)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.C = nn.Linear(2 * hidden, hidden)

    def forward(self, head, dep):
        return torch.tanh(self.C(torch.cat([head, dep], -1)))


class StackRNNParser(nn.Module):
    """Arc-standard stack-LSTM dependency parser of one sentence.

    Args:
        vocab_size (int): word vocabulary size (id 0 = unknown).
        hidden (int): size of token vectors and of the three LSTMs. Default: 256.
    Call:
        ``model(sentence)`` -> ``{"scores": (2n - 1, 3) float32, "actions": list[int],
        "heads": list[int]}``: each step's action scores (before masking illegal actions),
        the actions taken, and the predicted head of each word (-1 for the root).
    """

    def __init__(self, vocab_size: int, hidden: int = 256, word_dim: int | None = None, tag_dim: int = 32):
        super().__init__()
        word_dim = hidden if word_dim is None else word_dim
        self.hidden = hidden
        self.inputs = TokenInput(vocab_size, 18, word_dim, tag_dim, hidden)
        # RNN cells as static blocks: one recorded node per step (see birnn.py)
        self.buffer_rnn = static_block(nn.LSTMCell(hidden, hidden))
        self.stack_rnn = static_block(nn.LSTMCell(hidden, hidden))
        self.history = HistoryStep(hidden)
        self.state = ParserState(hidden)
        self.compose = Compose(hidden)

    @staticmethod
    def legal(n_stack: int, n_buffer: int) -> list[bool]:
        """Which of SHIFT, LEFT-ARC, RIGHT-ARC the arc-standard system allows."""
        return [n_buffer > 0, n_stack >= 2, n_stack >= 2]

    def forward(self, sentence):
        n = len(sentence.word_ids)
        zero = torch.zeros(self.hidden)
        tokens = [self.inputs(torch.tensor(w), torch.tensor(t))
                  for w, t in zip(sentence.word_ids, sentence.upos_ids)]
        buffer = [None] * n + [zero]  # buffer[i]: LSTM summary of words i.. (right to left)
        h = c = zero
        for i in range(n - 1, -1, -1):
            h, c = self.buffer_rnn(tokens[i], (h, c))
            buffer[i] = h
        phase("transitions")
        stack = [(None, -1, (zero, zero))]  # (vector, word, stack-LSTM state); sentinel at the bottom
        history = (zero, zero)
        front, heads, actions, scores = 0, [-1] * n, [], []
        while front < n or len(stack) > 2:
            legal = self.legal(len(stack) - 1, n - front)
            illegal = torch.tensor([0.0 if ok else float("-inf") for ok in legal])
            s, best = self.state(stack[-1][2][0], buffer[front], history[0], illegal)
            scores.append(s)
            act = int(best)  # the fiber waits here
            if act == SHIFT:
                vec, word = tokens[front], front
                front += 1
            else:
                (v0, w0, _), (v1, w1, _) = stack.pop(), stack.pop()
                if act == LEFT_ARC:  # s1 <- s0: s0 is the head
                    heads[w1] = w0
                    vec, word = self.compose(v0, v1), w0
                else:  # s1 -> s0: s1 is the head
                    heads[w0] = w1
                    vec, word = self.compose(v1, v0), w1
            stack.append((vec, word, self.stack_rnn(vec, stack[-1][2])))
            history = self.history(torch.tensor(act), history)
            actions.append(act)
        return {"scores": torch.stack(scores), "actions": actions, "heads": heads}


def build_task(sentences, hidden: int, seed: int = 0):
    """Suite entry: a StackRNN parser of size ``hidden`` over ``sentences`` (encoded in place)."""
    from batchcraft.data import Vocab, encode
    from batchcraft.models.suite import Task

    vocab = Vocab.from_sentences(sentences)
    encode(sentences, vocab)
    torch.manual_seed(seed)
    model = StackRNNParser(len(vocab), hidden=hidden)
    return Task("stackrnn", model, model, list(sentences), hidden,
                f"StackRNN arc-standard parser (argmax over legal transitions), hidden {hidden}, UD sentences")
