"""Serving auto-batched functions: requests arrive one instance at a time, run in batches.

* :class:`BatchPolicy` (``gather.py``): when a batch closes (instances, work units, max wait).
* :func:`run_isolated` (``isolate.py``): one auto-batched call per batch, a failing instance
  fails only its own request.
* :class:`DynamicBatcher` (``batcher.py``): thread-safe in-process batcher (futures).
* :mod:`batchcraft.serving.ray_serve`: the same on Ray Serve (``@serve.batch``); needs the
  ``serve`` extra (``pip install 'batchcraft[serve]'``) and is imported only when asked for.
"""

from batchcraft.serving.batcher import BatcherClosedError, BatcherStats, DynamicBatcher, MonotonicClock
from batchcraft.serving.gather import BatchPolicy
from batchcraft.serving.isolate import Outcome, run_isolated

__all__ = ["BatchPolicy", "BatcherClosedError", "BatcherStats", "DynamicBatcher", "MonotonicClock",
           "Outcome", "run_isolated"]
