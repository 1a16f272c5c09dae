"""Run a batch of requests as one auto-batched call, so that a failing instance fails only itself.

An ``autobatch`` call is all or nothing: when instance code raises, the call raises
:class:`~batchcraft.errors.InstanceError` (or the instance's own batchcraft error) with
``.instance`` set to the first failing instance and returns no outputs; the instances before it
ran to their end, as eager's loop runs them, and the error carries their results
(``.completed``). A server must still answer the other requests: those before the failing one get
their results, the failing one its error, and the rest run again as one call, until a call
succeeds (an error without ``.completed``, from another batched function, reruns those before it
too). ``k`` failing requests in a batch cost at most ``k + 1`` calls; an error
that names no instance (the batched kernels themselves failed) goes to every request of the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from batchcraft.errors import InstanceError


@dataclass(frozen=True)
class Outcome:
    """One request's answer: ``value`` when ``error`` is None, else the exception to raise."""

    value: Any = None
    error: BaseException | None = None

    def unwrap(self):
        if self.error is not None:
            raise self.error
        return self.value


def _own(value):
    """A copy of an output that holds no storage of the batch (outputs are rows of batched results)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_own(v) for v in value)
    if isinstance(value, dict):
        return {k: _own(v) for k, v in value.items()}
    return value


def _failed_instance(exc: BaseException, n: int) -> int | None:
    i = getattr(exc, "instance", None)
    return i if isinstance(i, int) and 0 <= i < n else None


def run_isolated(batched: Callable[[list], list], instances: Sequence, *, copy: bool = True) -> list[Outcome]:
    """``batched(instances)`` with per-instance errors: one :class:`Outcome` per instance, in order.

    Args:
        batched (callable): ``batched(list) -> list`` of the same length, e.g. an
            :func:`batchcraft.autobatch` function.
        instances (sequence): the batch.
        copy (bool): detach and copy tensor outputs, so that a caller's result does not keep the
            whole batch's result tensors alive. Default: True.
    Returns:
        list[Outcome]: the i-th is instance i's result or error. Runs in inference mode.
    """
    outcomes: list[Outcome | None] = [None] * len(instances)
    todo = list(range(len(instances)))
    while todo:
        try:
            with torch.inference_mode():
                values = batched([instances[i] for i in todo])
        except Exception as exc:  # noqa: BLE001 - every error goes back to some request
            j = _failed_instance(exc, len(todo))
            if j is None:
                for i in todo:
                    outcomes[i] = Outcome(error=exc)
                return outcomes  # type: ignore[return-value]
            # the instances before it ran to their end, as they would have alone (an autobatch
            # call's error carries their results): they are not run again
            done = getattr(exc, "completed", None)
            if type(done) is not list or len(done) != j:
                done = []
            for i, v in zip(todo, done):
                outcomes[i] = Outcome(_own(v) if copy else v)
            outcomes[todo[j]] = Outcome(error=_renumbered(exc))
            todo = todo[len(done):j] + todo[j + 1:]
            continue
        if len(values) != len(todo):
            err = RuntimeError(f"run_isolated: the batched function returned {len(values)} results "
                               f"for {len(todo)} instances")
            for i in todo:
                outcomes[i] = Outcome(error=err)
            break
        for i, v in zip(todo, values):
            outcomes[i] = Outcome(_own(v) if copy else v)
        break
    return outcomes  # type: ignore[return-value]


def _renumbered(exc: BaseException) -> BaseException:
    """The error a caller sees: what its instance raised, as if it had been served alone.

    ``InstanceError`` wraps the instance's own exception (its ``__cause__``) and names the
    instance's index in the server's batch, which means nothing to the caller.
    """
    if isinstance(exc, InstanceError) and exc.__cause__ is not None:
        return exc.__cause__
    return exc
