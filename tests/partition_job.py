"""A job's standalone store and agents inside a :class:`~netns.NetnsCluster` (tests, bench/partitions.py).

Two nodes of 2 ranks (node ``i`` in namespace ``i``), a standby in namespace 2 when asked, a checkpoint
every 5 steps, ``agent.node_timeout=6`` (``agent.fence_after`` its default 3 s) and
``agent.hang_timeout=20`` (above both: a rank waiting on a cut-off peer is not blamed for it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from conftest import launch_command
from netns import PEER_IFACE, NetnsCluster

from ckless_lightning.record.events import read_events

__all__ = ["COMMON", "PartitionJob"]

SECRET = "partition-test-secret-0123456789"
COMMON = (
    "checkpoint.every_n_steps=5",
    "cluster.nnodes=2",
    "cluster.nproc_per_node=2",
    "agent.node_timeout=6",
    "agent.hang_timeout=20",
)


class PartitionJob:
    """A job's store and agents inside a :class:`NetnsCluster`; see the module docstring."""

    def __init__(self, cluster: NetnsCluster, run: Path, data_cache: Path, *overrides: str) -> None:
        """``overrides``: for every agent of the job (after :data:`COMMON`)."""
        self.cluster, self.run, self.data_cache = cluster, run, data_cache
        self.overrides = overrides
        self.env = {**os.environ, "CKLESS_JOB_SECRET": SECRET, "GLOO_SOCKET_IFNAME": PEER_IFACE}
        self.agents: dict[str, subprocess.Popen[str]] = {}
        self.agent_pids: list[int] = []  # every agent started, requeued ones included
        self.tier = 1
        self.store = self._start_store()

    def _start_store(self) -> subprocess.Popen[str]:
        argv = [
            sys.executable,
            "-m",
            "ckless_lightning.store",
            "--host",
            self.cluster.store_addr,
            "--port",
            "0",
        ]
        store = subprocess.Popen(
            self.cluster.store_command(argv), stdout=subprocess.PIPE, text=True, env=self.env
        )
        line = store.stdout.readline()
        assert line.startswith(f"job store listening on {self.cluster.store_addr}:"), line
        self.port = int(line.rsplit(":", 1)[1])
        return store

    def requeue(self) -> None:
        """What a scheduler's requeue does: a new store (the old one stopped), the agents started again
        on the same run dir; they resume from its last checkpoint."""
        self._stop_store()
        self.store = self._start_store()
        self.start_nodes(standby=False, tier=self.tier, log_suffix=".requeued")

    def start(self, name: str, ns_node: int, *overrides: str, log_suffix: str = "") -> None:
        """An agent named ``name`` in namespace ``ns_node`` (its log: ``<run>.<name><log_suffix>.log``)."""
        argv = launch_command(
            self.run,
            self.data_cache,
            *COMMON,
            *self.overrides,
            f"cluster.store={self.cluster.store_addr}:{self.port}",
            f"cluster.master_addr={self.cluster.peer_addr(0)}",
            *overrides,
        )
        log = open(f"{self.run}.{name}{log_suffix}.log", "w")  # the agent writes it until it ends
        self.agents[name] = subprocess.Popen(
            self.cluster.node_command(ns_node, argv), stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        self.agent_pids.append(self.agents[name].pid)  # `ip netns exec` execs: the agent's own pid
        log.close()

    def start_nodes(self, *, standby: bool, tier: int = 1, log_suffix: str = "") -> None:
        self.tier = tier
        for node in (0, 1):
            self.start(
                f"node{node}", node, f"tier={tier}", f"cluster.node_rank={node}", log_suffix=log_suffix
            )
        if standby:
            self.start("standby", 2, f"tier={tier}", "cluster.node_rank=0", "cluster.standby=true")

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        losses = self.run / "losses.jsonl"
        deadline = time.monotonic() + timeout
        while not (losses.exists() and len(losses.read_text().splitlines()) >= step):
            assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
            assert all(a.poll() is None for a in self.agents.values()), self.logs()
            time.sleep(0.05)

    def wait_for_event(
        self, kind: str, timeout: float = 60, where: Callable[[dict], bool] | None = None, **fields: object
    ) -> dict:
        """The first event of ``kind`` with these ``fields`` (and for which ``where`` holds, if given)."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events(kind):
                if all(event.get(k) == v for k, v in fields.items()) and (where is None or where(event)):
                    return event
            assert time.monotonic() < deadline, f"no {kind} {fields} within {timeout} s\n{self.logs()}"
            time.sleep(0.05)

    def events(self, kind: str) -> list[dict]:
        return [e for e in self._all_events() if e["kind"] == kind]

    def events_from(self, source: str) -> list[dict]:
        """Every event ``source`` (``agent1``, ``rank2``) emitted, in order."""
        return [e for e in self._all_events() if e["source"] == source]

    def _all_events(self) -> list[dict]:
        path = self.run / "events.jsonl"
        return read_events(path) if path.exists() else []

    def finish(self, timeout: float = 180) -> dict[str, int]:
        codes = {}
        for name, agent in self.agents.items():
            try:
                codes[name] = agent.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                agent.kill()
                codes[name] = agent.wait()
        return codes

    def log(self, name: str) -> str:
        return Path(f"{self.run}.{name}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)[-2500:]}" for n in self.agents)

    def close(self) -> None:
        for agent in self.agents.values():
            agent.kill()
            agent.wait()
        self._stop_store()

    def _stop_store(self) -> None:
        self.store.terminate()
        try:
            self.store.wait(timeout=20)
        finally:
            self.store.kill()
            self.store.stdout.close()
