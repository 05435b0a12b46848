"""A rank's membership in the job's generations (tiers 3 and 4): leave one, join the next.

Keys (job store, see ``ckless_lightning.comm.store``):

- ``member/<rank>``: the generation this rank's current process belongs to
  (the agent writes it when it starts a process; the rank when it joins one).
  The agent compares it with ``gen`` to tell a fault already answered by a
  new generation from a new one.
- ``gen<g>/joined``: how many ranks joined generation ``g``. Joining is a
  barrier: nobody creates ``g``'s process groups before every rank has left
  the old ones (re-forming gloo groups while a peer still holds the old
  generation failed 2 times in 5 when measured; with the barrier, 5 in 5).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ckless_lightning.comm import Heartbeat, JobStore
from ckless_lightning.comm.commit import GenerationChanged

__all__ = ["GenerationSession", "JobGaveUp"]

_BEAT_S = 1.0  # heartbeat refresh while waiting in the barrier


class JobGaveUp(RuntimeError):
    """The agents gave the job up (fault budget spent): stop, do not rejoin."""


class GenerationSession:
    """This rank's view of the generations. Not thread-safe; one per rank process.

    ``last_step`` is the last optimizer step this rank completed; it goes into
    the heartbeats written while waiting, so the agent sees a live rank.
    """

    def __init__(
        self,
        store: JobStore,
        *,
        rank: int,
        world_size: int,
        generation: int,
        on_phase: Callable[[str, int], None] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.last_step = -1
        self._on_phase = on_phase or (lambda phase, gen: None)

    def leave(self) -> int:
        """Leave the current generation (after dropping its process groups); returns the next one.

        Moves the job on from ours unless someone already did (compare_set: one
        new generation per fault, whoever notices first).
        """
        current = self.store.generation()
        if current == self.generation:
            current = self.store.advance_generation(self.generation)
        self._on_phase("generation_left", self.generation)
        self.generation = current
        return current

    def join(self) -> int:
        """Block until every rank joined the job's current generation; returns it.

        If the generation moves on while waiting (another fault), joins the new
        one instead. Raises :class:`JobGaveUp` once the agents gave up.
        """
        while True:
            current = max(self.generation, self.store.generation())
            self.generation = current
            self.store.set_member(self.rank, current)
            key = f"gen{current}/joined"
            joined = self.store.store.add(key, 1)
            try:
                self._wait_for_all(key, joined, current)
            except GenerationChanged:
                continue
            self._on_phase("generation_joined", current)
            return current

    def _wait_for_all(self, key: str, joined: int, gen: int) -> None:
        pause = 1e-4
        next_beat = 0.0
        while joined < self.world_size:
            now = time.time()
            if now >= next_beat:
                self.store.set_rank_heartbeat(self.rank, Heartbeat(gen, self.last_step, now))
                reason = self.store.giveup_reason()
                if reason is not None:
                    raise JobGaveUp(reason)
                next_beat = now + _BEAT_S
            current = self.store.generation()
            if current != gen:
                raise GenerationChanged(gen, current, "joining")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
            joined = self.store.store.add(key, 0)
