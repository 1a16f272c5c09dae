"""The auto-batching model suite: how to build each per-instance model and its instances.

Each entry turns real UD English EWT sentences into instances and builds the
per-instance model at a size (``small`` / ``large``, ACRoBat's sizes). Used by
``batchcraft run`` and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from batchcraft.data import Sentence, Vocab, encode

#: hidden sizes per model and size (ACRoBat §7: 256/512 for the RNNs, MV-RNN 64/128)
SIZES = {"small": 256, "large": 512}


@dataclass
class Task:
    """A model ready to run: per-instance callable, instances, and a description."""

    name: str
    model: torch.nn.Module
    fn: Callable  # per-instance function (model or a wrapper)
    instances: list
    hidden: int
    description: str


def build_treelstm(sentences: list[Sentence], hidden: int, seed: int = 0) -> Task:
    from batchcraft.models.treelstm import TreeLSTM

    vocab = Vocab.from_sentences(sentences)
    encode(sentences, vocab)
    torch.manual_seed(seed)
    model = TreeLSTM(len(vocab), hidden=hidden)
    return Task("treelstm", model, model, list(sentences), hidden,
                f"Child-Sum TreeLSTM, hidden {hidden}, over UD dependency trees")


def _from_module(module: str) -> Callable:
    """Builder that imports ``batchcraft.models.<module>`` only when used, then calls its build_task."""

    def builder(sentences: list[Sentence], hidden: int, seed: int = 0) -> Task:
        import importlib

        return importlib.import_module(f"batchcraft.models.{module}").build_task(sentences, hidden, seed=seed)

    builder.__name__ = f"build_{module}"
    return builder


BUILDERS: dict[str, tuple[Callable, str]] = {
    "treelstm": (build_treelstm, "Child-Sum TreeLSTM over dependency trees (Tai et al. 2015)"),
    # ACRoBat suite (issue 3): one module per model, each with build_task(sentences, hidden, seed)
    "mvrnn": (_from_module("mvrnn"), "MV-RNN over dependency trees (Socher et al. 2012)"),
    "birnn": (_from_module("birnn"), "BiLSTM UPOS tagger, per-word logits (Plank et al. 2016)"),
    "nestedrnn": (_from_module("nestedrnn"), "word LSTM over character-GRU word vectors (Ling et al. 2015)"),
    "drnn": (_from_module("drnn"), "doubly-recurrent tree decoder, stops on probabilities (Alvarez-Melis 2017)"),
    "berxit": (_from_module("berxit"), "early-exit Transformer encoder, 6 layers (Xin et al. 2021)"),
    "stackrnn": (_from_module("stackrnn"), "stack-LSTM transition parser, argmax over legal moves (Dyer 2015)"),
}

#: models whose sizes differ from SIZES (ACRoBat §7: MV-RNN 64 / 128, its word matrices are hidden^2)
MODEL_SIZES: dict[str, dict[str, int]] = {"mvrnn": {"small": 64, "large": 128}}


def build(name: str, sentences: list[Sentence], *, size: str = "small", hidden: int | None = None,
          seed: int = 0) -> Task:
    """Build suite model ``name`` for ``sentences`` at ``size`` (or an explicit ``hidden``)."""
    if name not in BUILDERS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(BUILDERS))}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    h = hidden if hidden is not None else MODEL_SIZES.get(name, SIZES)[size]
    return BUILDERS[name][0](sentences, h, seed=seed)
