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
    "mvrnn": "batchcraft.models.mvrnn:MVRNN",
    "birnn": "batchcraft.models.birnn:BiRNNTagger",
    "nestedrnn": "batchcraft.models.nestedrnn:NestedRNN",
    "drnn": "batchcraft.models.drnn:DRNN",
    "berxit": "batchcraft.models.berxit:Berxit",
    "stackrnn": "batchcraft.models.stackrnn:StackRNNParser",
    # micro-batching (convolutional reference networks)
    "alexnet": "batchcraft.models.alexnet:alexnet",
    "resnet18": "batchcraft.models.resnet:resnet18",
    "deepbench_3x3_54x54x64": "batchcraft.models.deepbench:deepbench_3x3_54x54x64",
    "deepbench_3x3_224x224x3": "batchcraft.models.deepbench:deepbench_3x3_224x224x3",
    "deepbench_1x1_112x112x64": "batchcraft.models.deepbench:deepbench_1x1_112x112x64",
    "deepbench_5x5_28x28x192_style": "batchcraft.models.deepbench:deepbench_5x5_28x28x192_style",
    "deepbench_5x5_14x14x512_style": "batchcraft.models.deepbench:deepbench_5x5_14x14x512_style",
    # parallelism tuning
    "mlp_fc512": "batchcraft.models.mlp:mlp_fc512",
    "mlp_fc4096": "batchcraft.models.mlp:mlp_fc4096",
    "inception_wide": "batchcraft.models.inception:InceptionWide",
    "recommender": "batchcraft.models.recommender:WideDeepRecommender",
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
