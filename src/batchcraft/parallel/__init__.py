"""Parallelism tuning (Wang et al., arXiv 1908.04705): analyse, execute, launch, tune.

* :func:`analyze`: heavy operators, FLOPs, heavy-op depth and average width of a model's graph.
* :class:`InterOpExecutor`: run a model's independent branches on several threads.
* :class:`WorkerGroup`, :func:`launch`: pinned instances with threads and knobs set before torch
  loads; every instance in its own process group, stopped as a whole.
* :func:`tune`: time-budgeted search against the PyTorch / Intel / TensorFlow / width baselines,
  for a registry model, a model in any importable file, a model object, or a whole program
  (:func:`tune_program`; the program calls :func:`report`).
* Knobs beyond threads: matmul / convolution backends (:mod:`~batchcraft.parallel.backends`),
  allocator and OpenMP wait policy (:mod:`~batchcraft.parallel.env_knobs`), ``torch.compile``.

Thread counts are affinity-aware (:func:`usable_cpus`); inter-op threads are set at most once per
process (:func:`set_inter_op_threads`), so trials that need other values run in fresh processes.
"""

from batchcraft.parallel.analysis import GraphAnalysis, HeavyOp, analyze
from batchcraft.parallel.baselines import BASELINES, baseline_configs, width_guideline
from batchcraft.parallel.budget import Budget
from batchcraft.parallel.compare import Comparison, head_to_head, sweep
from batchcraft.parallel.config import ParallelConfig, local_rank, physical_cores, rank_cpus, sockets, usable_cpus
from batchcraft.parallel.executor import InterOpExecutor
from batchcraft.parallel.grid import candidate_grid
from batchcraft.parallel.launcher import launch
from batchcraft.parallel.objective import OBJECTIVES, Objective
from batchcraft.parallel.program import tune_program
from batchcraft.parallel.reporting import report
from batchcraft.parallel.search import TuneResult, tune
from batchcraft.parallel.threads import apply_env, prepare, preserved_thread_state, set_inter_op_threads
from batchcraft.parallel.trial import TrialResult
from batchcraft.parallel.workers import WorkerGroup

__all__ = [
    "analyze", "GraphAnalysis", "HeavyOp",
    "InterOpExecutor",
    "ParallelConfig", "usable_cpus", "physical_cores", "sockets", "local_rank", "rank_cpus",
    "WorkerGroup", "TrialResult", "launch",
    "tune", "tune_program", "report", "sweep", "head_to_head", "Comparison", "TuneResult",
    "Objective", "OBJECTIVES", "Budget", "candidate_grid",
    "BASELINES", "baseline_configs", "width_guideline",
    "set_inter_op_threads", "preserved_thread_state", "apply_env", "prepare",
]
