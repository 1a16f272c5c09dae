"""Workspace division (WD): one network budget split among layer-passes by integer programming.

Each layer-pass gets its own workspace (the sum over layer-passes must fit the budget). For every
layer-pass we build the Pareto front of (workspace, time) over its divisions: the WR programme run
under each distinct measured workspace value as the limit, dominated points dropped. Choosing one
point per layer-pass to minimise total time under the total workspace is a multiple-choice
knapsack, solved exactly as a 0-1 ILP with ``scipy.optimize.milp`` (HiGHS):

minimise sum_lk t_lk x_lk  s.t.  sum_k x_lk = 1 for every l,  sum_lk w_lk x_lk <= M,  x binary.

Source: μ-cuDNN (Oyama et al., arXiv 1804.04806) §III-C, "WD" policy.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

import numpy as np

from batchcraft.microbatching.optimize_wr import optimize_wr
from batchcraft.microbatching.types import Config, PassChoice

__all__ = ["pareto_front", "optimize_wd"]


def pareto_front(table: Mapping[int, Sequence[Config]], batch_size: int,
                 limit_bytes: float = float("inf")) -> list[PassChoice]:
    """Non-dominated divisions of one layer-pass, by increasing workspace (decreasing time)."""
    limits = sorted({c.workspace_bytes for cs in table.values() for c in cs if c.workspace_bytes <= limit_bytes})
    front: list[PassChoice] = []
    for m in limits:
        choice = optimize_wr(table, batch_size, m)
        if choice is None:
            continue
        if not front or choice.time_ms < front[-1].time_ms:
            # a larger limit can only help; keep it only if it is strictly faster
            if front and choice.workspace_bytes <= front[-1].workspace_bytes:
                front[-1] = choice
            else:
                front.append(choice)
    return front


def optimize_wd(fronts: Mapping[Hashable, Sequence[PassChoice]], budget_bytes: float) -> dict[Hashable, PassChoice] | None:
    """One division per layer-pass minimising total time with total workspace <= budget.

    Args:
        fronts (dict[key, list[PassChoice]]): Pareto front of each layer-pass (non-empty).
        budget_bytes (float): network workspace budget M.
    Returns:
        dict[key, PassChoice] | None: the optimum, or None if even the smallest workspaces
        together exceed the budget.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    keys = list(fronts)
    if not keys:
        return {}
    if sum(min(c.workspace_bytes for c in fronts[k]) for k in keys) > budget_bytes:
        return None
    times, spaces, owner = [], [], []
    for i, k in enumerate(keys):
        for c in fronts[k]:
            times.append(c.time_ms)
            spaces.append(float(c.workspace_bytes))
            owner.append(i)
    n = len(times)
    one_each = np.zeros((len(keys), n))
    one_each[owner, np.arange(n)] = 1.0
    # scale bytes to MiB so HiGHS sees well-conditioned coefficients
    scale = 2.0 ** 20
    constraints = [LinearConstraint(one_each, 1.0, 1.0),
                   LinearConstraint(np.array(spaces)[None, :] / scale, -np.inf, budget_bytes / scale)]
    res = milp(np.array(times), constraints=constraints, integrality=np.ones(n), bounds=Bounds(0, 1))
    if res.x is None:
        return None
    x = np.round(res.x).astype(int)
    if float(np.dot(x, spaces)) > budget_bytes:  # solver tolerance: never accept an over-budget answer
        over = float(np.dot(x, spaces)) - budget_bytes
        return optimize_wd(fronts, budget_bytes - over - 1) if budget_bytes - over - 1 >= 0 else None
    chosen: dict[Hashable, PassChoice] = {}
    j = 0
    for i, k in enumerate(keys):
        for c in fronts[k]:
            if x[j]:
                chosen[k] = c
            j += 1
    return chosen
