"""Workspace reuse (WR): the per-layer dynamic programme of μ-cuDNN.

Every layer-pass may use up to ``limit_bytes`` of workspace; one buffer is reused by its
micro-batches, so the workspace of a division is the *max* over its micro-batches while the
time is the *sum*.

T(0) = 0,  T(b) = min over s in S, s <= b, of [ best(s) + T(b - s) ]

where best(s) is the fastest algorithm at micro-batch s whose workspace fits. This is the paper's
recurrence without its symmetry cut (b' <= b/2), so it is the exact optimum over every multiset
of candidate sizes that sums to the batch.

Source: μ-cuDNN (Oyama et al., arXiv 1804.04806) §III-B, "WR" policy, Eq. (1).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from batchcraft.microbatching.types import Config, PassChoice

__all__ = ["candidate_sizes", "optimize_wr", "best_single", "smallest_feasible"]


def candidate_sizes(batch_size: int, batch_sizes: str) -> list[int]:
    """Micro-batch candidates S: ``undivided`` {B}, ``powerOfTwo`` {1, 2, 4, ... < B} + {B}, ``all`` 1..B."""
    if batch_sizes == "undivided":
        return [batch_size]
    if batch_sizes == "powerOfTwo":
        sizes, s = [], 1
        while s < batch_size:
            sizes.append(s)
            s *= 2
        return sizes + [batch_size]
    if batch_sizes == "all":
        return list(range(1, batch_size + 1))
    raise ValueError(f"batch_sizes must be 'undivided', 'powerOfTwo' or 'all', got {batch_sizes!r}")


def best_single(configs: Sequence[Config], limit_bytes: float) -> Config | None:
    """Fastest config whose workspace fits ``limit_bytes`` (ties: smaller workspace), or None."""
    fit = [c for c in configs if c.workspace_bytes <= limit_bytes]
    return min(fit, key=lambda c: (c.time_ms, c.workspace_bytes)) if fit else None


def optimize_wr(table: Mapping[int, Sequence[Config]], batch_size: int, limit_bytes: float) -> PassChoice | None:
    """Fastest division of ``batch_size`` under a per-layer workspace limit, or None if none fits.

    Args:
        table (dict[int, list[Config]]): measured configs by micro-batch size (the sizes S).
            A size equal to ``batch_size`` means the undivided call.
        batch_size (int): B, the mini-batch to divide.
        limit_bytes (float): workspace limit M of this layer-pass.
    Returns:
        PassChoice | None: steps largest first; None if no division fits the limit.
    """
    best = {s: best_single(cs, limit_bytes) for s, cs in table.items() if 0 < s <= batch_size}
    best = {s: c for s, c in best.items() if c is not None}
    inf = float("inf")
    t = [0.0] + [inf] * batch_size
    pick = [0] * (batch_size + 1)
    for b in range(1, batch_size + 1):
        for s, c in best.items():
            if s <= b and t[b - s] + c.time_ms < t[b]:
                t[b], pick[b] = t[b - s] + c.time_ms, s
    if t[batch_size] == inf:
        return None
    steps, b = [], batch_size
    while b:
        steps.append(best[pick[b]])
        b -= pick[b]
    return PassChoice(tuple(sorted(steps, key=lambda c: -c.micro_batch)))


def smallest_feasible(table: Mapping[int, Sequence[Config]], batch_size: int) -> int | None:
    """Smallest limit under which some division of ``batch_size`` exists (times ignored), or None."""
    flat = {s: [Config(c.algorithm, c.micro_batch, 1.0, c.workspace_bytes) for c in cs] for s, cs in table.items()}
    for m in sorted({c.workspace_bytes for cs in flat.values() for c in cs}):
        if optimize_wr(flat, batch_size, m) is not None:
            return m
    return None
