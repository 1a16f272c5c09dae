"""The search space: thread and instance grid, model-level backend variants, baselines.

Wang et al. (arXiv 1908.04705) search instances x inter-op pools x intra-op threads x batch
size. Here the grid holds every pinned configuration with instances x pools x intra-op threads
<= usable cores (instances and threads powers of two and the core count; pools up to the graph's
width), each in every model-level backend variant worth trying
(:func:`batchcraft.parallel.backends.relevant_knobs`); the baselines
(:mod:`batchcraft.parallel.baselines`) run PyTorch's default backends, as the recommendations
they stand for do. Grid points equal to a baseline are left out (the baseline is measured anyway).
"""

from __future__ import annotations

from batchcraft.parallel.analysis import GraphAnalysis
from batchcraft.parallel.baselines import baseline_configs
from batchcraft.parallel.config import ParallelConfig
from batchcraft.parallel.objective import Objective

__all__ = ["candidate_grid", "candidates", "MIN_PARALLEL_FLOPS_FRACTION"]

MIN_PARALLEL_FLOPS_FRACTION = 0.1  # below this share of overlappable FLOPs, pools cannot pay (Amdahl)
DEFAULT_VARIANTS = (("default", "default"),)


def _powers_of_two_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    if n not in out:
        out.append(n)
    return out


def candidate_grid(analysis: GraphAnalysis | None, batch_size: int, cpus: list[int],
                   *, traceable: bool = True, prune: bool = True,
                   variants=DEFAULT_VARIANTS) -> list[ParallelConfig]:
    """Configurations with instances x pools x intra-op threads <= len(cpus), pinned.

    Instances and intra-op threads are powers of two (and the core count); pools go up to the
    graph's maximum width (1 if the model is not traceable or has no parallel branches). With
    ``prune``, pools stay 1 also when less than MIN_PARALLEL_FLOPS_FRACTION of the heavy FLOPs can
    overlap (:attr:`GraphAnalysis.parallel_flops_fraction`; unknown FLOPs do not prune).
    ``variants`` are the (matmul, conv) backend pairs each grid point is tried in, default first.
    """
    n = len(cpus)
    max_pools = 1
    if traceable and analysis is not None:
        max_pools = max(1, min(analysis.max_width, n))
        fraction = analysis.parallel_flops_fraction
        if prune and fraction is not None and fraction < MIN_PARALLEL_FLOPS_FRACTION:
            max_pools = 1
    grid = []
    for instances in _powers_of_two_upto(n):
        for pools in _powers_of_two_upto(max_pools):
            for intra in _powers_of_two_upto(n):
                if instances * pools * intra <= n:
                    for matmul, conv in variants:
                        grid.append(ParallelConfig(instances, pools, intra, batch_size, label="grid",
                                                   matmul=matmul, conv=conv))
    return grid


def candidates(analysis, traceable: bool, batch_size: int, cpus: list[int], objective: Objective | None = None,
               *, prune: bool = True, variants=DEFAULT_VARIANTS) -> tuple[list[ParallelConfig], list[ParallelConfig]]:
    """(search candidates, most promising first; baselines). Grid points equal to a baseline go.

    The order is the objective's prior (:meth:`Objective.prior`), a grid point's default-backend
    variant before its others.
    """
    objective = objective or Objective()
    baselines = baseline_configs(analysis, batch_size, cpus, traceable=traceable)
    grid = candidate_grid(analysis, batch_size, cpus, traceable=traceable, prune=prune, variants=variants)
    base_keys = {(b.key(), b.variant()) for b in baselines}
    search = [c for c in grid if (c.key(), c.variant()) not in base_keys]
    search.sort(key=lambda c: -objective.prior(c, analysis if traceable else None))  # stable: variants stay in order
    return search, baselines
