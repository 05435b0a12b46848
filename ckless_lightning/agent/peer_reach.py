"""Which side of a cut between nodes is cut off: reachability probes over the peer network.

Why: a node may lose its link to the other nodes (the network its ranks' collectives use) while it
still reaches the job store (a management network of its own, or a route that survives). Its ranks
and their peers on the other nodes then all wait in a collective whose bytes vanish; every agent
sees its own ranks silent and, after ``agent.hang_timeout``, blames one of them. The replacements
cannot connect across the cut either, so the job spends its fault budget and exits 75 on every node,
the standby unused (measured before this module: 75 s, 4 generations).

How the job finds the cut-off side, with one decision:

- every agent of a multi-node job, standbys included, listens on its node's **peer address** (the
  one its ranks' collectives use: :func:`peer_host`) and registers it in the store once
  (:class:`ReachListener`; the kernel answers a probe, no request reaches the agent's loop);
- an agent whose ranks have been silent in a step for ``agent.probe_after`` (default
  ``hang_timeout / 4``) probes every registered agent (a TCP connect, at most
  :data:`PROBE_TIMEOUT_S`) and appends those it could not reach to the record of the generation's
  current check (``reach/<g>/round``: an agent joins the current check if it has not reported in it,
  else starts the next one; at most one check per agent per ``agent.probe_after``, so a silence that
  found everyone reachable, a straggler that went on, does not use up the generation: a cut later
  in it is found by the next check);
- once every node has reported, or after :data:`SETTLE_S`, it computes :func:`reach_verdict` and
  stores it unless a verdict is stored (``compare_set``); every agent acts on the stored verdict;
- :func:`reach_verdict`: the nodes that stay must all reach each other; the agent (node owner or
  other registered agent: a standby) that most others could not reach, or that could not reach
  them, is set apart until no misses are left among the rest (ties: a standby first, then the highest
  node; so a standby that node 0 reaches breaks a two-node tie, and without one node 0 stays); the
  nodes set apart are **cut off**;
- a cut-off node's agent kills its ranks (event ``fenced``, ``reason="peers"``) and gives the node up
  with a last beat that every other agent reads as a node lost (``StoreLook.release``): the job
  moves on at once (a standby claims the node; an elastic job shrinks; else it waits for a
  replacement, then exits 75). The winners give their ranks a fresh ``hang_timeout`` for that move.

Costs: nothing in steady state (one append per agent as it starts); an incident costs each
suspecting agent one TCP connect per registered agent and a store read every :data:`_POLL_S` for at
most :data:`SETTLE_S`. A hang with every agent reachable gives an empty verdict: the usual hang
blame follows.
"""

from __future__ import annotations

import errno
import fcntl
import math
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ckless_lightning.agent.node_fence import FencedNode
from ckless_lightning.comm import Heartbeat, JobStore

__all__ = [
    "PROBE_TIMEOUT_S",
    "SETTLE_S",
    "PeerReach",
    "ReachListener",
    "Verdict",
    "fence_cut_off",
    "peer_host",
    "probe",
    "reach_verdict",
    "wait_for_replacement",
]

