"""Berxit: an early-exit Transformer encoder, written for one instance.

Xin, Tang, Yu and Lin, "BERxiT: Early Exiting for BERT with Better Fine-Tuning
and Extension to Regression", EACL 2021, §2-3; the exit rule of DeeBERT (Xin et
al., ACL 2020, §2.2): after each layer an exit classifier reads the first
([CLS]) position, and inference stops at the first layer whose classifier is
confident enough, ``if confidence > threshold: return``. ACRoBat §7 runs it as
Berxit: 6 layers, an exit test after each, so instances leave at different
layers (tensor-dependent control flow).

Sequence lengths come from the real sentences: ``[CLS] + words``, padded with a
key mask up to the next multiple of ``pad_to`` positions (16), so that sentences
of similar length share a signature and their layers batch together; the
padding never changes the [CLS] state (masked keys get zero attention).
Post-LN encoder layers as in BERT (Devlin et al. 2019), with explicit attention
maths so that every operation has a batching rule.

An untrained model has no meaningful confidence: its exit classifiers start
with wider weights (``exit_init_std``, default ``2 / sqrt(d_model)``) so that
confidence varies with the input, and :func:`build_task` calibrates the one
exit threshold on the task's first sentences (:func:`calibrate_threshold`: the
threshold that spreads exits most evenly over the layers), as BERxiT §4 and
DeeBERT §4 choose thresholds on dev data for a speed/accuracy trade-off.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from batchcraft.autobatching import static_block


@static_block
class Embed(nn.Module):
    """Per instance: ``ids`` (L,) int64 -> token + position embeddings, layer-normed, (L, d_model)."""

    def __init__(self, vocab_size: int, d_model: int, max_len: int):
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(max_len, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.register_buffer("positions", torch.arange(max_len), persistent=False)

    def forward(self, ids):
        return self.norm(self.token(ids) + self.position(self.positions[: ids.shape[0]]))


@static_block
class EncoderLayer(nn.Module):
    """Post-LN Transformer encoder layer (Vaswani et al. 2017, §3.2-3.3).

    Per instance: ``x`` (L, d_model), ``pad`` (L,) bool (True = padding) -> (L, d_model).
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"EncoderLayer: d_model {d_model} is not a multiple of n_heads {n_heads}")
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.ff2 = nn.Linear(d_ff, d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x, pad):
        L = x.shape[0]
        q, k, v = self.qkv(x).view(L, 3, self.n_heads, self.d_head).permute(1, 2, 0, 3)  # 3 x (H, L, dh)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.d_head)  # (H, L, L)
        attn = torch.softmax(scores.masked_fill(pad, float("-inf")), dim=-1)
        ctx = (attn @ v).transpose(0, 1).reshape(L, -1)
        x = self.norm1(x + self.proj(ctx))
        return self.norm2(x + self.ff2(F.gelu(self.ff1(x))))


@static_block
class ExitHead(nn.Module):
    """Per instance: ``x`` (L, d_model) -> ``(logits, confidence)``: (n_classes,) from [CLS], ()."""

    def __init__(self, d_model: int, n_classes: int, init_std: float):
        super().__init__()
        self.pool = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, n_classes)
        nn.init.normal_(self.out.weight, std=init_std)

    def forward(self, x):
        logits = self.out(torch.tanh(self.pool(x[0])))
        return logits, torch.softmax(logits, dim=-1).max()


