"""References for the tuner: :func:`sweep` (everything, long trials) and :func:`head_to_head`.

Both measure through worker groups in measurement races (:mod:`batchcraft.measure.race`):
interleaved rounds with a rotating start, median per configuration.

* :func:`sweep` measures every configuration of the unpruned search space (the grid with every
  inter-op pool count up to the graph's width, in every backend variant the model's layer kinds
  allow, and the baselines) at every batch size, then the best one with each process-level knob
  changed (allocator; OpenMP wait policy where a pool has a team of threads: a coordinate step, the
  full product would be hundreds of process configurations). The tuner is checked against it.
* :func:`head_to_head` re-measures a few configurations side by side, optionally in several
  fresh sets of processes (``starts``), and returns their medians and the race, whose paired
  ratios give confidence intervals. One set of processes measures the noise within those
  processes only; one unpinned process can run 40% faster or slower than another of the same
  configuration (docs/benchmarks.md, issue 5), so the benchmark's verdict uses fresh processes
  for every round (``starts=rounds, rounds=1``), each round one unit of the interval.
"""

from __future__ import annotations

import shutil
import tempfile

from batchcraft.errors import ConfigurationError
from batchcraft.measure.race import Race
from batchcraft.parallel.config import ParallelConfig, usable_cpus
from batchcraft.parallel.env_knobs import WAIT_POLICIES, available_allocators
from batchcraft.parallel.grid import candidates
from batchcraft.parallel.groups import Groups
from batchcraft.parallel.halving import SPREAD_LIMIT, CostModel
from batchcraft.parallel.knobs import DEFAULT_KNOBS, team_threads
from batchcraft.parallel.objective import Objective
from batchcraft.parallel.search import prepare_model
from batchcraft.parallel.threads import preserved_thread_state
from batchcraft.parallel.trial import TrialResult
from batchcraft.parallel.workload import model_spec

__all__ = ["sweep", "head_to_head", "Comparison"]


def _spread(race: Race) -> float:
    vals = [race.values(i) for i in range(len(race.variants))]
    return max((max(v) / min(v) for v in vals if v and min(v) > 0), default=1.0)


def _timed_trial(groups, cost: CostModel, cfg: ParallelConfig, duration_s: float, min_calls: int, warmup_s: float):
    def trial() -> TrialResult:
        if CostModel._key(cfg) not in cost.warm:  # warm up and learn the per-call time
            cost.learn(cfg, 0.0, 0.0, groups.measure(cfg, 1e-3, warmup_s))
        length = max(duration_s, cost.floor(cfg, min_calls, 0.0))
        res = groups.measure(cfg, length, warmup_s)
        cost.learn(cfg, length, 0.0, res)
        return res
    return trial


def _process_alternatives(cfg: ParallelConfig, knobs) -> list[ParallelConfig]:
    out = []
    if "allocator" in knobs:
        out += [cfg.replace(allocator=a, label=f"{cfg.label}+{a}") for a in available_allocators() if a != cfg.allocator]
    if "omp_wait_policy" in knobs and team_threads(cfg) > 1:
        out += [cfg.replace(omp_wait_policy=w, label=f"{cfg.label}+wait {w}") for w in WAIT_POLICIES
                if w != cfg.omp_wait_policy]
    return out


def sweep(model, *, batch_sizes=(1, 8, 64), duration_s: float = 3.0, repeats: int = 3,
          min_calls: int = 5, warmup_s: float = 0.3, model_kwargs: dict | None = None,
          image_size: int | None = None, cpus: list[int] | None = None, knobs=DEFAULT_KNOBS,
          example_input=None, input_shape=None) -> list[TrialResult]:
    """Measure every configuration (see the module docstring) at every batch size.

    Per batch size, ``repeats`` interleaved rounds over all configurations (up to twice as many
    while some configuration's repeats are more than SPREAD_LIMIT apart); each trial lasts
    duration_s / repeats seconds and at least ``min_calls`` calls; each configuration keeps its
    median by throughput. Then the best of them races its process-level knob variants the same
    way. Returns one TrialResult per (configuration, batch size); ``config["label"]`` names
    baselines ("grid" for grid points; knob variants of the best: "<label>+<knob value>").
    """
    goal = Objective()
    tmpdir = tempfile.mkdtemp(prefix="batchcraft-sweep-")
    try:
        with preserved_thread_state():
            spec = model_spec(model, example_input=example_input, input_shape=input_shape,
                              model_kwargs=model_kwargs, image_size=image_size, tmpdir=tmpdir)
            cpus, analysis, traceable, variants, _ = prepare_model(spec, list(batch_sizes), goal, cpus, knobs,
                                                                   min_fraction=0.0)
            groups = Groups(spec, cpus)
            cost = CostModel(warmup_s)
            out = []
            try:
                search, base = candidates(analysis, traceable, batch_sizes[0], cpus, prune=False, variants=variants)
                groups.start_all(base + search)
                for b in batch_sizes:
                    search, base = candidates(analysis, traceable, b, cpus, prune=False, variants=variants)
                    configs = base + search
                    meds = _race_medians(groups, cost, configs, duration_s / repeats, repeats, min_calls, warmup_s)
                    alts = _process_alternatives(max(zip(configs, meds), key=lambda cm: cm[1].throughput_items_per_s)[0],
                                                 knobs)
                    if alts:
                        groups.start_all(alts)
                        best = max(zip(configs, meds), key=lambda cm: cm[1].throughput_items_per_s)[0]
                        both = _race_medians(groups, cost, [best, *alts], duration_s / repeats, repeats, min_calls,
                                             warmup_s)
                        meds += both[1:]
                        for a in alts:
                            groups.drop(a)
                    out += meds
            finally:
                groups.close()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return out


