"""What a node agent does when its lease on the node runs out (``agent/store_lease.py``), and as it
leaves: the fence, the give-up, and ending the store requests its threads still wait on.

:class:`NodeFence` holds the agent's :class:`~ckless_lightning.agent.store_lease.StoreLease` and acts
on the node through the small :class:`FencedNode` protocol (the agent implements it).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Protocol

from ckless_lightning.agent.store_lease import StoreLease
from ckless_lightning.comm import JobStore
from ckless_lightning.record.events import EventLog
from ckless_lightning.recovery.sever import sever_connections_to
from ckless_lightning.runtime.config import AgentConfig
from ckless_lightning.runtime.contract import ExitCode

__all__ = ["FencedNode", "NodeFence", "end_store_requests"]

_GIVE_UP_GRACE_S = 30.0  # after a fenced agent gave up, for its main thread to leave on its own
_END_REQUESTS_S = 2.0  # as the agent leaves, for the threads whose store requests it cut to return
# The agent's threads that wait on the store (and every "*-move-watch").
_STORE_THREADS = ("join-relay", "join-relay-barrier", "store-lease", "store-lease-ping")


class FencedNode(Protocol):
    """What :class:`NodeFence` needs of the node agent."""

    node: int
    events: EventLog

    def rank_pids(self) -> list[int]: ...

    def kill_ranks(self) -> None:
        """SIGKILL every local rank process (thread-safe: called from the lease's thread)."""

    def close_processes(self) -> None:
        """Stop the node's other processes (spares, fork server, batch cache reader)."""


class NodeFence:
    """The lease of ``agent`` on its node, on ``store`` at ``address``, with ``cfg``'s bounds.

    ``lease`` is pinged on a connection of its own whose requests wait at most ``agent.store_interval``
    twice; a fence kills the node's ranks; a give-up cuts the agent's store connections so that its
    main thread's blocked request fails at once (``DistNetworkError``: the agent's usual exit 75 path),
    and ends the process itself after :data:`_GIVE_UP_GRACE_S` should that thread not leave.
    """

    def __init__(
        self, agent: FencedNode, store: JobStore, cfg: AgentConfig, address: tuple[str, int]
    ) -> None:
        assert cfg.fence_after is not None
        self.agent = agent
        self.cfg = cfg
        self.address = address
        self._store = store
        self._client: JobStore | None = None
        self.lease = StoreLease(
            self._ping,
            fence_after_s=cfg.fence_after,
            give_up_after_s=cfg.fence_after + 2 * cfg.node_timeout,
            interval_s=cfg.store_interval,
            on_fence=self._fence,
            on_give_up=self._give_up,
        )

    def _ping(self) -> None:
        if self._client is None:
            self._client = self._store.another_client(timeout_s=2 * self.cfg.store_interval)
        try:
            self._client.generation()
        except BaseException:
            self._client = None  # a request that timed out may answer late: a fresh connection next time
            raise

    def _fence(self, silent_s: float) -> None:
        """The lease ran out (on its thread): kill the node's ranks before the job counts the node as
        lost, so that none trains on in a generation the job left. The agent's next store pass
        decides what follows."""
        agent = self.agent
        pids = sorted(agent.rank_pids())
        agent.kill_ranks()
        agent.events.emit("fenced", node=agent.node, reason="store", silent_s=round(silent_s, 3), pids=pids)
        print(
            f"[agent{agent.node}] no answer from the job store for {silent_s:.1f} s (agent.fence_after="
            f"{self.cfg.fence_after:g}): killed this node's ranks {pids}, so that none of them trains on in "
            "a generation the job may have moved to; waiting for the store",
            file=sys.stderr,
        )

    def _give_up(self, silent_s: float) -> None:
        """Still no store (on the lease's thread): the job replaced this node long ago, or lost its store."""
        host, port = self.address
        print(
            f"[agent{self.agent.node}] no answer from the job store at {host}:{port} for {silent_s:.1f} s: "
            "this node is cut off, or the store is gone; giving up",
            file=sys.stderr,
        )
        sever_connections_to(socket.gethostbyname(host), port)
        last_resort = threading.Timer(_GIVE_UP_GRACE_S, self._exit_now)
        last_resort.daemon = True
        last_resort.start()

    def _exit_now(self) -> None:
        """:meth:`_give_up`'s last resort: the main thread did not leave; end the node here."""
        print(f"[agent{self.agent.node}] the supervision loop did not end; exiting", file=sys.stderr)
        try:
            self.agent.kill_ranks()
            self.agent.close_processes()
        finally:
            sys.stderr.flush()
            os._exit(ExitCode.FAULT_BUDGET)  # the main thread cannot be woken from where it is blocked


def end_store_requests(address: tuple[str, int], node: int) -> None:
    """As an agent that does not host the store leaves: end every request of this process still waiting
    on the store at ``address`` (the move watch's, the node relay's, the lease's ping: their bounded
    stops leave a thread whose wait nobody released, e.g. after a takeover), and give those threads a
    moment to return. A process that exits while a thread waits in C++ aborts (``terminate called
    without an active exception``: the thread is unwound as the interpreter finalizes)."""
    host, port = address
    try:
        sever_connections_to(socket.gethostbyname(host), port)
    except OSError as err:  # nothing to cut, or the name no longer resolves: nothing waits then
        print(f"[agent{node}] could not end the store requests left ({err})", file=sys.stderr)
        return
    deadline = time.monotonic() + _END_REQUESTS_S
    for thread in threading.enumerate():
        if thread.name in _STORE_THREADS or thread.name.endswith("-move-watch"):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
