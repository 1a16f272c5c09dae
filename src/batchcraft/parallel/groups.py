"""Worker groups by process-level configuration, started together and closed together.

The tuner, the sweep and :func:`~batchcraft.parallel.compare.head_to_head` measure through a
:class:`Groups`: one :class:`~batchcraft.parallel.workers.WorkerGroup` per process-level key
(instances, threads, pinning, environment, allocator, wait policy); configurations that differ
only in batch size or model-level knobs share it. ``measure(cfg, duration_s, warmup_s)`` is the
interface the search engine sees (tests replace it with fake groups on a fake clock).
"""

from __future__ import annotations

import math
import time

from batchcraft.measure.race import Race
from batchcraft.parallel.config import ParallelConfig
from batchcraft.parallel.trial import TrialResult, aggregate
from batchcraft.parallel.workers import WorkerGroup

__all__ = ["Groups", "variant_race_result"]


def variant_race_result(cfgs: list[ParallelConfig], per_instance: list[list[tuple]], duration_s: float
                        ) -> tuple[list[TrialResult], Race]:
    """Per configuration an aggregate result, and the race of per-round throughputs, from the
    blocks (round, variant, calls, seconds) each instance ran (see WorkerGroup.race_variants).

    A round's sample of a variant is the sum over instances of its block's items/s; only rounds
    every instance finished count. Each block's calls count as calls of its mean duration.
    """
    b = cfgs[0].batch_size
    rounds = min((max((blk[0] for blk in blocks), default=-1) + 1 for blocks in per_instance), default=0)
    samples = [[0.0] * rounds for _ in cfgs]
    results = []
    for j, cfg in enumerate(cfgs):
        inst = []
        for blocks in per_instance:
            mine = [blk for blk in blocks if blk[1] == j and blk[0] < rounds]
            for r, _, n, sec in mine:
                samples[j][r] += n * b / sec if sec > 0 else 0.0
            lat = [sec / n for _, _, n, sec in mine for _ in range(n)]
            inst.append((lat, sum(n for *_, n, _ in mine) * b, sum(sec for *_, sec in mine)))
        res = aggregate({**cfg.to_dict(), "batch_size": b}, b, inst, duration_s)
        res.config["label"] = cfg.label
        results.append(res)
    race = Race.from_samples(samples, labels=[f"{c.matmul}/{c.conv}" for c in cfgs])
    return results, race


class Groups:
    """Worker groups of one model on ``cpus``.

    Args:
        spec (ModelSpec): the model.
        cpus (list[int]): CPUs to spread instances over.
    """

    def __init__(self, spec, cpus: list[int]):
        self.spec, self.cpus = spec, cpus
        self._groups: dict[tuple, WorkerGroup] = {}

    def _new(self, cfg: ParallelConfig) -> WorkerGroup:
        # baselines are measured as recommended, oversubscribed or not
        return WorkerGroup(cfg, self.spec, cpus=self.cpus, oversubscribe=cfg.label not in ("grid", "tuned"))

    def start_all(self, configs, timeout_s: float = math.inf) -> list[ParallelConfig]:
        """Spawn every configuration's processes at once (start-up overlaps) and wait for them.

        Returns the configurations whose instances were not ready within ``timeout_s`` (their
        processes are stopped). An instance that fails raises WorkerError.
        """
        deadline = time.monotonic() + timeout_s
        try:
            for cfg in configs:
                if cfg.key() not in self._groups:
                    self._groups[cfg.key()] = self._new(cfg).spawn()
            late = [cfg for cfg in configs if cfg.key() in self._groups
                    and not self._groups[cfg.key()].ready(min(3600.0, max(0.0, deadline - time.monotonic())))]
        except BaseException:
            self.close()
            raise
        for cfg in late:
            g = self._groups.pop(cfg.key(), None)
            if g is not None:
                g.close()
        return late

    def spawn_all(self, configs) -> None:
        """Start the processes of configurations not running yet, without waiting for them."""
        try:
            for cfg in configs:
                if cfg.key() not in self._groups:
                    self._groups[cfg.key()] = self._new(cfg).spawn()
        except BaseException:
            self.close()
            raise

    def is_ready(self, cfg: ParallelConfig) -> bool:
        """True once ``cfg``'s instances have built the model (WorkerError if one failed)."""
        g = self._groups.get(cfg.key())
        return g is not None and g.ready(0.0)

    def measure(self, cfg: ParallelConfig, duration_s: float, warmup_s: float = 0.3) -> TrialResult:
        g = self._groups.get(cfg.key())
        if g is None:
            self._groups[cfg.key()] = g = self._new(cfg).start()
        res = g.measure(cfg.batch_size, duration_s, warmup_s=warmup_s, variant=cfg.variant())
        res.config["label"] = cfg.label
        return res

    def race_variants(self, cfgs: list[ParallelConfig], duration_s: float, warmup_s: float = 0.2,
                      block_s: float = 0.01, *, fresh: bool = False) -> tuple[list[TrialResult], Race]:
        """Race the model-level variants ``cfgs`` (one process configuration, one batch size)
        inside its running instances (:meth:`WorkerGroup.race_variants`); with ``fresh``, inside
        a new set of its processes, started for this race and stopped after it (the running
        ones wait idle meanwhile)."""
        if fresh:
            with self._new(cfgs[0]).start() as g:
                blocks = g.race_variants(cfgs[0].batch_size, [c.variant() for c in cfgs], duration_s,
                                         warmup_s=warmup_s, block_s=block_s)
            return variant_race_result(cfgs, blocks, duration_s)
        g = self._groups.get(cfgs[0].key())
        if g is None:
            self._groups[cfgs[0].key()] = g = self._new(cfgs[0]).start()
        blocks = g.race_variants(cfgs[0].batch_size, [c.variant() for c in cfgs], duration_s, warmup_s=warmup_s,
                                 block_s=block_s)
        return variant_race_result(cfgs, blocks, duration_s)

    def drop(self, cfg: ParallelConfig) -> None:
        """Stop the group of ``cfg`` (e.g. after it failed)."""
        g = self._groups.pop(cfg.key(), None)
        if g is not None:
            g.close()

    def close(self):
        for g in self._groups.values():
            g.close()
        self._groups.clear()
