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
- elastic jobs (:mod:`~ckless_lightning.recovery.elastic`): the generation's set of training
  ranks. The barrier counts that set; a rank outside it stands by until a generation takes it
  back (or the job ends); a barrier that waits ``agent.replace_timeout`` for a rank with no
  process shrinks the job, and a standby replica that is whole again grows it.

With a node relay (``link``: the rank's slot of its node agent's board, :mod:`~ckless_lightning.comm.
node_relay`), a rank of a job that is not elastic joins through its agent: the agent writes the
membership and counts its node's ranks in, once for them all, and tells them when the barrier opens.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ckless_lightning.comm import Heartbeat, JobStore
from ckless_lightning.comm.beat_board import HeartbeatWriter
from ckless_lightning.comm.node_relay import NodeLink
from ckless_lightning.recovery.commit import GenerationChanged
from ckless_lightning.recovery.elastic import ElasticPolicy, StandbyEnded

__all__ = ["GenerationSession", "JobFinished", "JobGaveUp", "StandbyEnded"]

_BEAT_S = 1.0  # heartbeat refresh while a standby rank waits
# The join barrier's look (beat, give-up, finished job, elastic shrink) between its waits in the
# store: the store wakes the wait for anything that ends it; a wait that times out is logged by
# c10d (two warning lines), so not every second.
_BARRIER_LOOK_S = 5.0
_REWAKE_S = 0.05  # a barrier found open but not full, with no reason seen yet: look again after
_STANDBY_POLL_S = 0.05  # a standby rank's look at the job's generation and its replica


class _SilentRanks:
    """How long each rank behind a barrier has been silent: no member of the generation, and its
    leaving beats unchanged (timed on this rank's clock, from the barrier's first look)."""

    def __init__(self) -> None:
        self._since: dict[int, tuple[int, float]] = {}  # rank -> (beats, when they last changed)

    def for_at_least(self, beats: dict[int, int], seconds: float) -> set[int]:
        """Record ``beats`` (the ranks behind now); the ones unchanged for ``seconds`` or more."""
        now = time.monotonic()
        for rank in set(self._since) - set(beats):
            del self._since[rank]  # it joined
        for rank, count in beats.items():
            if rank not in self._since or self._since[rank][0] != count:
                self._since[rank] = (count, now)
        return {rank for rank, (_, since) in self._since.items() if now - since >= seconds}


class JobGaveUp(RuntimeError):
    """The agents gave the job up (fault budget spent): stop, do not rejoin."""


class JobFinished(RuntimeError):
    """A peer finished the job (passed its last collective) while this rank waited to join a
    generation: every rank had trained to the end; nothing is left to train (exit cleanly)."""


