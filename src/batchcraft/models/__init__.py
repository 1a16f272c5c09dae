"""Reference models, one module per model, the paper in each module's docstring.

``get(name, **kwargs)`` builds a model by its registry name; ``names()`` lists them.
The registry holds import paths so that importing this package stays cheap.
"""

from __future__ import annotations

import importlib

# name -> "module:factory". Keep one line per model; add yours in its group.
_REGISTRY: dict[str, str] = {
    # auto-batching (per-instance dynamic models)
    "treelstm": "batchcraft.models.treelstm:TreeLSTM",
    # micro-batching (convolutional reference networks)
    # parallelism tuning
}


def names() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_REGISTRY)


def get(name: str, **kwargs):
    """Build the model registered as ``name`` with keyword arguments ``kwargs``.

    Raises:
        KeyError: unknown name; the message lists the known ones.
    """
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"models.get: unknown model {name!r}; known: {', '.join(names())}") from None
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)(**kwargs)


__all__ = ["get", "names"]
