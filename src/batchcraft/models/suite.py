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


BUILDERS: dict[str, tuple[Callable, str]] = {
    "treelstm": (build_treelstm, "Child-Sum TreeLSTM over dependency trees (Tai et al. 2015)"),
}


def build(name: str, sentences: list[Sentence], *, size: str = "small", hidden: int | None = None,
          seed: int = 0) -> Task:
    """Build suite model ``name`` for ``sentences`` at ``size`` (or an explicit ``hidden``)."""
    if name not in BUILDERS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(BUILDERS))}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    h = hidden if hidden is not None else SIZES[size]
    return BUILDERS[name][0](sentences, h, seed=seed)