def _race_medians(groups, cost, configs, length, repeats, min_calls, warmup_s) -> list[TrialResult]:
    race = Race([_timed_trial(groups, cost, c, length, min_calls, warmup_s) for c in configs],
                value=lambda r: r.throughput_items_per_s)
    while race.rounds < repeats or (race.rounds < 2 * repeats and _spread(race) > SPREAD_LIMIT):
        race.run_round()  # a disturbed configuration (repeats far apart): more rounds, as in tune
    meds = []
    for i, c in enumerate(configs):
        m = race.median_sample(i)
        m.config["label"] = c.label
        meds.append(m)
    return meds


class Comparison:
    """What :func:`head_to_head` measured: per configuration its median, and the race.

    Iterating (or indexing) gives the medians in the order the configurations were given.
    ``ratio(i, j)`` is the paired speed ratio of configuration i over j with its interval (by
    process start when there were several).
    """

    def __init__(self, configs: list[ParallelConfig], race: Race):
        self.configs, self.race = configs, race
        self.medians = [race.median_sample(i) for i in range(len(configs))]

    def __iter__(self):
        return iter(self.medians)

    def __len__(self) -> int:
        return len(self.medians)

    def __getitem__(self, i):
        return self.medians[i]

    def ratio(self, i: int, j: int, confidence: float = 0.95):
        return self.race.ratio(i, j, confidence=confidence)

    def to_dict(self) -> dict:
        return {"configs": [c.to_dict() for c in self.configs], "medians": [m.to_dict() for m in self.medians],
                "race": self.race.to_dict()}


def head_to_head(model, configs: list[ParallelConfig], *, rounds: int = 7, starts: int = 1, duration_s: float = 1.0,
                 min_calls: int = 5, warmup_s: float = 0.3, model_kwargs: dict | None = None,
                 image_size: int | None = None, cpus: list[int] | None = None, example_input=None,
                 input_shape=None) -> Comparison:
    """Re-measure a few configurations side by side: ``starts`` x ``rounds`` interleaved trials each.

    The best of an exhaustive sweep is the maximum of many noisy estimates, so its measured
    throughput is biased upwards (the winner's curse); comparing another configuration with it
    on the sweep's own numbers overstates the gap. This measures the given configurations again:
    per start, fresh processes for all of them (started together, warmed up), then ``rounds``
    rounds whose starting configuration rotates, each trial ``duration_s`` seconds and at least
    ``min_calls`` calls. Configurations may have different batch sizes.

    Returns:
        Comparison: medians (by throughput) in the order given, and the race (rounds clustered
        by start for the intervals).
    Raises:
        ConfigurationError: no configurations, or ``rounds`` / ``starts`` < 1.
    """
    if not configs:
        raise ConfigurationError("head_to_head: no configurations to compare")
    for name, v in (("rounds", rounds), ("starts", starts)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigurationError(f"head_to_head: {name} must be an int >= 1, got {v!r}")
    tmpdir = tempfile.mkdtemp(prefix="batchcraft-h2h-")
    try:
        with preserved_thread_state():
            cpus = usable_cpus() if cpus is None else list(cpus)
            spec = model_spec(model, example_input=example_input, input_shape=input_shape,
                              model_kwargs=model_kwargs, image_size=image_size, tmpdir=tmpdir)
            state = {"groups": None, "cost": None}

            def variant(c):
                def trial():
                    g, cost = state["groups"], state["cost"]
                    length = max(duration_s, cost.floor(c, min_calls, 0.0))
                    res = g.measure(c, length, warmup_s)
                    cost.learn(c, length, 0.0, res)
                    res.config["label"] = c.label
                    return res
                return trial

            race = Race([variant(c) for c in configs], labels=[c.label for c in configs],
                        value=lambda r: r.throughput_items_per_s)
            for s in range(starts):
                groups = Groups(spec, cpus)
                state.update(groups=groups, cost=CostModel(warmup_s))
                try:
                    groups.start_all(configs)
                    for c in configs:  # warm up and learn each per-call time
                        state["cost"].learn(c, 0.0, 0.0, groups.measure(c, 1e-3, warmup_s))
                    for _ in range(rounds):
                        race.run_round(cluster=s)
                finally:
                    groups.close()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return Comparison(list(configs), race)
