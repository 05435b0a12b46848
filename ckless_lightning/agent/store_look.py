"""What a node agent reads from (and writes to) the job store in a store pass, and what it reads of
its node alone between them.

A node agent looks at its node every ``agent.monitor_interval`` (0.1 s: :meth:`StoreLook.glance`,
its ranks' beats on the node's board, no store request) and makes a store pass every
``agent.store_interval`` (1 s: :meth:`StoreLook.look`, two requests), or at once when the job's
generation moves (:mod:`ckless_lightning.agent.move_watch`) or its node's look finds something to
act on. The node agent and ``bench/control_plane.py``'s simulated agents call the same methods, so
the bench measures the store traffic the agent makes, not a model of it.
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
    """One pass's reading of the store (a :meth:`StoreLook.glance`: the last store pass's, with the
    board's beats)."""

    owned: bool  # this agent still acts as its node (else a standby took it over: it wrote nothing)
    giveup: bool  # the job gave up (a reason is in the store)
    current: int  # the job's generation
    beats: dict[int, Heartbeat]  # the local ranks' heartbeats
    silent_nodes: tuple[tuple[int, int], ...]  # (node, its generation): agents silent past node_timeout


class StoreLook:
    """Node ``node``'s agent's look at the store, pass after pass. Not thread-safe.

    Other agents' liveness is a beat count each raises per pass; a count that has not moved for
    ``node_timeout_s`` on this agent's own clock makes that node silent (clocks of different
    machines are never compared). An agent watches ``watch_nodes`` other nodes, not all: the next
    ones after its own in node order (wrapping), and past any of them it found silent up to as
    many live ones. So every node is watched by the ``watch_nodes`` live agents before it; a
    pass reads O(``watch_nodes``) keys whatever the job's size (reading every agent's beat made the
    store's work grow with the nodes squared); and when a node's watchers are lost with it, the
    agent before them takes their place at its next pass, so that a run of lost nodes one after
    another is found node by node, each within ``node_timeout`` of being watched. Whoever finds a
    node silent moves the job (:mod:`~ckless_lightning.agent.policies`); every other agent learns
    of it from the move.

    A pass costs the store two requests for any number of nodes and ranks: one read
    (:meth:`JobStore.agent_pass_read`: the generation, the job's give-up, the node's owner, the
    watched agents' beats) and, while this agent still owns its node, one write
    (:meth:`JobStore.agent_pass_write`: its own beat and its ranks' changed heartbeats). Until every
    watched agent has beaten once, a pass reads key by key instead. Between store passes,
    :meth:`glance` reads the local ranks' beats off the board alone.
    """

    def __init__(
        self,
        store: JobStore,
        *,
        node: int,
        nnodes: int,
        node_timeout_s: float,
        agent_id: str,
        watch_nodes: int = 2,
        board: BeatBoard | None = None,
        slots: Mapping[int, int] | None = None,
    ) -> None:
        """``agent_id``: this agent, as :meth:`JobStore.set_node_owner` names it. ``watch_nodes``:
        how many other nodes' agents it watches (``agent.watch_nodes``; every other node in a job of
        at most ``watch_nodes + 1``). ``board``: the node's heartbeat board, ``slots`` its slot per
        local rank (None: the local ranks beat to the store, and the look reads them there)."""
        assert (board is None) == (slots is None)
        assert watch_nodes >= 1, watch_nodes
        self.store = store
        self.node = node
        self.nnodes = nnodes
        self.node_timeout_s = node_timeout_s
        self.agent_id = agent_id
        self.board = board
        self.slots = slots
        self.watch_nodes = watch_nodes
        self._ring = [(node + i) % nnodes for i in range(1, nnodes)]  # the other nodes, the next first
        self._ready_for: list[int] | None = None  # watched nodes whose keys all exist: one multi_get
        self._node_beats: dict[int, tuple[int, float]] = {}  # node -> (beat count, monotonic time seen)
        self._published: dict[int, Heartbeat] = {}  # rank -> the beat the store holds for it
        self._last: Look | None = None  # the last store pass's reading
        self._last_at = float("-inf")  # when it began (monotonic)
        self._beat_at = float("-inf")  # when this agent last beat (monotonic)
        # The node's beat count goes on from where an earlier agent of the node left it: a standby's
        # claim names the count the node fell silent at, which must not come back.
        earlier = store.agent_heartbeat(node)
        self._count = abs(earlier[1]) if earlier is not None else 0  # negative: released (:meth:`release`)

    def look(self, gen: int, local_ranks: Sequence[int]) -> Look:
        """Read the job's state and the other agents' beats, then, while this agent owns its node,
        beat its heartbeat (in ``gen``) and publish ``local_ranks``' changed heartbeats.

        With a board, the local ranks' beats are read from it (those that changed since the last
        pass go to the store with the agent's beat, for readers on other nodes); without, from the
        store."""
        store = self.store
        self._last_at = time.monotonic()
        watched = self.watched()
        if self._ready_for != watched and store.agent_pass_ready(self.node, watched):
            self._ready_for = watched
        if self._ready_for == watched:
            reading = store.agent_pass_read(self.node, watched)
            current, giveup, owner, agents = reading.current, reading.giveup, reading.owner, reading.agents
        else:  # a watched agent has not beaten yet (the job's first seconds): key by key
            current, giveup = store.generation(), store.giveup_reason() is not None
            owner, agents = store.node_owner(self.node), store.agent_heartbeats(watched)
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
        # A node no longer watched is forgotten: watched again, its silence is timed from then on
        self._node_beats = {n: seen for n, seen in self._node_beats.items() if n in agents}
        for node, (node_gen, count) in agents.items():
            seen = self._node_beats.get(node)
            if count < 0:  # its agent gave the node up (:meth:`release`): silent already
                silent.append((node, node_gen))
            elif seen is None or seen[0] != count:  # it beat since the last look: timed on our clock
                self._node_beats[node] = (count, now)
            elif now - seen[1] > self.node_timeout_s:
                silent.append((node, node_gen))
        self._last = Look(owned, giveup, current, beats, tuple(silent))
        return self._last

    def watched(self) -> list[int]:
        """The nodes whose agents the next pass reads: in node order from the one after this, up to
        the ``watch_nodes``-th that the last pass did not find silent."""
        silent = {node for node, _ in self._last.silent_nodes} if self._last is not None else set()
        watched: list[int] = []
        live = 0
        for node in self._ring:
            if live == self.watch_nodes:
                break
            watched.append(node)
            live += node not in silent
        return watched

    def since_pass(self) -> float:
        """Seconds since the last :meth:`look` began (infinity before the first)."""
        return time.monotonic() - self._last_at

    def since_beat(self) -> float:
        """Seconds since this agent last beat, in a :meth:`look` or a :meth:`beat` (infinity before)."""
        return time.monotonic() - self._beat_at

    def glance(self, local_ranks: Sequence[int]) -> Look | None:
        """The node's side of a pass, without a store request: ``local_ranks``' beats read off the
        board now, with what the last :meth:`look` read of the job (``owned``, ``giveup``,
        ``current``, ``silent_nodes``). Without a board, the beats the last look read from the store.
        None when only a store pass can answer: before the first :meth:`look`, or without a board
        for a rank the last look did not read."""
        last = self._last
        if last is None:
            return None
        if self.board is None:
            if any(rank not in last.beats for rank in local_ranks):
                return None
            beats = {rank: last.beats[rank] for rank in local_ranks}
        else:
            beats, _ = self._board_beats(local_ranks)
        return Look(last.owned, last.giveup, last.current, beats, last.silent_nodes)

    def beat(self, gen: int, changed: Mapping[int, Heartbeat] | None = None) -> None:
        """This agent's beat in ``gen`` (raising the node's beat count) and ``changed`` rank heartbeats,
        in one request."""
        self._count += 1
        self._beat_at = time.monotonic()
        self.store.agent_pass_write(self.node, gen, self._count, changed or {})
        if changed:
            self._published.update(changed)

    def release(self, gen: int) -> None:
        """This agent gives its node up (it was found cut off from the others: ``agent/peer_reach.py``):
        its last beat, with the count negated, which every other agent and standby reads as a silence
        that has lasted ``node_timeout`` already, so the job moves on and a standby claims the node
        without waiting for it. The agent beats no more."""
        self._count += 1
        self._beat_at = time.monotonic()
        self.store.agent_pass_write(self.node, gen, -self._count, {})

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
