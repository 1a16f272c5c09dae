"""Build a registered model and an input batch for it, for tuning and measuring.

Models in :mod:`batchcraft.models` that define ``example_input(batch_size)`` supply their own
input; for the others, the first convolution or linear layer decides the shape.
"""

from __future__ import annotations

import torch
from torch import nn

from batchcraft.errors import ConfigurationError

__all__ = ["build_model", "make_input"]

# Models that need inputs this module cannot make (trees, sequences): say so instead of guessing.
_UNSUPPORTED = {
    "treelstm": "the auto-batched TreeLSTM runs on trees, not on a tensor batch",
}


def build_model(name: str, **model_kwargs) -> nn.Module:
    """Build registry model ``name`` in eval mode.

    Raises:
        ConfigurationError: unknown name (the message lists the known ones) or unsupported model.
    """
    from batchcraft import models

    if name in _UNSUPPORTED:
        raise ConfigurationError(f"parallel: model {name!r} cannot be tuned here: {_UNSUPPORTED[name]}",
                                 hint="tune one of: " + ", ".join(n for n in models.names() if n not in _UNSUPPORTED))
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
