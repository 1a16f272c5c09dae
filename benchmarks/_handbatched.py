"""Adapter from the benchmark to the hand-batched references in ``batchcraft.models.handbatched``.

The references are owned by the models (issue 3); this only maps a suite model name to the
function that runs one whole batch, ``fn(model, sentences) -> list`` of per-sentence results.
"""

from __future__ import annotations

import importlib
import importlib.util

#: suite model name -> function name in batchcraft.models.handbatched
FUNCTIONS = {"treelstm": "treelstm_levels", "birnn": "birnn_padded"}


def _module():
    if importlib.util.find_spec("batchcraft.models.handbatched") is None:
        return None
    return importlib.import_module("batchcraft.models.handbatched")


def available(model: str) -> bool:
    """True when ``batchcraft.models.handbatched`` has a reference for suite model ``model``."""
    mod = _module()
    return mod is not None and hasattr(mod, FUNCTIONS.get(model, ""))


def batched_fn(task):
    """``f(batch) -> list`` running ``task.model`` over a whole batch by hand."""
    fn = getattr(_module(), FUNCTIONS[task.name])
    return lambda batch: fn(task.model, batch)
