"""Recommended configurations the tuner is compared with (and always also measures).

What each baseline sets, and where the recommendation comes from:

* ``pytorch-default``: nothing. One process, eager execution, PyTorch's own intra-op and inter-op
  defaults (OMP_NUM_THREADS / MKL_NUM_THREADS removed from the environment), no pinning.
* ``intel-recommended``: Intel, "Maximize TensorFlow Performance on CPU: Considerations and
  Recommendations for Inference Workloads" (2019), the baseline of Wang et al. (arXiv 1908.04705):
  intra-op threads = physical cores, inter-op = sockets, OMP_NUM_THREADS = physical cores,
  KMP_AFFINITY=granularity=fine,compact,1,0 and KMP_BLOCKTIME=1. PyTorch's wheels use GNU OpenMP,
  which ignores KMP_*, so the compact placement is also requested the GNU way (OMP_PROC_BIND=close,
  OMP_PLACES=cores) and the process is pinned to the usable cores. Inter-op = sockets maps to that
  many executor pools, each with ``intra`` threads.
* ``tensorflow-recommended``: TensorFlow 1.x performance guide, "Optimizing for CPU": leave
  ``intra_op_parallelism_threads`` and ``inter_op_parallelism_threads`` at 0, i.e. both = logical
  cores ("effective for systems ranging from one CPU with 4 cores to multiple CPUs with 70+
  combined logical cores"). In PyTorch every concurrent operator gets its own OpenMP team, so
  logical-cores pools x logical-cores threads oversubscribes the machine; that is what following
  the recommendation does here, and it is measured as such.
* ``width-guideline``: Wang et al.'s guideline (arXiv 1908.04705, its tuning guidelines): one instance per socket,
  inter-op pools = the graph's average width (rounded, at least 1, at most the socket's physical
  cores), intra-op threads per pool = the socket's physical cores / pools.
"""

from __future__ import annotations

from batchcraft.parallel.analysis import GraphAnalysis
from batchcraft.parallel.config import ParallelConfig, physical_cores, sockets

__all__ = ["BASELINES", "baseline_configs", "width_guideline"]

BASELINES = ("pytorch-default", "intel-recommended", "tensorflow-recommended", "width-guideline")

_INTEL_ENV = {
    "KMP_AFFINITY": "granularity=fine,compact,1,0",
    "KMP_BLOCKTIME": "1",
    "OMP_PROC_BIND": "close",
    "OMP_PLACES": "cores",
}


def width_guideline(analysis: GraphAnalysis | None, batch_size: int, cpus: list[int]) -> ParallelConfig:
    """Wang et al.'s width-based configuration for ``cpus`` (see the module docstring)."""
    n_sockets = sockets(cpus)
    per_socket = max(1, physical_cores(cpus) // n_sockets)
    width = analysis.average_width if analysis is not None and analysis.depth else 1.0
    pools = min(max(1, round(width)), per_socket)
    return ParallelConfig(instances=n_sockets, inter_op_threads=pools,
                          intra_op_threads=max(1, per_socket // pools), batch_size=batch_size,
                          label="width-guideline")


def baseline_configs(analysis: GraphAnalysis | None, batch_size: int, cpus: list[int],
                     *, traceable: bool = True) -> list[ParallelConfig]:
    """The four baselines at ``batch_size`` for ``cpus``, in :data:`BASELINES` order.

    Args:
        analysis (GraphAnalysis | None): the model's graph (None: width 1).
        batch_size (int): items per call.
        cpus (list[int]): usable CPUs.
        traceable (bool): False if the model cannot run in the inter-op executor; then every
            baseline uses one pool (the configuration a user of that model could actually run).
    """
    phys, logical, n_sockets = physical_cores(cpus), len(cpus), sockets(cpus)
    configs = [
        ParallelConfig(instances=1, inter_op_threads=1, intra_op_threads=None, batch_size=batch_size,
                       pin=False, label="pytorch-default"),
        ParallelConfig(instances=1, inter_op_threads=n_sockets if traceable else 1, intra_op_threads=phys,
                       batch_size=batch_size, env=dict(_INTEL_ENV), label="intel-recommended"),
        ParallelConfig(instances=1, inter_op_threads=logical if traceable else 1, intra_op_threads=logical,
                       batch_size=batch_size, pin=False, label="tensorflow-recommended"),
        width_guideline(analysis if traceable else None, batch_size, cpus),
    ]
    return configs
