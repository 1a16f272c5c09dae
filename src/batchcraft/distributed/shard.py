"""Sharding instances among ranks by work (tree nodes, tokens), not by count.

Under data parallelism every step waits for the slowest rank, so ranks should get equal *work*,
not equal numbers of instances: a sentence of 40 words costs about ten times one of 4. The
partition is greedy LPT (longest processing time first: heaviest instance to the least-loaded
rank), within 4/3 of the best possible maximum load (Graham 1969, "Bounds on multiprocessing
timing anomalies", SIAM J. Appl. Math. 17(2)). Everything here is deterministic and depends only
on the instances' work, so every rank computes the same plan without communicating.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

WorkFn = Callable[[object], float]


def instance_work(instance) -> float:
    """Default work of an instance: ``len(instance)`` (words of a sentence = nodes of its tree).

    Raises:
        TypeError: the instance has no ``len()``; pass ``work=`` to the sharding functions.
    """
    try:
        return float(len(instance))
    except TypeError:
        raise TypeError(f"instance_work: a {type(instance).__name__} has no len(); pass work=fn "
                        f"(fn(instance) -> work units, e.g. tokens)") from None


def _works(instances: Sequence, work: WorkFn | None) -> list[float]:
    fn = work or instance_work
    out = [float(fn(x)) for x in instances]
    for i, w in enumerate(out):
        if not w >= 0:  # also rejects NaN
            raise ValueError(f"work of instance {i} must be a number >= 0, got {w!r}")
    return out


def shard_by_work(instances: Sequence, world_size: int, work: WorkFn | None = None) -> list[list[int]]:
    """Split instance indices into ``world_size`` shards of nearly equal total work.

    Args:
        instances (sequence): the instances (only their work is read).
        world_size (int): number of ranks, >= 1.
        work (callable | None): ``work(instance) -> float >= 0``. Default: :func:`instance_work`.
    Returns:
        list[list[int]]: ``world_size`` lists of indices into ``instances``, each ascending; every
        index appears exactly once. A shard may be empty when there are fewer instances than ranks.
    Raises:
        ValueError: ``world_size < 1`` or a negative/NaN work.
    Source:
        LPT scheduling (Graham 1969): heaviest first, each to the least-loaded shard; ties go to
        the lowest rank, so the plan is the same on every rank.
    Example:
        >>> shard_by_work(["a" * n for n in (9, 1, 1, 1, 8)], 2)    # works 9, 1, 1, 1, 8
        [[0, 2], [1, 3, 4]]
    """
    return _lpt(_works(instances, work), world_size)


def _lpt(works: list[float], world_size: int) -> list[list[int]]:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"shard_by_work: world_size must be an int >= 1, got {world_size!r}")
    heap = [(0.0, r) for r in range(world_size)]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(works)), key=lambda i: (-works[i], i)):
        load, r = heapq.heappop(heap)
        shards[r].append(i)
        heapq.heappush(heap, (load + works[i], r))
    return [sorted(s) for s in shards]


def batch_by_work(indices: Sequence[int], works: Sequence[float], max_work: float) -> list[list[int]]:
    """Cut ``indices`` (in order) into consecutive batches of at most ``max_work`` work each.

    An instance heavier than ``max_work`` gets a batch of its own (it cannot be split).

    Raises:
        ValueError: ``max_work <= 0``.
    """
    if not max_work > 0:
        raise ValueError(f"batch_by_work: max_work must be > 0, got {max_work!r}")
    batches, cur, load = [], [], 0.0
    for i in indices:
        w = works[i]
        if cur and load + w > max_work:
            batches.append(cur)
            cur, load = [], 0.0
        cur.append(i)
        load += w
    if cur:
        batches.append(cur)
    return batches


@dataclass(frozen=True)
class EpochPlan:
    """Which instances each rank trains on at each step; the same on every rank.

    Attributes:
        batches (list[list[list[int]]]): ``batches[rank][step]`` = indices of that rank's batch.
        works (list[float]): work of each instance.
    Ranks may have different numbers of steps (that is what ``torch.distributed.algorithms.Join``
    is for); a step's global work and union cover the ranks that still have a batch at that step.
    """

    batches: list
    works: list

    @property
    def world_size(self) -> int:
        return len(self.batches)

    @property
    def steps(self) -> int:
        """Steps of the rank with the most batches."""
        return max((len(b) for b in self.batches), default=0)

    def rank_batches(self, rank: int) -> list[list[int]]:
        """Batches (index lists) of ``rank``, in step order."""
        return self.batches[rank]

    def union(self, step: int) -> list[int]:
        """Indices that all ranks together train on at ``step`` (what one process would take)."""
        return sorted(i for b in self.batches if step < len(b) for i in b[step])

    def global_work(self, step: int) -> float:
        """Total work of ``step`` over all ranks: the normaliser of a per-work-unit mean loss."""
        return sum(self.works[i] for i in self.union(step))

    def rank_work(self, rank: int) -> float:
        return sum(self.works[i] for b in self.batches[rank] for i in b)


def plan_epoch(instances: Sequence, world_size: int, max_batch_work: float,
               work: WorkFn | None = None) -> EpochPlan:
    """Shard ``instances`` by work among ranks, then cut each rank's shard into batches.

    Each rank gets about ``1/world_size`` of the total work (:func:`shard_by_work`); its batches
    hold at most ``max_batch_work`` work units each (a token budget, as fairseq's ``--max-tokens``).

    Args:
        instances (sequence): the epoch's instances, in the order batches should follow.
        world_size (int): number of ranks.
        max_batch_work (float): work budget of one rank's batch (e.g. 400 tokens).
        work (callable | None): ``work(instance) -> float``. Default: :func:`instance_work`.
    Returns:
        EpochPlan
    """
    works = _works(instances, work)
    return EpochPlan([batch_by_work(s, works, max_batch_work) for s in _lpt(works, world_size)], works)