PROBE_TIMEOUT_S = 1.0  # a connect that has no answer by then counts as unreached (a LAN answers in ms)
SETTLE_S = 2.0  # after its own report, how long an agent waits for the other nodes' reports
_POLL_S = 0.25  # between its reads of the reports while it waits
_BATCH = 256  # connects in flight at once (file descriptors)
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def _interface_ipv4(name: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def peer_host(env: Mapping[str, str]) -> str:
    """The address this node's ranks use for collectives: the IPv4 address of the first interface
    ``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` names (an exact name; ``=name`` too), else the
    address the host name resolves to (gloo's and NCCL's default). OSError when it cannot be found."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        first = env.get(var, "").split(",")[0].strip()
        if first and not first.startswith("^"):
            try:
                return _interface_ipv4(first.removeprefix("="))
            except OSError:
                if var == "GLOO_SOCKET_IFNAME":
                    raise
                break  # NCCL's value may be a prefix (``eth``): fall back to the host name
    return socket.gethostbyname(socket.gethostname())


class ReachListener:
    """A listening socket on ``host`` (port 0: a free one) that answers probes: the kernel completes
    a probe's handshake; a thread of its own accepts and closes, so the backlog never fills.
    Close it with :meth:`close` (or use it as a context manager)."""

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self._sock.settimeout(0.5)  # the accept loop looks at its stop flag this often
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="reach-listener", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()

    def __enter__(self) -> ReachListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def probe(addresses: Mapping[str, str], timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """Connect to each of ``addresses`` (id -> ``host:port``); the ids not reached within
    ``timeout_s`` (refused, unroutable or no answer), sorted. At most :data:`_BATCH` at once."""
    unreached: list[str] = []
    items = sorted(addresses.items())
    for start in range(0, len(items), _BATCH):
        batch = items[start : start + _BATCH]
        pending: dict[socket.socket, str] = {}
        with selectors.DefaultSelector() as selector:
            for agent_id, address in batch:
                host, _, port = address.rpartition(":")
                sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                code = sock.connect_ex((host, int(port)))
                if code not in (0, errno.EINPROGRESS):
                    unreached.append(agent_id)
                    sock.close()
                    continue
                pending[sock] = agent_id
                selector.register(sock, selectors.EVENT_WRITE)
            deadline = time.monotonic() + timeout_s
            while pending and (left := deadline - time.monotonic()) > 0:
                for key, _ in selector.select(left):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    selector.unregister(sock)
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                        unreached.append(pending[sock])
                    del pending[sock]
                    sock.close()
            for sock, agent_id in pending.items():
                unreached.append(agent_id)
                sock.close()
    return sorted(unreached)


def reach_verdict(
    owners: Mapping[int, str], agents: Iterable[str], unreached: Mapping[str, Iterable[str]]
) -> list[int]:
    """The nodes cut off from the rest: see the module docstring.

    ``owners``: node -> the agent acting as it; ``agents``: every other agent that may be probed
    (standbys; dead ones too); ``unreached``: agent -> the agents it could not reach (an agent that
    did not report is taken to reach every agent that did not report it).

    The nodes that stay must all reach each other (a collective needs every pair, so reaching through
    a third agent does not count): the agent with the most misses is set apart, again and again, until
    no two left missed each other; among equals a standby first (it only breaks ties), then the
    highest node. Deterministic: every agent computes the same verdict from the same reports."""
    left = set(agents) | set(owners.values())
    apart: dict[str, set[str]] = {v: set() for v in left}
    for a, missed in unreached.items():
        for b in missed:
            if a in apart and b in apart and a != b:
                apart[a].add(b)
                apart[b].add(a)
    node_of = {agent: node for node, agent in owners.items()}
    cut_off = []
    while left:
        worst = max(left, key=lambda v: (len(apart[v]), v not in node_of, node_of.get(v, -1), v))
        if not apart[worst]:
            break
        for other in apart.pop(worst):
            apart[other].discard(worst)
        left.discard(worst)
        if worst in node_of:
            cut_off.append(node_of[worst])
    return sorted(cut_off)


@dataclass(frozen=True)
class Verdict:
    """A generation's stored verdict, as one agent reads it."""

    gen: int
    cut_off: tuple[int, ...]  # the nodes cut off from the others
    unreached: tuple[str, ...]  # the agents this agent could not reach
    round: int = 1  # which check of the generation (reach/<gen>/round)


class PeerReach:
    """One agent's side of the probes: its registration, and its checks (at most one at a time and
    one per ``probe_after_s``) on a thread of its own (with a store connection of its own). Not
    thread-safe beyond that thread.

    ``connect``: a new store connection (for the check's thread); ``node``: this agent's node (a
    standby only answers probes: it registers through ``stand_by``); ``probe_after_s``: how long its
    ranks stay silent in a step before it checks."""

    def __init__(
        self,
        store: JobStore,
        listener: ReachListener,
        *,
        agent_id: str,
        node: int,
        nnodes: int,
        probe_after_s: float,
        connect: Callable[[], JobStore],
    ) -> None:
        self.store = store
        self.listener = listener
        self.agent_id = agent_id
        self.node = node
        self.nnodes = nnodes
        self.probe_after_s = probe_after_s
        self._connect = connect
        self._checked = -1  # the generation of the last check
        self._round = 0  # the check of that generation this agent reported in last
        self._ended = -math.inf  # when its last check ended (time.monotonic())
        self._thread: threading.Thread | None = None
        self._verdict: Verdict | None = None  # the last check's, until taken
        self._error: BaseException | None = None

    def register(self) -> None:
        """Tell the store where this agent answers probes (once per agent process)."""
        if self.store.reach_agents().get(self.agent_id) != self.listener.address:
            self.store.register_reach(self.agent_id, self.listener.address)

    def suspects(self, now: float, beats: Mapping[int, Heartbeat], running: Iterable[int]) -> bool:
        """Some rank of ``running`` has been silent in a step (after its first) for ``probe_after_s``
        at ``now`` (unix time, as the beats')."""
        return any(
            now - beats[r].time > self.probe_after_s
            and beats[r].completed_step >= 0
            and beats[r].phase not in ("recovery", "standby", "save")
            for r in running
            if r in beats
        )

    def check(self, gen: int) -> None:
        """Check ``gen``: join its current check, or start the next; not while a check runs, for an
        older generation, or within ``probe_after_s`` of this agent's last check of ``gen``."""
        if gen < self._checked or (self._thread is not None and self._thread.is_alive()):
            return
        if gen == self._checked and time.monotonic() - self._ended < self.probe_after_s:
            return
        if gen > self._checked:
            self._checked, self._round = gen, 0
        self._thread = threading.Thread(target=self._run, args=(gen,), name="peer-reach", daemon=True)
        self._thread.start()

    def take(self) -> Verdict | None:
        """The verdict of the last check, once it is in (then None until the next check's)."""
        if self._error is not None:
            err, self._error = self._error, None
            print(f"[agent{self.node}] the peer reachability check failed: {err!r}", file=sys.stderr)
        verdict, self._verdict = self._verdict, None
        return verdict

    def _run(self, gen: int) -> None:
        try:
            self._verdict = self._decide(gen, self._connect())
        except Exception as err:  # the store failed (the lease and the passes act on that): report it
            self._error = err
        finally:
            self._ended = time.monotonic()

    def _decide(self, gen: int, store: JobStore) -> Verdict:
        round_ = store.reach_round(gen)
        if round_ <= self._round:  # none yet, or it reported in the current one: the next one
            round_ = store.next_reach_round(gen, round_)
        self._round = round_
        targets = {a: addr for a, addr in store.reach_agents().items() if a != self.agent_id}
        unreached = probe(targets)
        store.report_unreached(gen, round_, self.node, self.agent_id, unreached)
        deadline = time.monotonic() + SETTLE_S
        reports = store.reach_reports(gen, round_)
        while len(reports) < self.nnodes and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            reports = store.reach_reports(gen, round_)
        owners = store.node_owners(self.nnodes)
        registered = store.reach_agents()
        cut_off = reach_verdict(owners, registered, {agent: missed for agent, missed in reports.values()})
        stood = store.settle_reach_verdict(gen, round_, cut_off)
        return Verdict(gen, tuple(stood), tuple(unreached), round_)


def fence_cut_off(agent: FencedNode, verdict: Verdict) -> None:
    """``verdict`` says ``agent``'s node is cut off from the others: kill its ranks (event ``fenced``,
    ``reason="peers"``) so that none trains on in a generation the job moves to without them."""
    pids = sorted(agent.rank_pids())
    agent.kill_ranks()
    agent.events.emit("fenced", node=agent.node, reason="peers", unreached=list(verdict.unreached), pids=pids)
    print(
        f"[agent{agent.node}] this node is cut off from the other nodes (unreached: "
        f"{', '.join(verdict.unreached) or 'none'}; the job's verdict: nodes {list(verdict.cut_off)}): "
        f"killed its ranks {pids}; waiting for the job to go on without it",
        file=sys.stderr,
    )


def wait_for_replacement(
    store: JobStore,
    node: int,
    agent_id: str,
    *,
    interval_s: float,
    renewed: Callable[[], None],
    others: list[int],
    silent_s: float,
    hosting: bool = False,
) -> str:
    """A cut-off node's agent, its ranks killed, its node released: wait until the job no longer
    needs it.
    ``"taken"`` (another agent owns the node; never for an agent ``hosting`` the store, which serves
    it to the end), ``"giveup"`` or ``"done"`` (the job ended), ``"lost"`` (no agent of the
    ``others`` nodes beat for ``silent_s``: nobody is left to end the job). Each look reads the store
    (bounded by the store's timeout; a lost store raises) and calls ``renewed`` (the agent's lease:
    the store answered). The job bounds the rest: a released node is taken over, shrunk away, or the
    job waits for a replacement up to ``comm.join_timeout_s`` and gives up."""
    last_beats: dict[int, tuple[int, int]] = {}
    changed_at = time.monotonic()
    while True:
        if not hosting and store.node_owner(node) != agent_id:
            return "taken"
        if store.giveup_reason() is not None:
            return "giveup"
        if store.ranks_finished() > 0:
            return "done"
        beats = store.agent_heartbeats(others)
        if beats != last_beats:
            last_beats, changed_at = beats, time.monotonic()
        elif time.monotonic() - changed_at > silent_s:
            return "lost"
        renewed()
        time.sleep(interval_s)
