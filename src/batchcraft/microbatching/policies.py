"""Workspace policies as objects: how a budget applies, how to optimise under it, how to explain failure.

Each policy answers the same questions, so no other module branches on its name:

* ``network_workspace(workspaces)``: the workspace a set of layer-passes needs under this policy
  (WR: the largest, each layer-pass reuses the budget; WD: the sum, the budget is divided);
* ``admits(workspaces, limit)``: whether that fits (e.g. does PyTorch's default fit the budget);
* ``optimise(tables, batch, limit)``: one division per layer-pass, or None if none fits;
* ``undivided(tables, batch, limit)``: the best plan without division under the same budget;
* ``explain_infeasible(minimum, limit, batch_sizes)``: the :class:`~batchcraft.errors.WorkspaceError`
  naming the layer and the smallest feasible budget;
* ``per_layer_limit``: whether each layer-pass has its own limit (then a layer-pass's choice can
  be confirmed against its alternatives alone, see ``confirm`` in :func:`~batchcraft.microbatch`).

``tables`` maps a layer-pass key (hashable; ``key[0]`` is the layer name, ``key[1]`` the pass)
to ``{micro_batch: [Config, ...]}`` of configurations measured within the budget.

Source: μ-cuDNN (Oyama et al., arXiv 1804.04806) §III-B (WR) and §III-C (WD).
"""

from __future__ import annotations

from typing import Hashable, Iterable, Mapping, Sequence

from batchcraft.errors import ConfigurationError, WorkspaceError
from batchcraft.microbatching.budget import format_bytes
from batchcraft.microbatching.optimize_wd import optimize_wd, pareto_front
from batchcraft.microbatching.optimize_wr import optimize_wr
from batchcraft.microbatching.types import Config

__all__ = ["Policy", "WorkspaceReuse", "WorkspaceDivision", "POLICIES", "get_policy"]

Tables = Mapping[Hashable, Mapping[int, Sequence[Config]]]


class Policy:
    """How a workspace budget applies to a network's layer-passes (subclasses: WR, WD)."""

    name = "abstract"
    summary = ""
    per_layer_limit = False

    def network_workspace(self, workspaces: Iterable[int]) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def admits(self, workspaces: Iterable[int | None], limit: int) -> bool:
        """Whether layer-passes with these workspaces fit ``limit`` (a None, i.e. unknown, never does)."""
        ws = list(workspaces)
        return not any(w is None for w in ws) and self.network_workspace(ws) <= limit

    def optimise(self, tables: Tables, batch: int, limit: int) -> dict | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def undivided(self, tables: Tables, batch: int, limit: int) -> dict:
        """{key: best undivided PassChoice or None} under the same budget and policy."""
        whole = {k: {batch: list(t.get(batch, []))} for k, t in tables.items()}
        return self._undivided(whole, batch, limit)

    def _undivided(self, tables, batch, limit) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def explain_infeasible(self, minimum: Mapping[Hashable, int], limit: int,
                           batch_sizes: str) -> WorkspaceError:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Policy {self.name}: {self.summary}>"


class WorkspaceReuse(Policy):
    """WR: every layer-pass may use the whole budget (one buffer reused); DP per layer-pass."""

    name = "wr"
    summary = "limit per layer-pass (dynamic programming)"
    per_layer_limit = True

    def network_workspace(self, workspaces):
        return max(workspaces, default=0)

    def optimise(self, tables, batch, limit):
        choices = {k: optimize_wr(t, batch, limit) for k, t in tables.items()}
        return None if any(c is None for c in choices.values()) else choices

    def _undivided(self, tables, batch, limit):
        return {k: optimize_wr(t, batch, limit) for k, t in tables.items()}

    def explain_infeasible(self, minimum, limit, batch_sizes):
        key, need = max(minimum.items(), key=lambda kv: kv[1])
        return WorkspaceError(
            f"microbatch: layer {key[0]} ({key[1]}) cannot run within workspace_limit={format_bytes(limit)} "
            f"({limit} bytes, policy 'wr') with any algorithm and micro-batch candidates '{batch_sizes}'; "
            f"the smallest feasible budget for this model is {need} bytes ({format_bytes(need)})",
            hint="raise workspace_limit, or allow more algorithms / batch_sizes='all'")


class WorkspaceDivision(Policy):
    """WD: the sum over layer-passes fits the budget; Pareto fronts and a multiple-choice knapsack (ILP)."""

    name = "wd"
    summary = "one network budget divided among layer-passes (integer programming)"

    def network_workspace(self, workspaces):
        return sum(workspaces)

    def optimise(self, tables, batch, limit):
        fronts = {k: pareto_front(t, batch, limit) for k, t in tables.items()}
        if any(not f for f in fronts.values()):
            return None
        return optimize_wd(fronts, limit)

    def _undivided(self, tables, batch, limit):
        chosen = self.optimise(tables, batch, limit) or {}
        return {k: chosen.get(k) for k in tables}

    def explain_infeasible(self, minimum, limit, batch_sizes):
        need = sum(minimum.values())
        key = max(minimum, key=minimum.get)
        return WorkspaceError(
            f"microbatch: the layers' smallest workspaces add up to {need} bytes ({format_bytes(need)}), over "
            f"workspace_limit={format_bytes(limit)} ({limit} bytes, policy 'wd'); the largest share is layer "
            f"{key[0]} ({key[1]}, {format_bytes(minimum[key])}); the smallest feasible budget is {need} bytes",
            hint="raise workspace_limit or use policy='wr' (limit per layer)")


POLICIES: dict[str, Policy] = {p.name: p for p in (WorkspaceReuse(), WorkspaceDivision())}


def get_policy(name: str | Policy) -> Policy:
    """The registered policy ``name`` (a Policy passes through); ConfigurationError lists the known ones."""
    if isinstance(name, Policy):
        return name
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise ConfigurationError(f"microbatch: policy must be one of {', '.join(map(repr, POLICIES))}, "
                                 f"got {name!r}") from None

