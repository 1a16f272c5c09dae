"""benchmarks/parallel.py: sequential side-by-side verdicts (two races of the same configurations
merged into one, process starts kept apart as clusters)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import parallel as parallel_bench  # noqa: E402

from batchcraft.measure.race import Race  # noqa: E402
from batchcraft.parallel import ParallelConfig  # noqa: E402
from batchcraft.parallel.compare import Comparison  # noqa: E402


def _comp(a, b):
    race = Race.from_samples([a, b], labels=["tuned", "sweep best"], clusters=list(range(len(a))))
    cfgs = [ParallelConfig(instances=1, batch_size=8), ParallelConfig(instances=2, batch_size=8)]
    return Comparison(cfgs, race)


def test_merged_races_keep_every_round_and_new_clusters_for_the_new_starts():
    first = _comp([1.0, 1.1, 0.9, 1.0], [1.0, 1.0, 1.0, 1.0])
    second = _comp([1.2, 1.3], [1.0, 1.0])
    merged = parallel_bench._merged(first, second)
    assert merged.race.rounds == 6 and merged.race.clusters == [0, 1, 2, 3, 4, 5]
    iv = merged.ratio(0, 1, confidence=0.9)
    assert iv.units == 6 and iv.low <= 1.0 <= iv.high
    assert [len(c) for c in merged.race.samples] == [6, 6]


def test_more_rounds_resolve_a_verdict_that_eight_leave_undecided():
    # tuned / sweep best about 0.975 with a spread of +-8%: undecided at 8 rounds, ok at 24
    import random

    rng = random.Random(0)

    def rounds(n):
        return [0.975 + rng.uniform(-0.08, 0.08) for _ in range(n)], [1.0] * n

    comp = _comp(*rounds(8))
    row = {"vs_sweep_best": comp.ratio(0, 1, confidence=parallel_bench.CONFIDENCE).to_dict(),
           "vs_best_baseline": {"estimate": 1.0, "low": 1.0, "high": 1.0, "units": 0, "same": True}}
    parallel_bench._verdicts(row)
    assert row["verdict_sweep"] == "undecided"
    for _ in range(2):
        comp = parallel_bench._merged(comp, _comp(*rounds(8)))
    row["vs_sweep_best"] = comp.ratio(0, 1, confidence=parallel_bench.CONFIDENCE).to_dict()
    parallel_bench._verdicts(row)
    assert comp.race.rounds == 24 and row["verdict_sweep"] == "ok"
