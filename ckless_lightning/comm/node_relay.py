"""A recovery's leave and join through the node agent: the job store sees a node, not each rank (#31).

A rank leaving a generation and joining the next used to make its own store requests: a read of the
job's generation (and a move of it, if first), its membership, its count into the join barrier, a
wait for the barrier to open, a read of the count, and then a wait of its next generation's watch.
At eight ranks a node that was ~60 requests per node and recovery, all on the one store of the job.
Through the relay, the ranks of a node talk to their agent through the node's heartbeat board
(:mod:`ckless_lightning.comm.beat_board`: shared memory and doorbells, no store request) and the
agent talks to the store once for them all:

- a rank leaving ``g`` asks its agent (:meth:`NodeLink.leave`: its slot's request record, and a ring
  of the agent's doorbell) unless its agent already told it the job moved; the agent moves the job
  from ``g`` (:meth:`~ckless_lightning.comm.JobStore.advance_generation`: one ``compare_set`` for the
  node, whoever is first) and tells its ranks the generation the job is in;
- a rank asks to join generation ``g`` (:meth:`NodeLink.request_join`);
- the agent's :class:`JoinRelay` gathers its ranks' requests (until every slot asked, or
  :data:`_GATHER_S`) and counts them in with one ``multi_set`` of their membership and one ``add``
  (:meth:`~ckless_lightning.comm.JobStore.join_ranks`; the last node to count opens the barrier);
- one thread of the agent waits for the barrier to open (one pending request per node), reads the
  count once (and, if the barrier is not full, the job's generation), and writes what it saw into the
  node record (:class:`NodeView`): ``g`` opened, full or not; then rings every slot;
- the agent's :class:`~ckless_lightning.agent.move_watch.MoveWatch` (one pending request per node)
  writes each generation move into the node record too (:meth:`JoinRelay.moved`), which is what the
  ranks' generation watches wait on (:meth:`NodeLink.wait_moved`) instead of a key each in the store.

A rank still bounds its waits and goes to the store itself where the node record cannot tell it
enough: a leave its agent has not answered within :data:`LEAVE_WAIT_S` (the rank moves the job
itself: a ``compare_set``, so never twice); in the join barrier, every ``_BARRIER_LOOK_S`` and when
a barrier opened without filling (a give-up, a finished rank:
:class:`~ckless_lightning.recovery.session.GenerationSession`). Its agent's death kills it
(``PR_SET_PDEATHSIG``); a stopped agent stops its node's heartbeats too, so the job treats the node
as lost after ``agent.node_timeout`` and moves on without it, which such a rank finds at its next
look. A rank that died is never counted on its behalf: the agent marks its slot lost
(:meth:`JoinRelay.slot_lost`) before it decides on a new generation, under the lock its counting holds,
and a slot counts again only once the agent started a process in it (:meth:`JoinRelay.slot_started`).

Elastic jobs (``elastic.enabled``) and ranks without a board (``agent.local_beats=false``) join
through the store, as before.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckless_lightning.comm.beat_board import BeatBoard
from ckless_lightning.comm.store import JobStore

__all__ = ["JoinRelay", "NodeLink", "NodeView"]

# After a first join request, how long the relay waits for the node's other ranks' own: at most this
# long, as the barrier cannot fill without them anyway (a node's ranks notice a fault within
# milliseconds of each other; in bench/control_plane.py's one process, within up to ~1.5 s at 1,024)
_GATHER_S = 2.0
LEAVE_WAIT_S = 2.0  # a rank's wait for its agent to answer a leave; then it reads the store itself
_IDLE_S = 1.0  # the relay thread's wait for a ring, between looks at its stop flag
_RECHECK_S = 600.0  # the barrier thread's wait; the barrier opens on every end of it (see session.py)
_STOP_S = 2.0  # stop(): how long the agent waits for each thread to end


@dataclass(frozen=True)
class NodeView:
    """What the node's agent last knew of the job (its node record).

    ``moved``: the latest generation the job was seen in (-1: none yet); ``barrier``: the latest
    generation whose join barrier was seen open (-1: none); ``full``: whether every rank had joined
    that barrier when it opened (else it opened as the job left it, gave up or finished)."""

    moved: int = -1
    barrier: int = -1
    full: bool = False

    def encode(self) -> str:
        return f"{self.moved} {self.barrier} {int(self.full)}"

    @classmethod
    def parse(cls, raw: str | None) -> NodeView:
        if raw is None:
            return cls()
        moved, barrier, full = raw.split()
        return cls(int(moved), int(barrier), full == "1")


class NodeLink:
    """A rank's end of the relay: its slot of the node's board (``board`` as the rank opened it).

    The rank's main thread calls :meth:`request_join` and :meth:`wait`; its generation watch calls
    :meth:`wait_moved` and, to end that wait, :meth:`release_watch` (a
    :class:`~ckless_lightning.recovery.watch.GenerationWatch`'s ``moves``). One waiter at a time: a
    generation's watch is stopped before the rank joins the next generation.
    """

    def __init__(self, board: BeatBoard, *, slot: int) -> None:
        self.board = board
        self.slot = slot
        self._released = -1  # the generation whose watch was released (release_watch)

    def view(self) -> NodeView:
        return NodeView.parse(self.board.read_node())

    def request_join(self, gen: int) -> None:
        """Ask the agent to count this rank into generation ``gen``'s join barrier."""
        self.board.write_request(self.slot, "join", gen)
        self.board.ring_agent()

    def leave(self, gen: int, *, timeout_s: float = LEAVE_WAIT_S) -> int | None:
        """This rank leaves ``gen``: the generation the job is in now, moved on from ``gen`` by the
        agent unless someone did already (no store request of the rank's); None if the agent did not
        answer within ``timeout_s`` (the rank then goes to the store itself)."""
        if (moved := self.view().moved) > gen:
            return moved
        self.board.write_request(self.slot, "leave", gen)
        self.board.ring_agent()
        deadline = time.monotonic() + timeout_s
        while (moved := self.view().moved) <= gen:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.wait(left)
        return moved

    def wait(self, timeout_s: float) -> bool:
        """Block until the agent rings this slot (the node record changed), at most ``timeout_s``."""
        return self.board.wait_slot(self.slot, timeout_s)

    def wait_moved(self, gen: int, rank: int, *, timeout_s: float) -> bool:
        """Block until the job left ``gen`` (the node record's ``moved``) or the watch of ``gen`` was
        released; False after ``timeout_s``. No store request."""
        deadline = time.monotonic() + timeout_s
        while self.view().moved <= gen and self._released != gen:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.wait(left)
        return True

    def release_watch(self, gen: int, rank: int) -> None:
        """End :meth:`wait_moved` on ``gen`` (the rank leaves or ends that generation)."""
        self._released = gen
        self.board.ring(self.slot)


class JoinRelay:
    """A node agent's end of the relay: counts its ranks into join barriers and tells them what it sees.

    ``ranks``: the job rank in each slot; ``store``: a client of the agent's for the counting (its
    requests are the relay thread's only); ``waiter``: a client of its own the barrier thread blocks
    in; ``generation``: the job's generation as the agent starts; ``announce``: called with the new
    generation when this relay moved the job first, job-wide (the ``generation`` event); ``on_view``:
    called with each node record it writes, from the thread that wrote it (the lock held: it must
    not call back into the relay). ``start`` once; ``stop`` as the agent leaves. :meth:`moved`,
    :meth:`slot_lost` and :meth:`slot_started` come from the agent's threads.
    """

    def __init__(
        self,
        board: BeatBoard,
        *,
        ranks: list[int],
        world_size: int,
        store: JobStore,
        waiter: JobStore,
        generation: int,
        announce: Callable[[int], None] | None = None,
        on_view: Callable[[NodeView], None] | None = None,
    ) -> None:
        assert len(ranks) == board.slots, (ranks, board.slots)
        self.announce = announce
        self.on_view = on_view
        self.board = board
        self.ranks = ranks
        self.world_size = world_size
        self.store = store
        self.waiter = waiter
        self._lock = threading.Lock()  # counting, the slots' state and the node record
        self._view = NodeView(moved=generation)
        self._counted = [-1] * len(ranks)  # per slot: the generation its process was counted into
        self._lost: set[int] = set()  # slots whose process died, until the agent starts another
        self._target = -1  # the latest generation counted into: the barrier thread's
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._waiting = -1  # the generation whose barrier the barrier thread waits on now (-1: none)
        self._threads = [
            threading.Thread(target=self._relay, name="join-relay", daemon=True),
            threading.Thread(target=self._barrier, name="join-relay-barrier", daemon=True),
        ]
        with self._lock:
            self._publish()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """End both threads. A barrier wait still pending is ended by opening that barrier (every
        rank waiting in it then looks for why, as when a move opens it): the agent leaves, so its
        node's ranks end with it and the barrier cannot fill anyway."""
        self._stop.set()
        self.board.ring_agent()
        with self._wake:
            self._wake.notify_all()
            waiting = self._waiting
        if waiting >= 0 and self._threads[1].is_alive():
            self.store.open_barrier(waiting)
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(_STOP_S)

    # -- from the agent's threads ------------------------------------------------------------------
    def moved(self, gen: int) -> None:
        """The job is in generation ``gen`` (the agent's move watch saw it move): tell the ranks."""
        with self._lock:
            self._moved(gen)

    def _moved(self, gen: int) -> None:
        if gen > self._view.moved:
            self._view = NodeView(gen, self._view.barrier, self._view.full)
            self._publish()

    def slot_lost(self, slot: int) -> None:
        """``slot``'s process died: count nothing for it until :meth:`slot_started` (call it before
        deciding whether the job must leave the generation: a count in flight is done by then)."""
        with self._lock:
            self._lost.add(slot)

    def slot_started(self, slot: int) -> None:
        """The agent starts a process in ``slot`` (before it runs): its requests count from now on."""
        with self._lock:
            self.board.write_request(slot, "start", -1)
            self._counted[slot] = -1
            self._lost.discard(slot)

    # -- the threads -------------------------------------------------------------------------------
    def _relay(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.board.wait_for_ranks(_IDLE_S) or self._stop.is_set():
                    continue
                self._gather()
                with self._lock:
                    self._serve()
        except RuntimeError as err:  # the store is gone: the agent's store passes find out themselves
            if not self._stop.is_set():
                print(f"join relay: the job store failed ({type(err).__name__}: {err})", file=sys.stderr)

    def _gather(self) -> None:
        """After a first join request: until every slot asked to join the same generation (a lost
        slot too: the barrier waits for its replacement anyway), or :data:`_GATHER_S`; then the node
        is counted in one round. A leave the job has not answered yet is served at once (a leave
        already answered by a move is old news: it does not cut the gathering short)."""
        deadline = time.monotonic() + _GATHER_S
        while True:
            asked = [self.board.read_request(slot) for slot in range(self.board.slots)]
            with self._lock:
                moved = self._view.moved
                counted = list(self._counted)
            uncounted = [gen for slot, (op, gen) in enumerate(asked) if op == "join" and gen > counted[slot]]
            if any(op == "leave" and gen >= moved for op, gen in asked) or not uncounted:
                return
            if all(request == ("join", max(uncounted)) for request in asked):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.board.wait_for_ranks(left)

    def _serve(self) -> None:
        """Answer every slot's request (the lock held): leaves first (one move per generation), then
        count in each slot that asked for a generation it is not counted into."""
        requests = [self.board.read_request(slot) for slot in range(self.board.slots)]
        leaving = {gen for op, gen in requests if op == "leave" and gen >= self._view.moved}
        for gen in sorted(leaving):
            current = self.store.advance_generation(gen, world_size=self.world_size, announce=self.announce)
            self._moved(current)
        by_gen: dict[int, list[int]] = {}
        for slot, (op, gen) in enumerate(requests):
            # (not into a generation the job is known to have left: the rank sees the move in the
            # record and asks again; counting it there could fill that barrier with the dead's counts)
            if op == "join" and slot not in self._lost and self._counted[slot] < gen >= self._view.moved:
                by_gen.setdefault(gen, []).append(slot)
        for gen in sorted(by_gen):
            slots = by_gen[gen]
            ranks = [self.ranks[slot] for slot in slots]
            joined = self.store.join_ranks(gen, ranks, expected=self.world_size)
            for slot in slots:
                self._counted[slot] = gen
            if joined >= self.world_size and gen > self._view.barrier:
                # This node filled it (and opened it): full, with no wait for it or read of its count
                self._view = NodeView(max(self._view.moved, gen), gen, True)
                self._publish()
            if gen > self._target:
                self._target = gen
                self._wake.notify_all()

    def _barrier(self) -> None:
        seen = -1
        try:
            while not self._stop.is_set():
                with self._wake:
                    if not self._wake.wait_for(
                        lambda seen=seen: self._target > seen or self._stop.is_set(), _IDLE_S
                    ):
                        continue  # nothing new to wait for: look at the stop flag again
                    if self._stop.is_set():
                        return
                    gen = self._target
                    if self._view.barrier >= gen:  # seen open already (this node filled it)
                        seen = gen
                        continue
                    self._waiting = gen
                if not self.waiter.wait_barrier(gen, timeout_s=_RECHECK_S):
                    continue  # still closed: wait again (each end of the barrier opens it)
                full = self.waiter.joined(gen) >= self.world_size
                # Not full: opened by a move (set with the move watch's key: tell it here too, or the
                # ranks would look at the store for why), a give-up or a finished rank
                current = self.waiter.generation() if not full else gen
                with self._lock:
                    self._waiting = -1
                    if gen > self._view.barrier:
                        self._view = NodeView(max(self._view.moved, current), gen, full)
                        self._publish()
                seen = gen
        except RuntimeError as err:  # the store is gone: the agent's store passes find out themselves
            if not self._stop.is_set():
                print(f"join relay: the job store failed ({type(err).__name__}: {err})", file=sys.stderr)

    def _publish(self) -> None:
        """Write the node record and ring every slot (the lock held); ``on_view`` before the rings, so
        that what it notes (bench/control_plane.py: when the agent saw a barrier full) comes before
        any rank the record wakes."""
        self.board.write_node(self._view.encode())
        if self.on_view is not None:
            self.on_view(self._view)
        for slot in range(self.board.slots):
            self.board.ring(slot)
