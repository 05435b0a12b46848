"""An agent's lease on its node: ranks that cannot reach the job store stop before they are replaced.

Why: a node cut off from the network (a switch port, a cable, a routing fault) keeps running: its
agent and ranks are alive but reach neither the store nor their peers. The rest of the job sees the
node's agent fall silent and, after ``agent.node_timeout``, a standby takes the node over (or the job
shrinks, or gives up for a requeue). Were the cut-off ranks still running when the link heals, they
would be a second copy of the node's ranks, trained on a generation the job has left (split brain).

So the agent holds its node on a lease, renewed by every store round trip it makes (its passes, and
a ping of its own when the passes are blocked): with no answer for ``agent.fence_after`` seconds,
less than ``agent.node_timeout``, the agent **fences** its node itself: it kills its ranks at once,
so that they are gone before anyone else can count the node as lost. The other agents time the
silence from the last beat the store got, which came after this agent's last renewal, so the order
holds without synchronized clocks: fence at renewal + ``fence_after``, taken over at the earliest at
that beat + ``node_timeout``.

What follows the fence is decided by the store, the job's one arbiter:

- the store answers again and the node is still this agent's: its ranks died, and the tier's
  policy replaces them like any other lost ranks (a short cut costs a rank loss, never two
  copies of a rank);
- the store answers and another agent owns the node: this one leaves (``agent_replaced``);
- no answer for ``agent.node_timeout`` twice more: the agent gives up with exit 75, since the job
  either replaced the node long ago or lost its store.

:class:`StoreLease` is the clock and the ping; what a fence and a give-up do is the agent's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["NodeFenced", "StoreLease"]

_GAP_S = 2.0  # seconds between two checks (0.25 s apart) that mean this process did not run


class NodeFenced(RuntimeError):
    """The agent was about to start a rank while its lease is out: only a store pass, which reads who
    owns the node, may end the fence (a request blocked across the cut answers late, and the agent
    must not act on what it decided before)."""


class StoreLease:
    """Times the store's silence for one agent; fires ``on_fence`` and then ``on_give_up`` once each.

    Args:
        ping: one store round trip (raises when the store does not answer); called from a thread of
            the lease's own, only when no :meth:`renew` came for ``interval_s``, never concurrently.
        fence_after_s: silence after which ``on_fence(silent_s)`` runs (on the lease's thread).
        give_up_after_s: silence after which ``on_give_up(silent_s)`` runs (after the fence).
        interval_s: how often the silence is looked at and, when the agent's passes stall, pinged.
        clock: monotonic seconds (tests pass their own).

    :meth:`renew` (a successful store pass of the agent) restarts the clock; after a fence, it makes
    :attr:`fenced` false again and returns True once, for the agent to say so. The lease's own ping
    restarts the clock but does not end a fence: the agent's next pass, which reads who owns the
    node, does.
    """

    def __init__(
        self,
        ping: Callable[[], object],
        *,
        fence_after_s: float,
        give_up_after_s: float,
        interval_s: float,
        on_fence: Callable[[float], None],
        on_give_up: Callable[[float], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert 0 < interval_s <= fence_after_s < give_up_after_s, (interval_s, fence_after_s, give_up_after_s)
        self._ping = ping
        self.fence_after_s = fence_after_s
        self.give_up_after_s = give_up_after_s
        self.interval_s = interval_s
        self._on_fence = on_fence
        self._on_give_up = on_give_up
        self._clock = clock
        self._lock = threading.Lock()
        self._renewed = clock()
        self._checked = self._renewed  # the last check(): a gap in them is this process not running
        self._fenced = False
        self._gave_up = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.last_error: BaseException | None = None  # the last ping's failure, for the agent's message

    @property
    def fenced(self) -> bool:
        with self._lock:
            return self._fenced

    def silent_s(self) -> float:
        with self._lock:
            return self._clock() - self._renewed

    def renew(self) -> bool:
        """The store answered the agent just now. True when that ends a fence (once per fence)."""
        with self._lock:
            self._renewed = self._clock()
            if self._fenced and not self._gave_up:
                self._fenced = False
                return True
            return False

    def start(self) -> None:
        for name, target in (("store-lease", self._watch), ("store-lease-ping", self._pinger)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """End the watch (bounded: a ping blocked on a silent store is left to its daemon thread)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.interval_s + 1.0)

    def check(self) -> None:
        """Fire the fence or the give-up if the silence calls for it (the watch thread's step).

        After a gap in the checks themselves (this process was stopped, or starved of CPU), the
        silence counted during the gap is not the store's: the ping gets two intervals to reach the
        store before a fence (a resumed agent whose node was taken over meanwhile learns it from its
        next pass and leaves)."""
        with self._lock:
            now = self._clock()
            if now - self._checked > _GAP_S:
                self._renewed = max(self._renewed, now - self.fence_after_s + 2 * self.interval_s)
            self._checked = now
            silent = now - self._renewed
            fence = not self._fenced and silent >= self.fence_after_s
            give_up = not self._gave_up and silent >= self.give_up_after_s
            if fence:
                self._fenced = True
            if give_up:
                self._fenced = self._gave_up = True
        if fence:
            self._on_fence(silent)
        if give_up:
            self._on_give_up(silent)

    def _watch(self) -> None:
        while not self._stop.wait(min(self.interval_s, 0.25)):
            self.check()

    def _pinger(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._gave_up:
                return  # the agent leaves: no new connection to the store
            if self.silent_s() < self.interval_s:
                continue  # the agent's own passes renew the lease: no request of ours
            try:
                self._ping()
            except (RuntimeError, OSError) as err:  # DistError and its kin: the store did not answer
                self.last_error = err
                continue
            with self._lock:
                self._renewed = self._clock()
