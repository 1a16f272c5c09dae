"""What a tuning trial runs: a registered model, its input batches and how to call it.

Models in :mod:`batchcraft.models` that define ``example_input(batch_size)`` supply their own
input; for other tensor models the first convolution or linear layer decides the shape. The
auto-batched TreeLSTM is special: a batch is a list of real UD English EWT sentences, run through
:func:`batchcraft.autobatch`; it cannot be traced, so it gets no inter-op pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from batchcraft.errors import ConfigurationError

__all__ = ["Workload", "build_workload", "build_model", "make_input"]

_TREE_SENTENCES = 256  # sentences loaded for TreeLSTM batches (reused cyclically)


@dataclass
class Workload:
    """A model and how to feed it.

    Attributes:
        name (str): registry name.
        model (nn.Module): in eval mode.
        make_batch (callable): ``make_batch(batch_size) -> input`` (a tensor, or a list of instances).
        call (callable): ``call(input)``; the plain model, or the auto-batched one for TreeLSTM.
        traceable (bool): the model can run in the inter-op executor (torch.fx traceable).
    """

    name: str
    model: nn.Module
    make_batch: Callable
    call: Callable
    traceable: bool = True


def build_model(name: str, **model_kwargs) -> nn.Module:
    """Build registry model ``name`` in eval mode.

    Raises:
        ConfigurationError: unknown name (the message lists the known ones).
    """
    from batchcraft import models

    try:
        model = models.get(name, **model_kwargs)
    except KeyError as exc:
        raise ConfigurationError(str(exc.args[0])) from None
    return model.eval()


def make_input(model: nn.Module, batch_size: int, *, image_size: int | None = None, seed: int = 0):
    """An input batch for ``model``: its ``example_input`` if any, else shaped from its first layer.

    Args:
        model (nn.Module): the model.
        batch_size (int): leading dimension (>= 1).
        image_size (int, optional): height = width for image models without ``example_input``.
            Default: None (224).
        seed (int): random seed. Default: 0.
    Returns:
        Tensor: (batch_size, ...) input.
    Raises:
        ConfigurationError: batch_size < 1, or no input shape can be derived.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"make_input: batch_size must be an int >= 1, got {batch_size!r}")
    if hasattr(model, "example_input"):
        return model.example_input(batch_size, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, nn.Conv2d):
            size = image_size or 224
            return torch.randn(batch_size, mod.in_channels, size, size, generator=g)
        if isinstance(mod, nn.Linear):
            return torch.randn(batch_size, mod.in_features, generator=g)
    raise ConfigurationError(
        f"make_input: cannot derive an input shape for {type(model).__name__}",
        hint="give the model an example_input(batch_size, seed=0) method")


def _treelstm(model_kwargs: dict, seed: int) -> Workload:
    from batchcraft import autobatch
    from batchcraft.data import load_sentences
    from batchcraft.models import suite

    sentences = load_sentences(limit=_TREE_SENTENCES)
    task = suite.build("treelstm", sentences, hidden=model_kwargs.get("hidden", 256), seed=seed)
    run = autobatch(task.fn)
    offset = (seed * 37) % len(task.instances)  # instances of different processes see different trees

    def make_batch(batch_size: int):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"make_input: batch_size must be an int >= 1, got {batch_size!r}")
        n = len(task.instances)
        return [task.instances[(offset + i) % n] for i in range(batch_size)]

    return Workload("treelstm", task.model.eval(), make_batch, run, traceable=False)


def build_workload(name: str, *, model_kwargs: dict | None = None, image_size: int | None = None,
                   seed: int = 0) -> Workload:
    """The model registered as ``name`` with its input maker and call.

    Raises:
        ConfigurationError: unknown model, or no input can be derived for it.
    """
    model_kwargs = dict(model_kwargs or {})
    if name == "treelstm":
        return _treelstm(model_kwargs, seed)
    model = build_model(name, **model_kwargs)
    make_input(model, 1, image_size=image_size)  # fail early if no input shape can be derived
    return Workload(name, model, lambda b: make_input(model, b, image_size=image_size, seed=seed), model)
