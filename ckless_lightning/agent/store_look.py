"""What a node agent reads from (and writes to) the job store in one supervision pass.

The node agent's pass and ``bench/control_plane.py``'s simulated agents call the same
:meth:`StoreLook.look`, so the bench measures the store traffic the agent makes, not a model of it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckless_lightning.comm import Heartbeat, JobStore
from ckless_lightning.comm.beat_board import BeatBoard

__all__ = ["Look", "StoreLook"]


@dataclass(frozen=True)
class Look:
    """One pass's reading of the store."""

    giveup: bool  # the job gave up (a reason is in the store)
    current: int  # the job's generation
    beats: dict[int, Heartbeat]  # the local ranks' heartbeats
    silent_nodes: tuple[tuple[int, int], ...]  # (node, its generation): agents silent past node_timeout


class StoreLook:
    """Node ``node``'s agent's look at the store, pass after pass. Not thread-safe.

    Other agents' liveness is a beat counter each bumps per pass; a counter that has not moved for
    ``node_timeout_s`` on this agent's own clock makes that node silent (clocks of different
    machines are never compared). A pass costs the store the same few requests for any number of
    nodes (:meth:`JobStore.agent_heartbeats` reads all of them at once).
    """

    def __init__(
        self,
        store: JobStore,
        *,
        node: int,
        nnodes: int,
        node_timeout_s: float,
        board: BeatBoard | None = None,
        slots: Mapping[int, int] | None = None,
    ) -> None:
        """``board``: the node's heartbeat board, ``slots`` its slot per local rank (None: the local
        ranks beat to the store, and the look reads them there)."""
        assert (board is None) == (slots is None)
        self.store = store
        self.node = node
        self.nnodes = nnodes
        self.node_timeout_s = node_timeout_s
        self.board = board
        self.slots = slots
        self._node_beats: dict[int, tuple[int, float]] = {}  # node -> (beat count, monotonic time seen)
        self._published: dict[int, Heartbeat] = {}  # rank -> the beat the store holds for it

    def look(self, gen: int, local_ranks: Sequence[int]) -> Look:
        """Beat this agent's heartbeat (in ``gen``), then read the job's state, ``local_ranks``'
        heartbeats and the other agents' beats.

        With a board, the local ranks' beats are read from it, and those that changed since the last
        pass are published to the store in one request (for readers on other nodes)."""
        store = self.store
        store.set_agent_heartbeat(self.node, gen)
        giveup = store.giveup_reason() is not None
        current = store.generation()
        if self.board is None:
            beats = store.rank_heartbeats(list(local_ranks))
        else:
            beats = self._board_beats(local_ranks)
        silent = []
        others = [node for node in range(self.nnodes) if node != self.node]
        for node, (node_gen, count) in store.agent_heartbeats(others).items():
            seen = self._node_beats.get(node)
            if seen is None or seen[0] != count:  # it beat since the last look: timed on our clock
                self._node_beats[node] = (count, time.monotonic())
            elif time.monotonic() - seen[1] > self.node_timeout_s:
                silent.append((node, node_gen))
        return Look(giveup, current, beats, tuple(silent))

    def published(self, rank: int, beat: Heartbeat) -> None:
        """``beat`` was written to the store for ``rank`` by someone else (the agent starting it)."""
        self._published[rank] = Heartbeat.parse(beat.encode().encode())  # as the board returns it

    def _board_beats(self, local_ranks: Sequence[int]) -> dict[int, Heartbeat]:
        assert self.board is not None and self.slots is not None
        beats = {}
        for rank in local_ranks:
            beat = self.board.read(self.slots[rank])
            if beat is None:  # its slot was never written: the beat the agent published starting it
                beat = self._published.get(rank)
                assert beat is not None, f"rank {rank} has no beat (the agent writes one as it starts a rank)"
            beats[rank] = beat
        changed = {r: b for r, b in beats.items() if self._published.get(r) != b}
        if changed:
            self.store.set_rank_heartbeats(changed)
            self._published.update(changed)
        return beats
