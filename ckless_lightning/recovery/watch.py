"""Frees a rank still inside a generation its job has left.

A rank normally leaves a generation within milliseconds of a fault: its
pending collective fails when a peer dies or cuts its connections. Two cases
where that does not happen: every survivor blocked in a collective that no
departure reaches (seen in about one CI run in two, tier 3, a peer raising
during its optimizer step: the agent then killed one of them as hung, an
innocent rank), and ranks computing a long step that talk to the lost rank
only later in it (HSDP's other replica: at 300M parameters a step is 15 s of
CPU). :class:`GenerationWatch` is a thread per rank and generation that blocks
in the job store until the job leaves this generation (whoever moves it wakes
every rank's watch: one pending request per rank, no polling, so a job of any
size costs the store nothing while all is well) and then, if the rank has not
started leaving ``grace_s`` later (``comm.stuck_grace_s``), cuts its
connections (``on_stuck``): its next or pending collective fails and the
normal recovery path runs. It never acts while the rank is leaving or after it
left. Its live state stays usable: what a survivor offers does not depend on
where it was cut.

A gloo wait the cut does not end (a connection that stopped reading at a message for a
receive buffer an earlier failed operation freed: ``recovery/sever.py``) is ended by a second,
heavier step: blocked on peers ``unstick_after_s`` in a row after the cut, the watch calls
``on_unstick`` (:func:`~ckless_lightning.recovery.sever.unstick`) once, in a thread of its
own, and the wait raises like a peer's failure; the rank then leaves with its state.

A cut reaches connections that exist. A wait in C++ on a connection still being
made does not end with it: gloo forming a group keeps reconnecting to a peer that
left until the group's timeout (``comm.pg_timeout_s``, minutes; seen in a chaos
soak: a rank killed while the others formed generation 0's group left the fourth
blocked there, and the next generation's join barrier waiting for it). So after
the cut the watch keeps an eye on where the main thread is
(:func:`~ckless_lightning.recovery.where.where_is`): blocked on peers for
``exit_after_s`` in a row (``comm.stuck_exit_s``), the rank is past saving in
process and ``on_left_behind`` ends it, for its agent to replace like a dead rank
(its state is covered like a dead rank's: a replica, a buddy's copy, the disk). A
rank computing (a long step) is left to meet its next collective, which fails.

From the move until the rank starts leaving, the watch beats in the store
(:meth:`~ckless_lightning.comm.JobStore.beat_leaving`, every 0.25 s): an elastic join
barrier of the next generation waits for a rank that beats (alive, still finishing
a step) and shrinks the job only without ranks that stopped beating (no process).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ckless_lightning.comm import JobStore
from ckless_lightning.recovery.where import where_is

__all__ = ["GenerationWatch"]

# A wait that long with no news re-reads the generation (a mover killed between moving the job and
# waking the watches is the only way to miss a wake-up) and waits again.
_RECHECK_S = 600.0
_SAMPLE_S = 0.25  # after the cut: how often the watch looks where the main thread is
_UNSTICK_AFTER_S = 0.5  # after the cut, blocked on peers this long in a row: on_unstick
_UNSTICK_JOIN_S = 5.0  # stop() waits this long for on_unstick (a poll of 0.5 s and one send per peer)


class MoveSignal(Protocol):
    """Where a watch learns the job left its generation: the job store (a key per rank) or the
    rank's node relay (:class:`~ckless_lightning.comm.node_relay.NodeLink`)."""

    def wait_moved(self, gen: int, rank: int, *, timeout_s: float) -> bool: ...

    def release_watch(self, gen: int, rank: int) -> None: ...


