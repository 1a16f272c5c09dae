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
    # workspaces are whole bytes: "<= floor(M) + 0.5" is the same set of answers and keeps half a
    # byte of room for the solver's feasibility tolerance
    constraints = [LinearConstraint(one_each, 1.0, 1.0),
                   LinearConstraint(np.array(spaces)[None, :], -np.inf, np.floor(budget_bytes) + 0.5)]
    res = milp(np.array(times), constraints=constraints, integrality=np.ones(n), bounds=Bounds(0, 1),
               options={"mip_rel_gap": 0.0})
    x = None if res.x is None else np.round(res.x).astype(int)
    if x is None or (x.reshape(1, -1) @ one_each.T != 1).any() or float(np.dot(x, spaces)) > budget_bytes:
        # numerical trouble (or no answer): the exact search never returns an over-budget answer
        return _exact(fronts, keys, budget_bytes)
    chosen: dict[Hashable, PassChoice] = {}
    j = 0
    for i, k in enumerate(keys):
        for c in fronts[k]:
            if x[j]:
                chosen[k] = c
            j += 1
    return chosen


def _exact(fronts, keys, budget_bytes):
    """The same optimum by merging Pareto fronts layer by layer (exact; the ILP's fallback)."""
    states = [(0, 0.0, ())]  # (workspace, time, choice indices), non-dominated
    for k in keys:
        merged = sorted(((w + c.workspace_bytes, t + c.time_ms, idx + (j,))
                         for w, t, idx in states for j, c in enumerate(fronts[k])
                         if w + c.workspace_bytes <= budget_bytes), key=lambda s: (s[0], s[1]))
        states = []
        for st in merged:  # by increasing workspace: keep only strictly faster points
            if not states or st[1] < states[-1][1]:
                states.append(st)
        if not states:
            return None
    best = min(states, key=lambda s: s[1])
    return {k: fronts[k][j] for k, j in zip(keys, best[2])}
