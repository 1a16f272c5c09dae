"""batchcraft: make PyTorch work fast by choosing the grain of the work.

Three doors, one per capability:

* :func:`autobatch` (merge): run per-instance code over many instances with
  same-shaped work executed as batched kernels (ACRoBat, DyNet auto-batching).
* :func:`microbatch` (split): divide each convolution's mini-batch into
  micro-batches so faster algorithms fit a workspace budget (μ-cuDNN).
* :mod:`batchcraft.parallel` (spread): analyse, tune and launch with the right
  intra-op/inter-op threads, instances and batch size (Wang et al. 2019).
"""

from __future__ import annotations

__version__ = "0.1.0"

from batchcraft.errors import BatchcraftError
from batchcraft.autobatching import RunStats, autobatch, phase, static_block


def __getattr__(name: str):
    # Lazy doors: importing batchcraft should not pay for scipy/sqlite planning code.
    if name == "microbatch":
        from batchcraft.microbatching import microbatch

        return microbatch
    if name in ("parallel", "models", "data", "measure", "microbatching", "autobatching"):
        import importlib

        return importlib.import_module(f"batchcraft.{name}")
    raise AttributeError(f"module 'batchcraft' has no attribute {name!r}")


__all__ = [
    "autobatch",
    "static_block",
    "phase",
    "RunStats",
    "microbatch",
    "parallel",
    "models",
    "data",
    "BatchcraftError",
    "__version__",
]
