"""Nodes in network namespaces, for partition tests and ``bench/partitions.py``.

A :class:`NetnsCluster` is N "nodes" and a job store, each its own network namespace, joined by two
bridges that live in a namespace of their own:

- the **peer network** ``10.99.1.0/24``: node ``i`` is ``10.99.1.<10+i>`` on its interface ``peer``
  (the ranks' gloo traffic: ``GLOO_SOCKET_IFNAME=peer``);
- the **store network** ``10.99.2.0/24``: node ``i`` is ``10.99.2.<10+i>`` on its interface ``store``,
  the store ``10.99.2.1``.

A cut is a link taken down at the bridge (no RST, no ICMP: packets vanish, as when a switch port
or a cable fails; TCP retransmits once the link is back): :meth:`cut` a node off from its peers, from
the store, or both; :meth:`cut_store` takes the store off every node. Only addresses inside these
namespaces are used; :meth:`close` kills whatever still runs inside them and deletes them (also
after a failure: use it as a context manager).

Needs root and iproute2's ``ip``; :func:`netns_unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence

__all__ = ["NetnsCluster", "netns_unavailable"]

PEER_IFACE = "peer"  # every node's interface on the peer network (its ranks' GLOO_SOCKET_IFNAME;
# gloo ignores a one-letter name)
STORE_IFACE = "store"


def netns_unavailable() -> str | None:
    """Why namespaces cannot be built here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no iproute2 `ip` command (apt-get install iproute2)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class NetnsCluster:
    """``nodes`` node namespaces and a store namespace; see the module docstring."""

    def __init__(self, nodes: int) -> None:
        assert 1 <= nodes <= 8, nodes
        tag = uuid.uuid4().hex[:6]
        self.bridge_ns = f"ck{tag}-br"
        self.store_ns = f"ck{tag}-st"
        self.node_ns = [f"ck{tag}-n{i}" for i in range(nodes)]
        self.store_addr = "10.99.2.1"
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def peer_addr(self, node: int) -> str:
        return f"10.99.1.{10 + node}"

    def _build(self) -> None:
        for ns in (self.bridge_ns, self.store_ns, *self.node_ns):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for bridge in ("brp", "brs"):
            _ip("-n", self.bridge_ns, "link", "add", bridge, "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", bridge, "up")
        self._link(self.store_ns, STORE_IFACE, "st", "brs", f"{self.store_addr}/24")
        for i, ns in enumerate(self.node_ns):
            self._link(ns, PEER_IFACE, f"n{i}p", "brp", f"{self.peer_addr(i)}/24")
            self._link(ns, STORE_IFACE, f"n{i}s", "brs", f"10.99.2.{10 + i}/24")

    def _link(self, ns: str, iface: str, port: str, bridge: str, addr: str) -> None:
        """A veth pair: ``iface`` in ``ns`` with ``addr``, its peer ``port`` on ``bridge``."""
        _ip("-n", ns, "link", "add", iface, "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "set", port, "master", bridge)
        _ip("-n", self.bridge_ns, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", addr, "dev", iface)
        _ip("-n", ns, "link", "set", iface, "up")

    # -- running things inside -------------------------------------------------------------------
    def node_command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.node_ns[node], *argv]

    def store_command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.store_ns, *argv]

    # -- faults ------------------------------------------------------------------------------------
    def _ports(self, node: int, *, peers: bool, store: bool) -> list[str]:
        return [port for port, on in ((f"n{node}p", peers), (f"n{node}s", store)) if on]

    def cut(self, node: int, *, peers: bool = True, store: bool = True) -> None:
        """Take node ``node``'s links down: to its peers, to the store, or (default) both."""
        for port in self._ports(node, peers=peers, store=store):
            _ip("-n", self.bridge_ns, "link", "set", port, "down")

    def heal(self, node: int, *, peers: bool = True, store: bool = True) -> None:
        for port in self._ports(node, peers=peers, store=store):
            _ip("-n", self.bridge_ns, "link", "set", port, "up")

    def cut_store(self) -> None:
        """The store off every node (its one link down)."""
        _ip("-n", self.bridge_ns, "link", "set", "st", "down")

    def heal_store(self) -> None:
        _ip("-n", self.bridge_ns, "link", "set", "st", "up")

    # -- cleanup -------------------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Processes still running inside any of the namespaces."""
        found = []
        for ns in self._made:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
            found += [int(p) for p in out.stdout.split()]
        return found

    def close(self) -> None:
        """Kill what still runs inside, then delete every namespace this cluster made (their veths go
        with them). Idempotent."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