class GenerationWatch:
    """Watches generation ``generation`` for ``rank``; ``start`` once, ``stop`` when this rank leaves
    the generation or its ``fit`` ends (``stop`` wakes the thread through the store and joins it).

    ``store``: this rank's job store client; ``waiter``: a second client the thread blocks in
    (:meth:`JobStore.another_client`, one per process, reused across generations: one watch at a
    time blocks in it, as a generation's watch is stopped before the next one starts).
    ``on_unstick`` (None: never): called once, in a thread of its own, when the main thread has been
    blocked on peers ``unstick_after_s`` in a row after the cut (only with ``on_left_behind``; a
    second, heavier cut: :func:`~ckless_lightning.recovery.sever.unstick`).
    ``on_left_behind`` (None: never): called from the thread once the main thread has been
    blocked on peers for ``exit_after_s`` in a row after the cut (it ends the process).
    ``on_moved`` (None: nothing): called from the thread with ``waiter`` as soon as the job has
    left the generation, before the grace (the step vote's :meth:`~ckless_lightning.recovery.
    commit.StepCommit.job_left`: a rank waiting in the vote leaves at once, without a cut).
    ``moves`` (None: the store): what the thread waits on for the move, and :meth:`stop` releases:
    the rank's :class:`~ckless_lightning.comm.node_relay.NodeLink` (its node agent tells it the move:
    no pending request of the rank's own in the store).
    """

    def __init__(
        self,
        store: JobStore,
        generation: int,
        rank: int,
        *,
        waiter: JobStore,
        on_stuck: Callable[[], None],
        grace_s: float = 0.25,
        recheck_s: float = _RECHECK_S,
        on_left_behind: Callable[[], None] | None = None,
        exit_after_s: float = 10.0,
        on_unstick: Callable[[], None] | None = None,
        unstick_after_s: float = _UNSTICK_AFTER_S,
        on_moved: Callable[[JobStore], None] | None = None,
        moves: MoveSignal | None = None,
    ) -> None:
        self.store = store
        self.waiter = waiter
        self.moves: MoveSignal = waiter if moves is None else moves
        self._releases: MoveSignal = store if moves is None else moves
        self.generation = generation
        self.rank = rank
        self.on_stuck = on_stuck
        self.grace_s = grace_s
        self.recheck_s = recheck_s
        self.on_left_behind = on_left_behind
        self.exit_after_s = exit_after_s
        self.on_unstick = on_unstick
        self.unstick_after_s = unstick_after_s
        self.unstuck = False  # on_unstick was called
        self._unsticking: threading.Thread | None = None
        self.on_moved = on_moved
        self.moved = False  # the job left the generation (set before on_moved is called)
        self.fired = False
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._woken = False  # its wait in the store returned (or ended on a recheck)
        self._thread = threading.Thread(target=self._run, name=f"generation-watch-{generation}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            if not self._woken:  # its wait still pends in the store: end it (once woken, the key is there)
                self._releases.release_watch(self.generation, self.rank)
            self._thread.join()
        if self._unsticking is not None:  # it resets connections: done before the next generation's form
            self._unsticking.join(_UNSTICK_JOIN_S)

    def _run(self) -> None:
        try:
            while not self.moves.wait_moved(self.generation, self.rank, timeout_s=self.recheck_s):
                if self._stop.is_set() or self.waiter.generation() > self.generation:
                    break
            self._woken = True
        except RuntimeError as err:  # the store is gone: the main thread finds out on its own
            print(f"generation watch {self.generation}: the job store failed ({err})", file=sys.stderr)
            return
        self.moved = not self._stop.is_set()
        if self.on_moved is not None and self.moved:
            try:
                self.on_moved(self.waiter)
            except RuntimeError as err:  # the store is gone: the main thread finds out on its own
                print(f"generation watch {self.generation}: the job store failed ({err})", file=sys.stderr)
        if self._stop.is_set() or self._stopped_within(self.grace_s):
            return
        self.fired = True
        self.on_stuck()
        if self.on_left_behind is not None and self._blocked_on_peers():
            self.on_left_behind()

    def _beat(self) -> None:
        """Until the rank leaves: its process lives (an elastic barrier of the next generation tells a
        rank on its way, seconds late on a loaded host, from one with no process)."""
        try:
            self.waiter.beat_leaving(self.rank)
        except RuntimeError as err:  # the store is gone: the main thread finds out on its own
            print(f"generation watch {self.generation}: the job store failed ({err})", file=sys.stderr)

    def _stopped_within(self, seconds: float) -> bool:
        """Beat every ``_SAMPLE_S`` for ``seconds``, the first after one; True as soon as the rank starts
        leaving (most do within milliseconds of a move: no beat then)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._stop.wait(min(_SAMPLE_S, left)):
                return True
            self._beat()
        return False

    def _sample(self) -> str:
        """Where the main thread is now (:func:`where_is`)."""
        return where_is(sys._current_frames().get(self._main))  # type: ignore[arg-type]

    def _blocked_on_peers(self) -> bool:
        """After the cut, beating: True once the main thread has waited on peers ``exit_after_s`` in a
        row (only with ``on_left_behind``), False as soon as the rank starts leaving (``stop``)."""
        since = time.monotonic()
        while not self._stop.wait(_SAMPLE_S):
            self._beat()
            if self.on_left_behind is None or self._sample() != "peers":
                since = time.monotonic()
            elif time.monotonic() - since >= self.exit_after_s:
                return True
            elif time.monotonic() - since >= self.unstick_after_s and not self.unstuck:
                self._unstick()
        return False

    def _unstick(self) -> None:
        """Once: ``on_unstick`` in a daemon thread (bounded by ``exit_after_s`` whatever it does: the
        watch goes on sampling and ends the rank if the wait outlasts it)."""
        self.unstuck = True
        if self.on_unstick is not None:
            self._unsticking = threading.Thread(
                target=self.on_unstick, name=f"unstick-{self.generation}", daemon=True
            )
            self._unsticking.start()