class GenerationSession:
    """This rank's view of the generations. Not thread-safe; one per rank process.

    ``beats``: where this rank's heartbeats go (its slot of the node agent's board; None: ``store``).
    ``waiter``: a store client of this rank's own that the join barrier blocks in (it holds its
    connection while it waits; None: ``store``). ``link``: this rank's end of its node's relay (None:
    it joins through the store; an elastic job always does).
    ``completed_step`` is the last optimizer step this rank completed (-1 until known); it goes into
    the heartbeats written while waiting, so the agent sees a live rank. ``active`` is the set of job
    ranks training in the generation last joined (all of them unless ``elastic``).
    """

    def __init__(
        self,
        store: JobStore,
        *,
        rank: int,
        world_size: int,
        generation: int,
        join_timeout_s: float = 900.0,
        on_phase: Callable[..., None] | None = None,
        announce: Callable[..., None] | None = None,
        elastic: ElasticPolicy | None = None,
        on_standby: Callable[[int], None] | None = None,
        beats: HeartbeatWriter | None = None,
        waiter: JobStore | None = None,
        link: NodeLink | None = None,
    ) -> None:
        self.store = store
        self.link = link if elastic is None else None
        self.waiter = store if waiter is None else waiter
        self.beats: HeartbeatWriter = store if beats is None else beats  # the node's board, or the store
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.completed_step = -1
        self.join_timeout_s = join_timeout_s
        self._on_phase = on_phase or (lambda phase, gen, **fields: None)
        self._announce = announce
        self.elastic = elastic
        self._on_standby = on_standby or (lambda gen: None)
        self.active: tuple[int, ...] = tuple(range(world_size))
        self._just_read = False  # leave() just read the job's generation: join() need not again

    def beat_recovering(self, gen: int | None = None, phase: str = "recovery") -> None:
        """Tell the agent this rank is recovering (``agent.recovery_timeout`` applies, not hang_timeout)."""
        gen = self.generation if gen is None else gen
        self.beats.set_rank_heartbeat(self.rank, Heartbeat(gen, self.completed_step, time.time(), phase))

    def leave(self) -> int:
        """Leave the current generation (after dropping its process groups); returns the next one.

        Moves the job on from ours unless someone already did (compare_set: one
        new generation per fault, whoever notices first); with a node relay, its agent does.
        """
        # Through the node's agent (no store request of this rank's), unless it does not answer
        current = self.link.leave(self.generation) if self.link is not None else None
        if current is None:
            current = self.store.generation()
        if current == self.generation:
            current = self.store.advance_generation(
                self.generation, world_size=self.world_size, announce=self._announce
            )
        self._on_phase("generation_left", self.generation)
        self.generation = current
        self._just_read = True
        return current

    def join(self) -> int:
        """Block until every rank joined the job's current generation; returns it.

        If the generation moves on while waiting (another fault), joins the new
        one instead. Raises :class:`JobGaveUp` once the agents gave up, or after
        ``join_timeout_s`` in one generation (a rank that never comes: a lost
        node nobody replaces); then it gives the job up itself, naming the
        missing ranks, and the agents exit 75 for the scheduler to requeue.
        An elastic job's rank outside the generation's set stands by instead (:meth:`_stand_by`);
        raises :class:`StandbyEnded` if the job finishes meanwhile.
        """
        while True:
            # Right after leave() the generation it read is the one to join: one read fewer per rank
            # and recovery. Should the job move on meanwhile, the move opens this barrier (below).
            current = self.generation if self._just_read else max(self.generation, self.store.generation())
            self._just_read = False
            self.generation = current
            if self.link is not None:  # the agent writes the membership and counts this rank in
                self.link.request_join(current)
                try:
                    self._wait_relayed(current)
                except GenerationChanged as changed:  # its agent read the new one, or this rank did
                    self.generation, self._just_read = max(current, changed.current), True
                    continue
                self._on_phase("generation_joined", current)
                return current
            self.store.set_member(self.rank, current)
            active = self._active(current)
            if self.rank not in active:
                self._stand_by(current, active)
                continue
            joined = self.store.join(current, len(active))
            try:
                self._wait_for_all(joined, current, active)
            except GenerationChanged:
                continue
            self.active = active
            self._on_phase("generation_joined", current)
            return current

    def _active(self, gen: int) -> tuple[int, ...]:
        if self.elastic is None:
            return tuple(range(self.world_size))
        return self.store.active_ranks(gen, self.world_size)

    def _wait_for_all(self, joined: int, gen: int, active: tuple[int, ...]) -> None:
        """Until ``active`` all joined ``gen``: blocked in the store until the barrier opens. Whatever
        ends a barrier opens it: the last rank to join (:meth:`JobStore.join`), a move from ``gen``
        (:meth:`JobStore.advance_generation`), a give-up, a rank that finished the job. Between waits
        the rank beats and looks for a give-up, a finished job and (elastic) a lost rank: when woken,
        and every :data:`_BARRIER_LOOK_S` (``agent.replace_timeout`` if shorter, elastic). Since each
        of those ends opens the barrier, the first look waits for it: a rank whose barrier fills
        makes three requests in it (count, wait, count), not a poll every few milliseconds (issue #31)."""
        look_s = _BARRIER_LOOK_S
        if self.elastic is not None:
            look_s = min(look_s, self.elastic.replace_timeout_s)
        start = time.monotonic()
        # An elastic barrier looks at once: its silence clock for a lost rank starts there.
        next_look = start if self.elastic is not None else start + look_s
        deadline = start + self.join_timeout_s
        silent = _SilentRanks()
        woke = False
        self.beat_recovering(gen)
        while joined < len(active):
            now = time.monotonic()
            if now >= deadline:
                self._give_up_joining(gen, joined, active)
            if woke or now >= next_look:
                self._look(gen, active, silent)
                next_look = now + look_s
            if woke:  # open, not full, and no reason seen yet (its writer's next request is on its way)
                time.sleep(_REWAKE_S)
            wait_s = max(min(next_look, deadline) - time.monotonic(), 1e-3)
            woke = self.waiter.wait_barrier(gen, timeout_s=wait_s)
            joined = self.store.joined(gen)

    def _wait_relayed(self, gen: int) -> None:
        """Until every rank joined ``gen``, as the node agent saw it (its node record, rung on each
        change: no store request). The agent's record also tells a move; a barrier it saw open but
        not full, and every :data:`_BARRIER_LOOK_S`, this rank looks at the store itself
        (:meth:`_look`), bounded by ``join_timeout_s`` as the store's barrier is."""
        assert self.link is not None
        start = time.monotonic()
        next_look, deadline = start + _BARRIER_LOOK_S, start + self.join_timeout_s
        self.beat_recovering(gen)
        rewake_s = _REWAKE_S
        while True:
            view = self.link.view()
            if view.barrier == gen and view.full:
                return
            if view.moved > gen:
                raise GenerationChanged(gen, view.moved, "joining")
            now = time.monotonic()
            if now >= deadline:
                self._give_up_joining(gen, self.store.joined(gen))
            opened = view.barrier >= gen  # not full: a give-up or a finished rank (or a move on its way)
            if opened or now >= next_look:
                self._look(gen, tuple(range(self.world_size)), _SilentRanks())
                next_look = now + _BARRIER_LOOK_S
            if opened:  # no reason seen yet: its writer's next request is on its way; then less often
                time.sleep(rewake_s)  # (an agent that left opened it: the job moves on in node_timeout)
                rewake_s = min(2 * rewake_s, _BARRIER_LOOK_S)
            else:
                self.link.wait(max(min(next_look, deadline) - time.monotonic(), 1e-3))

    def _look(self, gen: int, active: tuple[int, ...], silent: _SilentRanks) -> None:
        """In ``gen``'s barrier: beat, and raise if the job gave up (:class:`JobGaveUp`), finished
        (:class:`JobFinished`) or left ``gen`` (:class:`GenerationChanged`; elastic: after shrinking
        the job without ranks lost meanwhile)."""
        self.beat_recovering(gen)
        reason = self.store.giveup_reason()
        if reason is not None:
            raise JobGaveUp(reason)
        if self.store.ranks_finished() > 0:  # it left its last collective as a peer passed it
            raise JobFinished(f"rank {self.rank}: the job finished while it joined generation {gen}")
        if self.elastic is not None:
            self._shrink_if_lost(gen, active, silent)
        current = self.store.generation()
        if current != gen:
            raise GenerationChanged(gen, current, "joining")

    # -- elastic -------------------------------------------------------------------------------------
    def _shrink_if_lost(self, gen: int, active: tuple[int, ...], silent: _SilentRanks) -> None:
        """In ``gen``'s barrier: if some ranks of the set have had no process in it for
        ``agent.replace_timeout`` (nothing replaced them), move the job on without their replicas.
        A rank whose process still leaves an older generation beats while it does
        (:meth:`JobStore.beat_leaving`): on its way, seconds late on a loaded host, not lost."""
        assert self.elastic is not None
        behind = [r for r in active if self.store.member(r) < gen]
        missing = silent.for_at_least(self.store.leaving_beats(behind), self.elastic.replace_timeout_s)
        if not missing:
            return
        kept = self.elastic.without(active, missing)
        if kept is None:
            return  # fewer than elastic.min_replicas would be left: wait for the lost ranks
        self._resize(gen, kept, "shrink", missing=sorted(missing))

    def _resize(self, gen: int, ranks: tuple[int, ...], reason: str, **fields: object) -> None:
        """Move the job from ``gen`` to a generation that trains ``ranks`` (unless another resize or a
        fault fixed the next generation first: that one stands, and this rank follows it)."""
        assert self.elastic is not None
        standing = self.store.propose_active(gen + 1, ranks)

        def announce(new: int) -> None:
            if self._announce is not None:
                self._announce(
                    new,
                    reason=reason,
                    active=list(standing),
                    replicas=len(standing) // self.elastic.shard,  # type: ignore[union-attr]
                    **fields,
                )

        self.store.advance_generation(gen, world_size=self.world_size, announce=announce, restart=False)

    def _stand_by(self, gen: int, active: tuple[int, ...]) -> None:
        """Outside ``gen``'s set: wait, beating, until the job leaves ``gen`` (return), finishes
        (:class:`StandbyEnded`) or gives up (:class:`JobGaveUp`); grow the job back once this rank's
        replica stands by whole. A lost device may never come back, so the wait has no length of
        its own; its bound is the training ranks' liveness: if none of their heartbeats changes for
        ``comm.join_timeout_s`` (timed on this rank's clock), the job gives up."""
        assert self.elastic is not None
        self.store.set_standby(self.rank, gen)
        self._on_standby(gen)
        self._on_phase("standby", gen, active=list(active))
        replica = self.elastic.replica_of(self.rank)
        peers = list(self.elastic.replica_ranks(replica))
        next_beat = 0.0
        seen, changed = None, time.monotonic()
        try:
            while self.store.generation() == gen:
                now = time.time()
                if now >= next_beat:
                    self.beat_recovering(gen, phase="standby")
                    reason = self.store.giveup_reason()
                    if reason is not None:
                        raise JobGaveUp(reason)
                    beats = self.store.rank_heartbeats(list(active))
                    if beats != seen:
                        seen, changed = beats, time.monotonic()
                    elif time.monotonic() - changed > self.join_timeout_s:
                        self._give_up_standing_by(gen, active)
                    next_beat = now + _BEAT_S
                if self.store.ranks_finished() > 0:
                    raise StandbyEnded(
                        f"rank {self.rank}: the job finished while it stood by in generation {gen}"
                    )
                if all(g == gen for g in self.store.standby(peers).values()) and self._may_grow(active):
                    self._resize(gen, self.elastic.with_replica(active, replica), "grow", returning=peers)
                    return
                time.sleep(_STANDBY_POLL_S)
        finally:
            self.store.set_standby(self.rank, -1)

    def _give_up_standing_by(self, gen: int, active: tuple[int, ...]) -> None:
        reason = (
            f"generation {gen}: no rank of {', '.join(map(str, active))} beat for comm.join_timeout_s="
            f"{self.join_timeout_s:g} s while rank {self.rank} stood by (the job stalled)"
        )
        self.store.give_up(reason)
        raise JobGaveUp(reason)

    def _may_grow(self, active: tuple[int, ...]) -> bool:
        assert self.elastic is not None
        beats = self.store.rank_heartbeats(list(active))
        completed = max(beat.completed_step for beat in beats.values())
        return self.store.ranks_finished() == 0 and self.elastic.may_grow(completed)

    def _give_up_joining(self, gen: int, joined: int, active: tuple[int, ...] | None = None) -> None:
        active = tuple(range(self.world_size)) if active is None else active
        members = {rank: self.store.member(rank) for rank in active}
        behind = sorted(rank for rank, member in members.items() if member < gen)
        who = (
            f"no process of ranks {', '.join(map(str, behind))} reached it"
            if behind
            else "every rank has a process in it, some never finished starting"
        )
        reason = (
            f"generation {gen}: {joined} of {len(active)} ranks joined within "
            f"comm.join_timeout_s={self.join_timeout_s:g} s ({who})"
        )
        self.store.give_up(reason)
        raise JobGaveUp(reason)
