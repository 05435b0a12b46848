"""Standby agents: spare nodes that wait, warm, and take a lost node's place.

A job may start ``cluster.spare_nodes`` agents more than it has nodes (under Slurm:
``srun -n <nodes + spares>``; the tasks past the nodes stand by). A standby agent joins the
job store, prepares like any agent (data looked up, fork server warm) and watches the node
agents' beat counters on its own clock. When a node's agent has been silent for
``agent.node_timeout`` (its machine died, or it was killed or stopped), or gave its node up
(a node cut off from the others' network: ``StoreLook.release``), one standby claims
that silence (:meth:`~ckless_lightning.comm.store.JobStore.claim_node`: exactly one claimant
per silence), becomes the node's owner and runs as that node's agent: it joins the job's
generation and starts the node's ranks, as a replacement node would, so a node loss needs no
requeue. The old agent, should it come back (a stopped one resumed), finds it no longer owns
the node and stops its ranks (:class:`~ckless_lightning.agent.node_agent.NodeAgent`).

The wait is bounded by the job: it ends when the job finishes, gives up, or its store goes. A
standby looks at the store once per ``agent.store_interval`` (1 s), the node agents' cadence for
their beats: a node's silence is timed to within one interval, and a waiting standby costs the store
a few requests a second, not a few per node agent's ``agent.monitor_interval``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ckless_lightning.comm import JobStore

__all__ = ["StandbyWatch", "stand_by"]


@dataclass
class StandbyWatch:
    """Watches the node agents of a job for one that falls silent; see the module docstring."""

    store: JobStore
    nnodes: int
    node_timeout_s: float
    agent_id: str
    interval_s: float = 1.0  # agent.store_interval's default

    def wait_for_lost_node(self) -> int | None:
        """Block until this standby takes over a node (its number), or the job ends (None).

        Called once, before the agent runs; every look is one pass over the store.
        """
        seen: dict[int, tuple[int, float]] = {}  # node -> (beat count, monotonic time it changed)
        while True:
            if self.store.giveup_reason() is not None or self._job_done():
                return None
            now = time.monotonic()
            gen = self.store.generation()
            for node, (_, count) in self.store.agent_heartbeats(list(range(self.nnodes))).items():
                if self.store.node_done(gen, node):
                    continue  # finished: nothing to replace (a node not started yet has no beat)
                released = count < 0  # its agent gave the node up (StoreLook.release): no wait
                if not released and (node not in seen or seen[node][0] != count):
                    seen[node] = (count, now)
                elif (released or now - seen[node][1] > self.node_timeout_s) and self.store.claim_node(
                    node, count, self.agent_id
                ):
                    self.store.set_node_owner(node, self.agent_id)
                    return node
            time.sleep(self.interval_s)

    def _job_done(self) -> bool:
        return self.store.ranks_finished() > 0 or self.store.nodes_done(self.store.generation(), self.nnodes)


def stand_by(
    host: str,
    port: int,
    *,
    secret: str,
    nnodes: int,
    node_timeout_s: float,
    agent_id: str,
    interval_s: float = 1.0,
    reach_address: str | None = None,
) -> int | None:
    """Join the job store at ``host:port`` and wait to take a lost node over: its number, or None
    when the job ended (done, gave up, or its store is gone) without needing this standby.
    ``interval_s``: between its looks at the store (``agent.store_interval``); ``reach_address``:
    where this standby answers the node agents' peer probes (``agent/peer_reach.py``), registered."""
    from torch.distributed import DistNetworkError

    store = JobStore.connect(host, port, secret=secret)
    if reach_address is not None:
        store.register_reach(agent_id, reach_address)
    watch = StandbyWatch(
        store, nnodes=nnodes, node_timeout_s=node_timeout_s, agent_id=agent_id, interval_s=interval_s
    )
    try:
        return watch.wait_for_lost_node()
    except DistNetworkError:
        return None  # the store's host left: the job is over (the node agents report how it ended)