class Berxit(nn.Module):
    """Early-exit Transformer encoder over one sentence.

    Args:
        vocab_size (int): word vocabulary size (ids 0 = unknown; the model adds [CLS] and [PAD]).
        d_model (int): model width. Default: 256. n_heads: ``max(1, d_model // 64)`` unless given.
        n_layers (int): encoder layers, each followed by an exit test. Default: 6.
        n_classes (int): classes of the exit classifiers. Default: 3.
        threshold (float): exit when the softmax's largest probability exceeds it. Default: 0.6.
        pad_to (int): pad ``[CLS] + words`` to a multiple of this length. Default: 16.
        max_len (int): longest padded sequence. Default: 512.
    Call:
        ``model(sentence)`` -> ``(logits, exit_layer)``: logits (n_classes,) of the layer that
        exited, and that layer's number (1..n_layers, a Python int).
    Raises:
        ValueError: a sentence longer than ``max_len - 1`` words.
    """

    def __init__(self, vocab_size: int, d_model: int = 256, n_layers: int = 6, n_heads: int | None = None,
                 d_ff: int | None = None, n_classes: int = 3, threshold: float = 0.6, pad_to: int = 16,
                 max_len: int = 512, exit_init_std: float | None = None):
        super().__init__()
        n_heads = n_heads or max(1, d_model // 64)
        self.cls_id, self.pad_id = vocab_size, vocab_size + 1
        self.threshold, self.pad_to, self.max_len = threshold, pad_to, max_len
        self.embed = Embed(vocab_size + 2, d_model, max_len)
        self.layers = nn.ModuleList(EncoderLayer(d_model, n_heads, d_ff or 4 * d_model) for _ in range(n_layers))
        std = 2.0 / d_model ** 0.5 if exit_init_std is None else exit_init_std
        self.exits = nn.ModuleList(ExitHead(d_model, n_classes, std) for _ in range(n_layers))

    def _inputs(self, sentence):
        n = len(sentence.word_ids) + 1
        L = -(-n // self.pad_to) * self.pad_to
        if L > self.max_len:
            raise ValueError(f"Berxit: sentence of {n - 1} words does not fit max_len={self.max_len}")
        x = self.embed(torch.tensor([self.cls_id] + list(sentence.word_ids) + [self.pad_id] * (L - n)))
        return x, torch.tensor([False] * n + [True] * (L - n))

    def confidences(self, sentence) -> list[float]:
        """Exit confidence after every layer, running all layers (eager; for calibration)."""
        with torch.no_grad():
            x, pad = self._inputs(sentence)
            out = []
            for layer, exit_head in zip(self.layers, self.exits):
                x = layer(x, pad)
                out.append(float(exit_head(x)[1]))
        return out

    def forward(self, sentence):
        x, pad = self._inputs(sentence)
        for depth, (layer, exit_head) in enumerate(zip(self.layers, self.exits), start=1):
            x = layer(x, pad)
            logits, conf = exit_head(x)
            if conf > self.threshold:  # the fiber waits here for this layer's batched work
                return logits, depth
        return logits, len(self.layers)


def calibrate_threshold(model: Berxit, sentences) -> float:
    """The exit threshold whose exit layers over ``sentences`` have the largest entropy.

    Args:
        model (Berxit): the model (its ``threshold`` is not changed).
        sentences (list[Sentence]): encoded sentences (a few dozen suffice).
    Returns:
        float: a threshold half-way between two observed confidences.
    """
    confs = [model.confidences(s) for s in sentences]
    values = sorted({c for row in confs for c in row})
    candidates = [(a + b) / 2 for a, b in zip(values, values[1:])] or [model.threshold]
    n_layers = len(model.layers)

    def entropy(thr: float) -> float:
        counts = [0] * n_layers
        for row in confs:
            counts[next((i for i, c in enumerate(row) if c > thr), n_layers - 1)] += 1
        return -sum(k / len(confs) * math.log(k / len(confs)) for k in counts if k)

    return max(candidates[:: max(1, len(candidates) // 400)], key=entropy)


def build_task(sentences, hidden: int, seed: int = 0):
    """Suite entry: a 6-layer Berxit of width ``hidden`` over ``sentences`` (encoded in place)."""
    from batchcraft.data import Vocab, encode
    from batchcraft.models.suite import Task

    vocab = Vocab.from_sentences(sentences)
    encode(sentences, vocab)
    torch.manual_seed(seed)
    model = Berxit(len(vocab), d_model=hidden)
    model.threshold = calibrate_threshold(model, list(sentences)[:64])
    return Task("berxit", model, model, list(sentences), hidden,
                f"Berxit early-exit encoder, 6 layers, d_model {hidden}, exit threshold "
                f"{model.threshold:.3f}, UD sentence lengths")
