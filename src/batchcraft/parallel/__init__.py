"""Parallelism tuning (Wang et al., arXiv 1908.04705): analyse, execute, launch, tune.

* :func:`analyze`: heavy operators, FLOPs, heavy-op depth and average width of a model's graph.
* :class:`InterOpExecutor`: run a model's independent branches on several threads.
* :class:`WorkerGroup`, :func:`launch`: pinned instances with threads set before torch loads.
* :func:`tune`: time-budgeted search against the PyTorch / Intel / TensorFlow / width baselines.

Thread counts are affinity-aware (:func:`usable_cpus`); inter-op threads are set at most once per
process (:func:`set_inter_op_threads`), so trials that need other values run in fresh processes.
"""

from batchcraft.parallel.analysis import GraphAnalysis, HeavyOp, analyze
from batchcraft.parallel.baselines import BASELINES, baseline_configs, width_guideline
from batchcraft.parallel.config import ParallelConfig, physical_cores, sockets, usable_cpus
from batchcraft.parallel.executor import InterOpExecutor
from batchcraft.parallel.launcher import TrialResult, WorkerGroup, launch
from batchcraft.parallel.search import OBJECTIVES, TuneResult, head_to_head, sweep, tune
from batchcraft.parallel.threads import apply_env, preserved_thread_state, set_inter_op_threads

__all__ = [
    "analyze", "GraphAnalysis", "HeavyOp",
    "InterOpExecutor",
    "ParallelConfig", "usable_cpus", "physical_cores", "sockets",
    "WorkerGroup", "TrialResult", "launch",
    "tune", "sweep", "head_to_head", "TuneResult", "OBJECTIVES",
    "BASELINES", "baseline_configs", "width_guideline",
    "set_inter_op_threads", "preserved_thread_state", "apply_env",
]
