"""Wakes a node agent's supervision loop as soon as the job's generation moves (or it gives up).

The agent's store pass runs once per ``agent.store_interval`` (1 s; :mod:`ckless_lightning.agent.
store_look`), but a generation moved by another node's agent or by a rank must reach the agent at
once: tiers 0-2 restart every rank on it, and recovery time must not wait for the next pass.
Whoever moves the job from ``g`` (:meth:`~ckless_lightning.comm.JobStore.advance_generation`) sets
``gen<g>/moved/agents`` in the request that wakes the ranks' generation watches (and whoever gives
the job up sets it too: :meth:`~ckless_lightning.comm.JobStore.give_up`); a :class:`MoveWatch` is
one thread, on a store connection of its own, blocked on that key. It costs the store one pending
request per agent, none while all is well (a wait that ends with no news is repeated every
``recheck_s``, 600 s).

Leaving: a wait still pending when the store closes (node 0's agent hosts it) ends in an error,
and one that returns while the interpreter shuts down can abort it, so an agent ends its watch's
wait before it leaves. Once the job is over for every agent (every node done, given up, or the
store closing with its host) the agent releases the key its watch waits on
(:meth:`~ckless_lightning.comm.JobStore.release_agents_watch`), which ends every agent's wait; an
agent that leaves a job that goes on (its node done first, taken over, interrupted) waits for that
release, bounded.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from ckless_lightning.comm import JobStore

__all__ = ["MoveWatch"]

# A wait that long with no news re-reads the generation (a mover killed between moving the job and
# waking the watches is the only way to miss a wake-up; the agent's own store passes see it sooner)
# and waits again.
_RECHECK_S = 600.0  # a wait that times out is logged by c10d (two warning lines): rarely
_JOIN_S = 2.0  # stop(): how long the agent waits for the thread to end


class MoveWatch:
    """Sets :attr:`moved` each time the job leaves the generation the watch waits on, from
    ``generation`` on; ``start`` once, ``stop`` as the agent leaves.

    Contract: a daemon thread blocks on ``waiter`` (a client of its own,
    :meth:`JobStore.another_client`) in :meth:`JobStore.wait_agents_moved` for generation ``g``;
    when the key appears it sets :attr:`moved` and waits on ``g + 1`` (a move from ``g`` always goes
    to ``g + 1``, by ``compare_set``; a job that moved several times meanwhile finds each key set
    and catches up at once). Every wait is bounded by ``recheck_s``: after one that times out the
    thread reads the generation (one request) and, if the job is past ``g`` (its mover died before
    it set the key), sets :attr:`moved` and waits on the current one. The agent consumes the event
    with :meth:`take` and sleeps in :meth:`pause`. A store failure ends the thread (printed, unless
    it was stopped): the agent's store passes find the store gone on their own, and still see every
    move, one ``agent.store_interval`` late at most. ``on_moved`` (None: nothing) is called from the
    thread at each wake with the generation the job is in (read then: a give-up wakes the watch too,
    with no move), for the node relay's :meth:`~ckless_lightning.comm.node_relay.JoinRelay.moved`
    (the ranks' watches learn the move there).
    """

    def __init__(
        self,
        waiter: JobStore,
        generation: int,
        *,
        recheck_s: float = _RECHECK_S,
        name: str = "move-watch",
        on_moved: Callable[[int], None] | None = None,
    ) -> None:
        self.waiter = waiter
        self.generation = generation  # the generation whose move the thread waits for (its own)
        self.recheck_s = recheck_s
        self.on_moved = on_moved
        self.moved = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self) -> bool:
        """Whether the job moved since the last :meth:`take` (clears :attr:`moved`). Call it before the
        store pass it decides: a move after the clear sets it again, a move before it is in the pass."""
        if not self.moved.is_set():
            return False
        self.moved.clear()
        return True

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less: until the job moves (:attr:`moved` stays set for :meth:`take`)."""
        self.moved.wait(seconds)

    def stop(self, *, release: JobStore | None = None, join_s: float = _JOIN_S) -> None:
        """End the watch: it waits no more, and the thread is joined, at most ``join_s`` (then left:
        a daemon, its wait bounded by ``recheck_s``).

        ``release``: the job is over for every agent: end the wait now through that client
        (:meth:`JobStore.release_agents_watch`, which ends every agent's). Without, the current wait
        ends when someone else releases it or the job moves."""
        self._stop.set()
        deadline = time.monotonic() + join_s
        while self._thread.is_alive() and (left := deadline - time.monotonic()) > 0:
            if release is not None:
                release.release_agents_watch(self.generation)  # the thread may have moved on: again
            self._thread.join(timeout=min(0.2, left) if release is not None else left)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.waiter.wait_agents_moved(self.generation, timeout_s=self.recheck_s):
                    self.generation += 1
                elif (current := self.waiter.generation()) > self.generation:
                    self.generation = current  # its mover died before it woke the watches
                else:
                    continue
                self.moved.set()
                if self.on_moved is not None:  # a give-up wakes the watch too: tell it the job's generation
                    self.on_moved(self.waiter.generation())
        except RuntimeError as err:  # the store is gone (DistNetworkError): the agent finds out itself
            if not self._stop.is_set():
                print(f"move watch: the job store failed ({type(err).__name__}: {err})", file=sys.stderr)
