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

    owned: bool  # this agent still acts as its node (else a standby took it over: it wrote nothing)
    giveup: bool  # the job gave up (a reason is in the store)
    current: int  # the job's generation
    beats: dict[int, Heartbeat]  # the local ranks' heartbeats
    silent_nodes: tuple[tuple[int, int], ...]  # (node, its generation): agents silent past node_timeout


class StoreLook:
    """Node ``node``'s agent's look at the store, pass after pass. Not thread-safe.

    Other agents' liveness is a beat count each raises per pass; a count that has not moved for
    ``node_timeout_s`` on this agent's own clock makes that node silent (clocks of different
    machines are never compared). A pass costs the store two requests for any number of nodes and
    ranks: one read (:meth:`JobStore.agent_pass_read`: the generation, the job's give-up, the node's
    owner, every other agent's beat) and, while this agent still owns its node, one write
    (:meth:`JobStore.agent_pass_write`: its own beat and its ranks' changed heartbeats). Until every
    agent has beaten once, a pass reads key by key instead.
    """

    def __init__(
        self,
        store: JobStore,
        *,
        node: int,
        nnodes: int,
        node_timeout_s: float,
        agent_id: str,
        board: BeatBoard | None = None,
        slots: Mapping[int, int] | None = None,
    ) -> None:
        """``agent_id``: this agent, as :meth:`JobStore.set_node_owner` names it. ``board``: the
        node's heartbeat board, ``slots`` its slot per local rank (None: the local ranks beat to the
        store, and the look reads them there)."""
        assert (board is None) == (slots is None)
        self.store = store
        self.node = node
        self.nnodes = nnodes
        self.node_timeout_s = node_timeout_s
        self.agent_id = agent_id
        self.board = board
        self.slots = slots
        self._others = [n for n in range(nnodes) if n != node]
        self._ready = False  # every key a pass reads exists: one multi_get reads them all
        self._node_beats: dict[int, tuple[int, float]] = {}  # node -> (beat count, monotonic time seen)
        self._published: dict[int, Heartbeat] = {}  # rank -> the beat the store holds for it
        # The node's beat count goes on from where an earlier agent of the node left it: a standby's
        # claim names the count the node fell silent at, which must not come back.
        earlier = store.agent_heartbeat(node)
        self._count = earlier[1] if earlier is not None else 0

    def look(self, gen: int, local_ranks: Sequence[int]) -> Look:
        """Read the job's state and the other agents' beats, then, while this agent owns its node,
        beat its heartbeat (in ``gen``) and publish ``local_ranks``' changed heartbeats.

        With a board, the local ranks' beats are read from it (those that changed since the last
        pass go to the store with the agent's beat, for readers on other nodes); without, from the
        store."""
        store = self.store
        if not self._ready:
            self._ready = store.agent_pass_ready(self.node, self._others)
        if self._ready:
            reading = store.agent_pass_read(self.node, self._others)
            current, giveup, owner, agents = reading.current, reading.giveup, reading.owner, reading.agents
        else:  # some agent has not beaten yet (the job's first seconds): key by key
            current, giveup = store.generation(), store.giveup_reason() is not None
            owner, agents = store.node_owner(self.node), store.agent_heartbeats(self._others)
        owned = owner == self.agent_id
        beats: dict[int, Heartbeat] = {}
        if owned:
            if self.board is None:
                beats = store.rank_heartbeats(list(local_ranks))
                changed: dict[int, Heartbeat] = {}
            else:
                beats, changed = self._board_beats(local_ranks)
            self.beat(gen, changed)
        now = time.monotonic()
        silent = []
        for node, (node_gen, count) in agents.items():
            seen = self._node_beats.get(node)
            if seen is None or seen[0] != count:  # it beat since the last look: timed on our clock
                self._node_beats[node] = (count, now)
            elif now - seen[1] > self.node_timeout_s:
                silent.append((node, node_gen))
        return Look(owned, giveup, current, beats, tuple(silent))

    def beat(self, gen: int, changed: Mapping[int, Heartbeat] | None = None) -> None:
        """This agent's beat in ``gen`` (raising the node's beat count) and ``changed`` rank heartbeats,
        in one request."""
        self._count += 1
        self.store.agent_pass_write(self.node, gen, self._count, changed or {})
        if changed:
            self._published.update(changed)

    def published(self, rank: int, beat: Heartbeat) -> None:
        """``beat`` was written to the store for ``rank`` by someone else (the agent starting it)."""
        self._published[rank] = Heartbeat.parse(beat.encode().encode())  # as the board returns it

    def _board_beats(self, local_ranks: Sequence[int]) -> tuple[dict[int, Heartbeat], dict[int, Heartbeat]]:
        """The local ranks' beats on the board, and those of them the store does not hold yet."""
        assert self.board is not None and self.slots is not None
        beats = {}
        for rank in local_ranks:
            beat = self.board.read(self.slots[rank])
            if beat is None:  # its slot was never written: the beat the agent published starting it
                beat = self._published.get(rank)
                assert beat is not None, f"rank {rank} has no beat (the agent writes one as it starts a rank)"
            beats[rank] = beat
        return beats, {r: b for r, b in beats.items() if self._published.get(r) != b}
