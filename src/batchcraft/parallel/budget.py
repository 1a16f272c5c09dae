"""The tuner's wall-clock budget: one :class:`Budget` owns every deadline.

The budget is hard, from the call to the return: analysis, start-up of the instances, every trial
and their shutdown. It is spent in stages, each with its own end:

1. start-up: instances not ready by ``START_SHARE`` of the budget are dropped;
2. the search, batch size after batch size (:meth:`Budget.batch_window`): each batch size gets the
   time of its shortest plan and an equal part of the rest; part of a batch size's time can be
   kept for its playoff; a trial may run on to the window's ``slack``;
3. time set aside for a later stage (:meth:`Budget.set_aside`: the knob race) is not given to the
   search; it is handed back with :meth:`Budget.release`;
4. time held for the last stage (:meth:`Budget.hold`: the tie-break of near-tied backends) ends
   every earlier stage sooner (:attr:`Budget.hard_end` moves back); :meth:`Budget.unhold` gives
   it to the last stage;
5. ``SHUTDOWN_RESERVE_S`` at the end for stopping the instances.

``clock`` is passed in, so tests run the tuner on a fake clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from batchcraft.errors import ConfigurationError

__all__ = ["Budget", "Window", "START_SHARE", "SHUTDOWN_RESERVE_S"]

START_SHARE = 0.6  # instances not ready within this share of the budget are dropped
SHUTDOWN_RESERVE_S = 0.3  # kept back from the budget for stopping the instances
SLACK_SHARE = 0.25  # a batch size's trials may run on past its deadline by this share of its time


@dataclass(frozen=True)
class Window:
    """Clock times for one batch size: plan for ``deadline - reserve``, never start a trial that
    would end after ``slack``; ``deadline`` is also the end of its playoff (``reserve`` seconds)."""

    deadline: float
    slack: float
    reserve: float


class Budget:
    """Deadlines of one tuning run.

    Args:
        budget_s (float): seconds from ``t_start`` to the return (> 0).
        clock (callable): monotonic seconds. Default: ``time.monotonic``.
        t_start (float, optional): when the run started. Default: ``clock()`` now.
    Raises:
        ConfigurationError: budget_s not a number > 0.
    """

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic, t_start: float | None = None):
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0:
            raise ConfigurationError(f"tune: budget_s must be > 0, got {budget_s!r}")
        self.budget_s = float(budget_s)
        self.clock = clock
        self.t_start = clock() if t_start is None else t_start
        self.reserved = 0.0
        self.held = 0.0

    # -- stages -----------------------------------------------------------------------------
    @property
    def hard_end(self) -> float:
        """No trial starts that would end after this (the shutdown reserve comes after it, and
        what :meth:`hold` keeps for the last stage)."""
        return self.t_start + self.budget_s - SHUTDOWN_RESERVE_S - self.held

    @property
    def search_end(self) -> float:
        """End of the search stage: the hard end minus what is set aside for later stages."""
        return self.hard_end - self.reserved

    def elapsed(self) -> float:
        return self.clock() - self.t_start

    def left(self, end: float | None = None) -> float:
        """Seconds from now to ``end`` (default: the search end), at least 0."""
        return max(0.0, (self.search_end if end is None else end) - self.clock())

    def start_timeout(self) -> float:
        """Seconds the instances may still take to start (START_SHARE of the budget)."""
        return max(0.0, self.t_start + START_SHARE * self.budget_s - self.clock())

    def start_limit_s(self) -> float:
        return START_SHARE * self.budget_s

    def set_aside(self, seconds: float) -> None:
        """Keep ``seconds`` from the search for a later stage (at most what is left)."""
        self.reserved = min(max(0.0, seconds) + self.reserved, max(0.0, self.hard_end - self.clock()))

    def release(self) -> None:
        """Give back what :meth:`set_aside` kept (the later stage starts now)."""
        self.reserved = 0.0

    def hold(self, seconds: float) -> None:
        """Keep ``seconds`` (at most what is left) for the last stage: earlier stages end sooner."""
        self.unhold()
        self.held = min(max(0.0, seconds), max(0.0, self.hard_end - self.clock()))

    def unhold(self) -> None:
        """Give what :meth:`hold` kept to the stage that starts now."""
        self.held = 0.0

    def batch_window(self, floors: list[float], playoff_reserve: Callable[[float], float]) -> Window:
        """The window of the next batch size.

        Args:
            floors (list[float]): predicted seconds of the shortest plan of this batch size and
                of every later one, in order.
            playoff_reserve (callable): ``playoff_reserve(share_s) -> seconds`` to keep for this
                batch size's playoff (0: none fits).
        If the shortest plans do not all fit, this batch size gets its own shortest plan (or what
        is left): the smaller batch sizes come first, and a few batch sizes measured properly beat
        every batch size measured with too few trials. Its playoff reserve is kept only when every
        shortest plan fits and this batch size keeps its own.
        """
        now, left = self.clock(), self.left()
        total = sum(floors)
        share = floors[0] + (left - total) / len(floors) if total <= left else min(floors[0], left)
        reserve = playoff_reserve(share)
        if total > left or share - reserve < floors[0]:
            reserve = 0.0
        deadline = now + share
        slack = min(self.search_end, deadline + SLACK_SHARE * max(0.0, share))
        return Window(deadline, slack, reserve)
