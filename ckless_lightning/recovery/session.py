"""A rank's membership in the job's generations (tiers 3 and 4): leave one, join the next.

Through the job store (:class:`~ckless_lightning.comm.JobStore`):

- membership: the generation this rank's current process belongs to (the
  agent writes it when it starts a process; the rank when it joins one). The
  agent compares it with the job's generation to tell a fault already
  answered by a new generation from a new one.
- the join count of each generation. Joining is a barrier: nobody creates a
  generation's process groups before every rank has left the old ones
  (re-forming gloo groups while a peer still holds the old generation failed
  2 times in 5 when measured; with the barrier, 5 in 5).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ckless_lightning.comm import Heartbeat, JobStore
from ckless_lightning.recovery.commit import GenerationChanged

__all__ = ["GenerationSession", "JobGaveUp"]

_BEAT_S = 1.0  # heartbeat refresh while waiting in the barrier


class JobGaveUp(RuntimeError):
    """The agents gave the job up (fault budget spent): stop, do not rejoin."""


class GenerationSession:
    """This rank's view of the generations. Not thread-safe; one per rank process.

    ``completed_step`` is the last optimizer step this rank completed (-1 until known); it goes into
    the heartbeats written while waiting, so the agent sees a live rank.
    """

    def __init__(
        self,
        store: JobStore,
        *,
        rank: int,
        world_size: int,
        generation: int,
        join_timeout_s: float = 900.0,
        on_phase: Callable[[str, int], None] | None = None,
        announce: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.completed_step = -1
        self.join_timeout_s = join_timeout_s
        self._on_phase = on_phase or (lambda phase, gen: None)
        self._announce = announce

    def beat_recovering(self, gen: int | None = None) -> None:
        """Tell the agent this rank is recovering (``agent.recovery_timeout`` applies, not hang_timeout)."""
        gen = self.generation if gen is None else gen
        self.store.set_rank_heartbeat(self.rank, Heartbeat(gen, self.completed_step, time.time(), "recovery"))

    def leave(self) -> int:
        """Leave the current generation (after dropping its process groups); returns the next one.

        Moves the job on from ours unless someone already did (compare_set: one
        new generation per fault, whoever notices first).
        """
        current = self.store.generation()
        if current == self.generation:
            current = self.store.advance_generation(
                self.generation, world_size=self.world_size, announce=self._announce
            )
        self._on_phase("generation_left", self.generation)
        self.generation = current
        return current

    def join(self) -> int:
        """Block until every rank joined the job's current generation; returns it.

        If the generation moves on while waiting (another fault), joins the new
        one instead. Raises :class:`JobGaveUp` once the agents gave up, or after
        ``join_timeout_s`` in one generation (a rank that never comes: a lost
        node nobody replaces); then it gives the job up itself, naming the
        missing ranks, and the agents exit 75 for the scheduler to requeue.
        """
        while True:
            current = max(self.generation, self.store.generation())
            self.generation = current
            self.store.set_member(self.rank, current)
            joined = self.store.join(current)
            try:
                self._wait_for_all(joined, current)
            except GenerationChanged:
                continue
            self._on_phase("generation_joined", current)
            return current

    def _wait_for_all(self, joined: int, gen: int) -> None:
        pause = 1e-4
        next_beat = 0.0
        deadline = time.monotonic() + self.join_timeout_s
        while joined < self.world_size:
            if time.monotonic() >= deadline:
                self._give_up_joining(gen, joined)
            now = time.time()
            if now >= next_beat:
                self.beat_recovering(gen)
                reason = self.store.giveup_reason()
                if reason is not None:
                    raise JobGaveUp(reason)
                next_beat = now + _BEAT_S
            current = self.store.generation()
            if current != gen:
                raise GenerationChanged(gen, current, "joining")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
            joined = self.store.joined(gen)

    def _give_up_joining(self, gen: int, joined: int) -> None:
        members = {rank: self.store.member(rank) for rank in range(self.world_size)}
        behind = sorted(rank for rank, member in members.items() if member < gen)
        who = (
            f"no process of ranks {', '.join(map(str, behind))} reached it"
            if behind
            else "every rank has a process in it, some never finished starting"
        )
        reason = (
            f"generation {gen}: {joined} of {self.world_size} ranks joined within "
            f"comm.join_timeout_s={self.join_timeout_s:g} s ({who})"
        )
        self.store.give_up(reason)
        raise JobGaveUp(reason)
