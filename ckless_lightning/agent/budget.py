"""The fault budget: at most ``agent.max_restarts`` new generations within ``agent.restart_window_s``.

The store records when each generation began (``JobStore.restart_times``), whoever moved the job
on: an agent, or at tiers 3-4 a rank. Once the budget is spent the job gives up for good: the
reason goes to the store, every agent stops its ranks and exits with ``ExitCode.FAULT_BUDGET``.
"""

from __future__ import annotations

import time

from ckless_lightning.comm import JobStore
from ckless_lightning.record.events import EventLog
from ckless_lightning.runtime.config import AgentConfig

__all__ = ["RestartBudget"]


class RestartBudget:
    """The job's restart budget, read from and spent in the job store.

    The two questions count differently, on purpose. :meth:`advance` is asked *before* this node
    moves the job on, so the restart it is about to add counts: it gives up once ``max_restarts``
    recent restarts exist already. :meth:`spent_by` is asked *after* someone else moved the job to
    ``current``, whose restart is already recorded: it gives up once there are more than ``max_restarts``.
    """

    def __init__(self, store: JobStore, cfg: AgentConfig, events: EventLog, *, world_size: int) -> None:
        self.store = store
        self.cfg = cfg
        self.world_size = world_size  # whose generation watches a new generation wakes
        self.events = events

    def advance(self, gen: int) -> int | None:
        """Move the job past ``gen`` (once, whoever asks first) and return the generation now current;
        None: the budget is spent (the give-up reason is in the store)."""
        recent = self._recent(gen)
        if len(recent) >= self.cfg.max_restarts:
            reason = (
                f"fault budget spent: {len(recent) + 1} faults within {self.cfg.restart_window_s:g} s "
                f"(agent.max_restarts={self.cfg.max_restarts})"
            )
            self.store.give_up(reason)
            return None
        return self.store.advance_generation(
            gen,
            world_size=self.world_size,
            announce=lambda new: self.events.emit("generation", gen=new, reason="fault"),
        )

    def spent_by(self, current: int) -> bool:
        """The job moved to ``current`` (by a rank or another agent): True, with the give-up reason written
        to the store, if that spent the budget."""
        recent = self._recent(current)
        if len(recent) <= self.cfg.max_restarts:
            return False
        self.store.give_up(
            f"fault budget spent: {len(recent)} faults within {self.cfg.restart_window_s:g} s "
            f"(agent.max_restarts={self.cfg.max_restarts})"
        )
        return True

    def _recent(self, up_to_gen: int) -> list[float]:
        """Start times of generations 1..``up_to_gen`` within ``agent.restart_window_s``."""
        window_start = time.time() - self.cfg.restart_window_s
        return [t for t in self.store.restart_times(up_to_gen) if t >= window_start]
