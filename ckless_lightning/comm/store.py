"""The job store: a c10d TCPStore hosted by node 0's agent (or standalone), and the only code that
knows its key names.

Reused, not rewritten: ``torch.distributed.TCPStore`` is the same store
torchrun's rendezvous and ``init_process_group`` use. It lives in an agent (or in
``python -m ckless_lightning.store``), not in a rank, so any rank can die without
taking the store with it. Everyone else goes through :class:`JobStore`'s methods;
nothing outside this module spells a key.

The host binds the configured address only (a listening socket handed to the TCPStore), not
every interface. Every key of a job lives under a namespace derived from the job's secret
(:func:`job_namespace`): a client that cannot present the secret reads and writes nothing of the
job's, and :meth:`JobStore.connect` refuses a store that holds no job under its secret. The
keys below are relative to that namespace.

=================================  ==========================================================  ============
key                                value                                                       written by
=================================  ==========================================================  ============
``job``                            set by the host when the store opens (the secret check)       host
``job_started``                    counter: node 0's first agent starts the job (job_start)     agent 0
``gen``                            the current generation (an int, only raised, compare_set)   agent, rank
``restart/<g>``                    unix time generation ``g`` began (the restart budget; not   advancer
                                   written for an elastic resize)
``announced/<g>``                  counter: the first to move the job to ``g`` announces it    advancer
``gen<g>/moved/<rank>``            the job left ``g``: wakes ``rank``'s generation watch         advancer
                                   (or the rank itself, to release its own watch)
``gen<g>/moved/agents``            the job left ``g`` (set with the ranks' keys, in one        advancer,
                                   request) or gave up in it: wakes every node agent's move    agent, rank
                                   watch; or, the job over, an agent releasing its own watch
``giveup``                         the reason the job stops for good, set once (``""``, as the  agent
                                   host creates it: not given up)
``giveup_code``                    the exit code that goes with it (absent: 75, requeue)       agent
``hb/<rank>``                      ``"<gen> <completed step> <unix time> <phase>"``: the rank  agent (rank
                                   beats into its node's board, the agent publishes them each  with
                                   pass; with ``agent.local_beats=false`` the rank, each step) local_beats
                                                                                               off)
``where/<rank>``                   tiers 3-4, only with ``agent.local_beats=false`` (else the  rank
                                   rank's slot of its node's board, which its agent reads):
                                   where the rank's main thread is, each second it changes
                                   (``peers``: waiting in a collective, ``running``, ``data``,
                                   ``device``)
``agent/<node>``                   the generation each agent is in                             agent
``agent/<node>/beats``             count each agent raises per pass (liveness, no clocks)     agent
``owner/<node>``                   the agent now acting as ``node`` (a standby takes it over)  agent
``claim/<node>/<beats>``           the standby agent that takes ``node``, silent at ``beats``  standby
``reach/agents``                   ``<agent id>=<host:port>`` lines: where each agent answers  agent,
                                   reachability probes on its peer network (peer_reach.py)     standby
``reach/<g>/round``                the current reachability check of ``g`` (1, 2, ...)        agent
``reach/<g>/<r>``                  ``<node> <agent id> <unreached ids>`` lines: what each      agent
                                   agent whose ranks hung in ``g`` could not reach (check r)
``reach/<g>/<r>/verdict``          the nodes cut off from the others by check ``r`` of ``g``   agent
                                   (``-``: none), set once
``started/<g>/<node>``             the node's ranks were started in generation ``g``           agent
``master_port/<g>``                tier 0: rank 0's rendezvous port of generation ``g``        agent 0
``done/<g>/<node>``                a node's ranks all finished in generation ``g``             agent
``member/<rank>``                  the generation the rank's current process belongs to        agent, rank
``gen<g>/joined``                  tiers 3-4: counter of ranks that joined ``g`` (barrier)     rank
``gen<g>/open``                    tiers 3-4: ``g``'s barrier is full (set by the rank that     rank,
                                   filled it) or will never be (the move from ``g``, a give-up  advancer,
                                   or a finished rank in ``g``): ends the waits in the barrier  agent
``gen<g>/active``                  elastic: the job ranks training in ``g`` (``0,1,4,5``), set  rank
                                   once: by a resize before ``g`` exists, else at the first
                                   join (the previous generation's set)
``standby/<rank>``                 elastic: the generation the rank stands by in (-1: none)     rank
``gen<g>/vote/<step>``             tiers 3-4: counter of votes for the step in progress        rank
``gen<g>/decision/<step>``         ``commit``, ``abandon`` or ``disagree ...``, once           rank
``gen<g>/digest/<rank>``           HSDP: ``<step> <digest>``, posted before each vote          rank
                                   (a key per rank, overwritten: none per step)
``suspect/<rank>``                 counter: times its state disagreed with its replicas        rank
``state/recorded``                 tier 4: some rank recorded a committed step in memory       rank
``finished``, ``finished/<rank>``  tiers 3-4: ranks past their last collective (count, each)   rank
``ended``                          ``<exit code> <run dir>``: the job ended; no job starts on   agent 0
                                   this store under the same secret again
``gen<g>/pg/...``                  tier 1+: generation ``g``'s process groups (PrefixStore)    torch
=================================  ==========================================================  ============
"""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import DistStoreError, PrefixStore, TCPStore

from ckless_lightning.comm.bounded_store import GenerationBoundStore, GenerationChanged

__all__ = [
    "AgentPassReading",
    "GenerationChanged",
    "Heartbeat",
    "JobStore",
    "StoreRefused",
    "connect_store",
    "job_namespace",
]

# How long a client waits for the host's ``job`` key after connecting (the host writes it right
# after it starts listening, so a longer wait means another job's store or a wrong secret).
_JOB_KEY_WAIT_S = 10.0


def _encode_ranks(ranks: tuple[int, ...]) -> str:
    return ",".join(map(str, ranks))


def _ranks_of(raw: bytes) -> tuple[int, ...]:
    return tuple(int(r) for r in raw.decode().split(",") if r)


def _reason(raw: bytes) -> str | None:
    """The ``giveup`` key's value as a reason (empty: the job was not given up)."""
    return raw.decode() or None


def _agent_keys(nodes: list[int]) -> list[str]:
    """The agents' generation keys of ``nodes``, then their beat-count keys."""
    return [*(f"agent/{n}" for n in nodes), *(f"agent/{n}/beats" for n in nodes)]


def _agent_beats(nodes: list[int], values: list[bytes]) -> dict[int, tuple[int, int]]:
    """Each node's (generation, beat count) from the values of :func:`_agent_keys` ``(nodes)``."""
    half = len(nodes)
    return {n: (int(values[i]), int(values[half + i])) for i, n in enumerate(nodes)}


def _agent_pass_keys(node: int, others: list[int]) -> list[str]:
    """What a node agent's pass reads (:meth:`JobStore.agent_pass_read`), in this order."""
    return ["gen", "giveup", f"owner/{node}", *_agent_keys(others)]


@dataclass(frozen=True)
class AgentPassReading:
    """What :meth:`JobStore.agent_pass_read` read."""

    current: int  # the job's generation
    giveup: bool  # the job was given up
    owner: str  # the agent acting as the node
    agents: dict[int, tuple[int, int]]  # node -> its agent's (generation, beat count)


class StoreRefused(RuntimeError):
    """The store at the address holds no job under this client's secret."""


def job_namespace(secret: str) -> str:
    """The key prefix of the job whose secret is ``secret`` (a digest: the secret itself never
    travels; the namespace does, in plain text, with every request)."""
    if not secret:
        raise ValueError(
            "no job store secret: processes of a job get it from their agent (CKLESS_JOB_SECRET); "
            "start ranks with launch.py, or set CKLESS_JOB_SECRET to the job's secret"
        )
    return "job-" + hashlib.sha256(f"ckless-job-store:{secret}".encode()).hexdigest()[:40]


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host`` only (port 0: a free one) and listening; IPv4 or IPv6."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def connect_store(host: str, port: int, *, is_master: bool, timeout_s: float = 300.0) -> TCPStore:
    """Host (``is_master``) or join the job's TCPStore; port 0 with is_master picks a free port.

    The host listens on ``host``'s address only: a TCPStore given just a port listens on every
    interface (torch 2.13), so it gets a socket already bound (``master_listen_fd``).
    """
    listen_fd = None
    if is_master:
        sock = listening_socket(host, port)
        port = sock.getsockname()[1]
        listen_fd = sock.detach()  # the TCPStore server owns the descriptor from here on
    return TCPStore(
        host,
        port,
        is_master=is_master,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listen_fd,
        use_libuv=True,
    )


@dataclass(frozen=True)
class Heartbeat:
    """A rank's beat: its generation, its completed step (-1 while starting up), when, and its phase.

    ``phase`` is ``"step"`` while training (or starting up), ``"recovery"`` from the moment a
    rank leaves a generation until it trains again, and ``"save"`` from the start of a checkpoint
    save to the next batch: the agent gives each phase its own silence limit
    (``agent.hang_timeout``, ``agent.startup_timeout``, ``agent.recovery_timeout``,
    ``agent.save_timeout``).
    """

    gen: int
    completed_step: int
    time: float
    phase: str = "step"

    @classmethod
    def parse(cls, raw: bytes) -> Heartbeat:
        gen, completed, t, *phase = raw.decode().split()
        return cls(int(gen), int(completed), float(t), *phase)

    def encode(self) -> str:
        return f"{self.gen} {self.completed_step} {self.time:.6f} {self.phase}"


class JobStore:
    """Typed access to the job store's keys (see the module docstring)."""

    def __init__(self, store: TCPStore, *, secret: str) -> None:
        """Use ``store`` for the job whose secret is ``secret`` (prefer :meth:`host` / :meth:`connect`)."""
        self._server = store  # the connection: its address, for another client
        self._secret = secret
        # The job's namespace: only this class spells its keys.
        self._tcp = PrefixStore(job_namespace(secret), store)
        self._pg_stores: dict[int, GenerationBoundStore] = {}

    @classmethod
    def host(cls, host: str, port: int, *, secret: str) -> JobStore:
        """Open the job store on ``host:port`` (port 0: a free one) for the job with ``secret``."""
        store = cls(connect_store(host, port, is_master=True), secret=secret)
        store.open_job()
        return store

    def open_job(self) -> None:
        """Write the keys every client of the job expects (:meth:`host` does, on a new store)."""
        self._tcp.add("gen", 0)
        self._tcp.set("giveup", "")  # present from the start: an agent's pass reads it with the rest
        self._tcp.set("job", "1")  # last: a client that sees it finds the keys above

    @classmethod
    def connect(cls, host: str, port: int, *, secret: str, timeout_s: float = _JOB_KEY_WAIT_S) -> JobStore:
        """Join the job store on ``host:port`` (ranks, agents); :class:`StoreRefused` when it holds no
        job under ``secret`` within ``timeout_s`` (another job's store, or a different secret)."""
        store = cls(connect_store(host, port, is_master=False), secret=secret)
        try:
            store._tcp.wait(["job"], timedelta(seconds=timeout_s))
        except DistStoreError as err:
            if "timeout" not in str(err):
                raise
            raise StoreRefused(
                f"the job store at {host}:{port} holds no job for this secret: every agent and rank of a "
                "job must present the same one (CKLESS_JOB_SECRET or CKLESS_JOB_SECRET_FILE); is "
                f"{host}:{port} this job's store?"
            ) from None
        return store

    @property
    def port(self) -> int:
        return self._server.port

    # -- generations -------------------------------------------------------
    def generation(self) -> int:
        return self._tcp.add("gen", 0)

    def advance_generation(
        self,
        seen: int,
        *,
        world_size: int,
        announce: Callable[[int], None] | None = None,
        restart: bool = True,
    ) -> int:
        """Move from generation ``seen`` to ``seen + 1`` unless someone already moved on.

        Returns the generation now current. Several agents and ranks noticing the
        same fault therefore make one new generation, not several; ``announce``
        is called with the new generation by the first caller only, job-wide.
        Every caller that finds the job at ``seen + 1`` also wakes the generation
        watches of ``seen``'s ``world_size`` ranks and every node agent's move watch (one request;
        see :meth:`wait_moved` and :meth:`wait_agents_moved`).
        ``restart=False`` (an elastic resize, not a fault): the new generation does not count
        against the restart budget.
        """
        current = int(self._tcp.compare_set("gen", str(seen), str(seen + 1)))
        if current == seen + 1:
            wake = [
                *(f"gen{seen}/moved/{r}" for r in range(world_size)),
                f"gen{seen}/moved/agents",
                f"gen{seen}/open",  # ranks waiting in its join barrier: it will never fill
            ]
            values = ["1"] * len(wake)
            if restart:  # in the same request, first: whoever sees the wake-up finds the restart time
                wake.insert(0, f"restart/{seen + 1}")
                values.insert(0, f"{time.time():.6f}")
            self._tcp.multi_set(wake, values)
            if self._tcp.add(f"announced/{current}", 1) == 1 and announce is not None:
                announce(current)
        return current

    def wait_moved(self, gen: int, rank: int, *, timeout_s: float) -> bool:
        """Block until ``rank``'s wake key of generation ``gen`` exists (the job left ``gen``, or
        :meth:`release_watch`); False after ``timeout_s``. One pending request, no polling: use a
        client of its own (:meth:`another_client`), as it holds the connection while it waits."""
        return self._wait_key(f"gen{gen}/moved/{rank}", timeout_s)

    def release_watch(self, gen: int, rank: int) -> None:
        """End ``rank``'s :meth:`wait_moved` on ``gen`` (the rank leaves or ends that generation)."""
        self._tcp.set(f"gen{gen}/moved/{rank}", "1")

    def wait_agents_moved(self, gen: int, *, timeout_s: float) -> bool:
        """Block until the node agents' wake key of generation ``gen`` exists (the job left ``gen``:
        :meth:`advance_generation` sets it with the ranks' keys; or gave up in it: :meth:`give_up`;
        or :meth:`release_agents_watch`); False after ``timeout_s``. One pending request, no polling:
        use a client of its own (:meth:`another_client`), as it holds the connection while it waits."""
        return self._wait_key(f"gen{gen}/moved/agents", timeout_s)

    def _wait_key(self, key: str, timeout_s: float) -> bool:
        """Block until ``key`` exists; False after ``timeout_s`` (any other store error raises)."""
        try:
            self._tcp.wait([key], timedelta(seconds=timeout_s))
        except DistStoreError as err:
            if "timeout" not in str(err):
                raise
            return False
        return True

    def release_agents_watch(self, gen: int) -> None:
        """End every :meth:`wait_agents_moved` on ``gen`` as if the job had left it. Only once the job
        is over for every agent (every node done, or given up; or the store closes with the agent
        that hosts it), so that no agent acts on a move that did not happen: the agents' watches
        end before they leave, and none waits on a connection the store closes."""
        self._tcp.set(f"gen{gen}/moved/agents", "1")

    def another_client(self, *, timeout_s: float = 300.0) -> JobStore:
        """A second connection to the same store (for a thread that blocks in :meth:`wait_moved` or
        :meth:`wait_agents_moved`). ``timeout_s``: how long connecting, and each request, may wait
        for the store (a blocking wait given its own timeout waits that long instead)."""
        return JobStore(
            connect_store(self._server.host, self._server.port, is_master=False, timeout_s=timeout_s),
            secret=self._secret,
        )

    def process_group_store(self, gen: int, *, init_timeout_s: float) -> GenerationBoundStore:
        """Generation ``gen``'s own namespace for ``init_process_group`` (tier 1+).

        Its reads wait at most ``init_timeout_s`` and end when the job's generation moves on.
        This object keeps it alive: torch holds only its C++ half, and calls into the Python
        methods fail ("Not implemented") once the Python object is collected (torch 2.13).
        """
        if gen not in self._pg_stores:
            self._pg_stores[gen] = GenerationBoundStore(
                PrefixStore(f"gen{gen}/pg/", self._tcp),
                generation=gen,
                current=self.generation,
                timeout_s=init_timeout_s,
            )
        return self._pg_stores[gen]

    def restart_times(self, up_to_gen: int) -> list[float]:
        keys = [f"restart/{g}" for g in range(1, up_to_gen + 1)]
        present = [k for k in keys if self._tcp.check([k])]
        return [float(v) for v in self._tcp.multi_get(present)] if present else []

    def claim_job_start(self) -> bool:
        """True for the first caller only: the agent that starts the job (not a replacement of it)."""
        return self._tcp.add("job_started", 1) == 1

    # -- giving up ---------------------------------------------------------
    def give_up(self, reason: str, *, code: int | None = None) -> None:
        """Stop the job for good, for ``reason``; ``code``: the exit code every agent ends with
        (None: the fault budget's). The first reason stands. Wakes every node agent's move watch
        (:meth:`wait_agents_moved`), so that each agent reads the reason at once, not at its next
        store pass (an agent that left first would take the store with it)."""
        assert reason, "a job is given up for a reason"
        if self.giveup_reason() is None:
            if code is not None:
                self._tcp.set("giveup_code", str(code))
            self._tcp.compare_set("giveup", "", reason)  # the first reason stands
            gen = self.generation()  # wake the agents' move watches and the ranks in its join barrier
            self._tcp.multi_set([f"gen{gen}/moved/agents", f"gen{gen}/open"], ["1", "1"])

    def giveup_code(self) -> int | None:
        """The exit code given with the reason the job was given up (None: the fault budget's)."""
        return int(self._tcp.get("giveup_code")) if self._tcp.check(["giveup_code"]) else None

    def giveup_reason(self) -> str | None:
        """Why the job was given up; None while it was not."""
        return _reason(self._tcp.get("giveup")) if self._tcp.check(["giveup"]) else None

    # -- heartbeats --------------------------------------------------------
    def set_rank_heartbeat(self, rank: int, beat: Heartbeat) -> None:
        self._tcp.set(f"hb/{rank}", beat.encode())

    def set_rank_where(self, rank: int, where: str) -> None:
        """``rank``'s main-thread position (``recovery/where.py``), with ``agent.local_beats=false``
        only: else it goes to the node's heartbeat board (``BoardBeats.set_rank_where``)."""
        self._tcp.set(f"where/{rank}", where)

    def rank_where(self, ranks: list[int]) -> dict[int, str]:
        """Where each of ``ranks`` last said its main thread was; ranks that never said are left out
        (with ``agent.local_beats=true`` every rank does: the agent reads its board instead,
        ``NodeAgent.local_where``)."""
        present = [r for r in ranks if self._tcp.check([f"where/{r}"])]
        values = self._tcp.multi_get([f"where/{r}" for r in present]) if present else []
        return {r: raw.decode() for r, raw in zip(present, values, strict=True)}

    def rank_heartbeats(self, ranks: list[int]) -> dict[int, Heartbeat]:
        """Heartbeats of ``ranks`` (the agent writes an initial one when it starts a rank)."""
        if not ranks:
            return {}
        keys = [f"hb/{r}" for r in ranks]
        return {r: Heartbeat.parse(raw) for r, raw in zip(ranks, self._tcp.multi_get(keys), strict=True)}

    def agent_pass_write(self, node: int, gen: int, count: int, beats: Mapping[int, Heartbeat]) -> None:
        """A node agent's pass, what it writes, in one request: its beat (generation ``gen``, beat
        count ``count``, which its caller raises per pass) and ``beats``, its ranks' heartbeats that
        changed since the last pass (published for readers on other nodes).

        A count, not a timestamp: observers time its changes on their own clock, so machines whose
        clocks disagree never take a live node for a silent one (or the reverse)."""
        keys = [f"agent/{node}", f"agent/{node}/beats", *(f"hb/{r}" for r in beats)]
        self._tcp.multi_set(keys, [str(gen), str(count), *(b.encode() for b in beats.values())])

    def agent_pass_read(self, node: int, others: list[int]) -> AgentPassReading:
        """A node agent's pass, what it reads, in one request: the job's generation, whether it was
        given up, ``node``'s owner and the ``others``' agents' (generation, beat count).

        Call it once :meth:`agent_pass_ready` said every key exists (the store would otherwise hold
        the request until they do)."""
        values = self._tcp.multi_get(_agent_pass_keys(node, others))
        return AgentPassReading(
            current=int(values[0]),
            giveup=_reason(values[1]) is not None,
            owner=values[2].decode(),
            agents=_agent_beats(others, values[3:]),
        )

    def agent_pass_ready(self, node: int, others: list[int]) -> bool:
        """Every key :meth:`agent_pass_read` reads exists (one request; none is ever deleted)."""
        return self._tcp.check(_agent_pass_keys(node, others))

    def agent_heartbeat(self, node: int) -> tuple[int, int] | None:
        """``node``'s agent's (generation, beat count); None before its first beat."""
        return self.agent_heartbeats([node]).get(node)

    def agent_heartbeats(self, nodes: list[int]) -> dict[int, tuple[int, int]]:
        """Each of ``nodes``' agents' (generation, beat count), for those that beat at least once.

        Two requests for any number of nodes once every one of them has beaten (one ``check`` of
        all their keys, one ``multi_get`` of their generations and counters); before that, the
        nodes not yet seen are checked one by one."""
        if not nodes:
            return {}
        present = list(nodes)
        if not self._tcp.check(_agent_keys(nodes)):
            present = [n for n in nodes if self._tcp.check(_agent_keys([n]))]
            if not present:
                return {}
        return _agent_beats(present, self._tcp.multi_get(_agent_keys(present)))

    # -- node ownership (standby agents) -------------------------------------
    def set_node_owner(self, node: int, agent_id: str) -> None:
        """``agent_id`` acts as ``node`` from now on (an agent that starts, or a standby that took it)."""
        self._tcp.set(f"owner/{node}", agent_id)

    def node_owner(self, node: int) -> str | None:
        key = f"owner/{node}"
        return self._tcp.get(key).decode() if self._tcp.check([key]) else None

    def claim_node(self, node: int, silent_at_beats: int, agent_id: str) -> bool:
        """Take over ``node``, found silent at beat count ``silent_at_beats``; True for exactly one
        claimant per silence (several standby agents may see it at once)."""
        key = f"claim/{node}/{silent_at_beats}"
        return self._tcp.compare_set(key, "", agent_id).decode() == agent_id

    def node_owners(self, nnodes: int) -> dict[int, str]:
        """The agent acting as each of nodes ``0..nnodes-1`` (those that have one), in one request
        once all have."""
        keys = [f"owner/{n}" for n in range(nnodes)]
        if self._tcp.check(keys):
            return {n: raw.decode() for n, raw in enumerate(self._tcp.multi_get(keys))}
        return {n: owner for n in range(nnodes) if (owner := self.node_owner(n)) is not None}

    # -- peer reachability (agent/peer_reach.py) ------------------------------
    def register_reach(self, agent_id: str, address: str) -> None:
        """``agent_id`` answers reachability probes at ``address`` (``host:port``) on its node's peer
        network; appended, once per agent process."""
        self._tcp.append("reach/agents", f"{agent_id}={address}\n")

    def reach_agents(self) -> dict[str, str]:
        """Every registered agent's probe address (agent id -> ``host:port``), in one request."""
        if not self._tcp.check(["reach/agents"]):
            return {}
        lines = self._tcp.get("reach/agents").decode().splitlines()
        return dict(line.split("=", 1) for line in lines if line)

    def reach_round(self, gen: int) -> int:
        """Generation ``gen``'s current reachability check (1, 2, ...; 0: none yet)."""
        return int(self._tcp.add(f"reach/{gen}/round", 0))

    def next_reach_round(self, gen: int, after: int) -> int:
        """Start the check after ``after`` if ``after`` (read by :meth:`reach_round`) is still the
        current one; either way, the one current now."""
        return int(self._tcp.compare_set(f"reach/{gen}/round", str(after), str(after + 1)).decode())

    def report_unreached(self, gen: int, round_: int, node: int, agent_id: str, unreached: list[str]) -> None:
        """Node ``node``'s agent ``agent_id`` could not reach ``unreached`` (agent ids) in check
        ``round_`` of ``gen``."""
        self._tcp.append(f"reach/{gen}/{round_}", f"{node} {agent_id} {','.join(unreached)}\n")

    def reach_reports(self, gen: int, round_: int) -> dict[int, tuple[str, list[str]]]:
        """The reports of check ``round_`` of ``gen`` so far: node -> (its agent, the agents it could
        not reach)."""
        key = f"reach/{gen}/{round_}"
        if not self._tcp.check([key]):
            return {}
        reports = {}
        for line in self._tcp.get(key).decode().splitlines():
            node, agent_id, unreached = [*line.split(" ", 2), ""][:3]
            reports[int(node)] = (agent_id, [a for a in unreached.split(",") if a])
        return reports

    def settle_reach_verdict(self, gen: int, round_: int, cut_off: list[int]) -> list[int]:
        """Record ``cut_off`` as the verdict of check ``round_`` of ``gen`` unless one is recorded: the
        verdict that stands."""
        stood = self._tcp.compare_set(f"reach/{gen}/{round_}/verdict", "", ",".join(map(str, cut_off)) or "-")
        return [] if stood.decode() == "-" else [int(n) for n in stood.decode().split(",")]

    # -- per-generation rendezvous and completion --------------------------
    def publish_master_port(self, gen: int, port: int) -> None:
        self._tcp.set(f"master_port/{gen}", str(port))

    def has_master_port(self, gen: int) -> bool:
        return self._tcp.check([f"master_port/{gen}"])

    def master_port(self, gen: int) -> int:
        return int(self._tcp.get(f"master_port/{gen}"))  # blocks until node 0 published it

    # -- membership (tiers 3-4) --------------------------------------------
    def set_member(self, rank: int, gen: int) -> None:
        self._tcp.set(f"member/{rank}", str(gen))

    def member(self, rank: int) -> int:
        """The generation ``rank``'s current process belongs to; -1 if never set."""
        key = f"member/{rank}"
        return int(self._tcp.get(key)) if self._tcp.check([key]) else -1

    def beat_leaving(self, rank: int) -> None:
        """``rank``'s process is alive in a generation the job left (its watch beats while the rank
        finishes a step or leaves the old groups, before it is a member of the new one)."""
        self._tcp.add(f"leaving/{rank}", 1)

    def leaving_beats(self, ranks: list[int]) -> dict[int, int]:
        """How often each of ``ranks`` beat while leaving (:meth:`beat_leaving`); 0 if never."""
        return {rank: self._tcp.add(f"leaving/{rank}", 0) for rank in ranks}

    def mark_started(self, gen: int, node: int) -> None:
        self._tcp.set(f"started/{gen}/{node}", "1")

    def was_started(self, gen: int, node: int) -> bool:
        """Whether ``node``'s ranks were started in ``gen`` (a replacement node then asks for a new one)."""
        return self._tcp.check([f"started/{gen}/{node}"])

    # -- the join barrier (tiers 3-4) ----------------------------------------
    def join(self, gen: int, expected: int) -> int:
        """Count this rank into generation ``gen``'s join barrier of ``expected`` ranks; returns how
        many joined so far. The rank that fills it opens it (``gen<g>/open``), which ends every
        :meth:`wait_barrier` on it."""
        joined = self._tcp.add(f"gen{gen}/joined", 1)
        if joined >= expected:
            self._tcp.set(f"gen{gen}/open", "1")
        return joined

    def join_ranks(self, gen: int, ranks: list[int], *, expected: int) -> int:
        """A node agent counts ``ranks`` (its node's) into generation ``gen``'s join barrier of
        ``expected`` ranks, their membership with them: two requests for a node
        (:mod:`~ckless_lightning.comm.node_relay`); returns how many joined so far. Opens the barrier
        if it fills, as :meth:`join` does."""
        self._tcp.multi_set([f"member/{rank}" for rank in ranks], [str(gen)] * len(ranks))
        joined = self._tcp.add(f"gen{gen}/joined", len(ranks))
        if joined >= expected:
            self._tcp.set(f"gen{gen}/open", "1")
        return joined

    def open_barrier(self, gen: int) -> None:
        """Open generation ``gen``'s join barrier without filling it: every rank waiting in it looks
        for why (a node agent that leaves while it waits there for its ranks)."""
        self._tcp.set(f"gen{gen}/open", "1")

    def joined(self, gen: int) -> int:
        return self._tcp.add(f"gen{gen}/joined", 0)

    def wait_barrier(self, gen: int, *, timeout_s: float) -> bool:
        """Block until generation ``gen``'s join barrier opens: filled (:meth:`join`), or left behind
        (:meth:`advance_generation` opens it as the job leaves ``gen``); False after ``timeout_s``.
        One pending request, no polling."""
        return self._wait_key(f"gen{gen}/open", timeout_s)

    # -- elastic membership (tier 4, elastic.enabled) -----------------------
    def active_ranks(self, gen: int, world_size: int) -> tuple[int, ...]:
        """The job ranks that train in generation ``gen``; fixed by the first call (or a resize's
        :meth:`propose_active`): the latest earlier generation's set, or all ``world_size`` ranks."""
        key = f"gen{gen}/active"
        if not self._tcp.check([key]):
            inherited = tuple(range(world_size))
            for earlier in range(gen - 1, -1, -1):
                if self._tcp.check([f"gen{earlier}/active"]):
                    inherited = _ranks_of(self._tcp.get(f"gen{earlier}/active"))
                    break
            return _ranks_of(self._tcp.compare_set(key, "", _encode_ranks(inherited)))
        return _ranks_of(self._tcp.get(key))

    def propose_active(self, gen: int, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """Make ``ranks`` generation ``gen``'s set unless it has one; returns the set that stands."""
        return _ranks_of(self._tcp.compare_set(f"gen{gen}/active", "", _encode_ranks(ranks)))

    def set_standby(self, rank: int, gen: int) -> None:
        """``rank`` stands by in generation ``gen`` (-1: it trains, or left)."""
        self._tcp.set(f"standby/{rank}", str(gen))

    def standby(self, ranks: list[int]) -> dict[int, int]:
        """The generation each of ``ranks`` stands by in (-1: none, or never said)."""
        present = [r for r in ranks if self._tcp.check([f"standby/{r}"])]
        values = self._tcp.multi_get([f"standby/{r}" for r in present]) if present else []
        out = dict.fromkeys(ranks, -1)
        out.update({r: int(raw) for r, raw in zip(present, values, strict=True)})
        return out

    # -- the step-commit vote (tiers 3-4) -----------------------------------
    def vote(self, gen: int, step: int) -> int:
        """Count this rank's vote for ``step`` of ``gen``; returns the votes so far."""
        return self._tcp.add(f"gen{gen}/vote/{step}", 1)

    def decide(self, gen: int, step: int, decision: str) -> bytes:
        """Write ``decision`` unless one exists; returns the decision that stands (exactly one per step)."""
        return self._tcp.compare_set(f"gen{gen}/decision/{step}", "", decision)

    def wait_decision(self, gen: int, step: int, *, timeout_s: float) -> bytes | None:
        """Block until the decision on ``step`` of ``gen`` exists and return it; None after
        ``timeout_s``. One pending request, no polling: use a client of its own
        (:meth:`another_client`), as it holds the connection while it waits."""
        key = f"gen{gen}/decision/{step}"
        try:
            self._tcp.wait([key], timedelta(seconds=timeout_s))
        except DistStoreError as err:
            if "timeout" not in str(err):
                raise
            return None
        return self._tcp.get(key)

    def decision(self, gen: int, step: int) -> bytes | None:
        """The decision on ``step`` of ``gen``, or None while there is none."""
        key = f"gen{gen}/decision/{step}"
        return self._tcp.get(key) if self._tcp.check([key]) else None

    # -- the state digest in the vote (tiers 3-4, HSDP) ----------------------
    def post_digest(self, gen: int, step: int, rank: int, digest: str) -> None:
        """``rank``'s state digest for the vote on ``step`` (written before its vote counts; it
        replaces the rank's previous one, which no rank reads once that step is decided)."""
        self._tcp.set(f"gen{gen}/digest/{rank}", f"{step} {digest}")

    def digests(self, gen: int, step: int, ranks: list[int]) -> dict[int, str]:
        """The digests posted for the vote on ``step``, by rank. Called once every rank voted: each
        posted before voting, and none can post the next step's before this one is decided."""
        values = self._tcp.multi_get([f"gen{gen}/digest/{r}" for r in ranks])
        out = {}
        for r, raw in zip(ranks, values, strict=True):
            posted, digest = raw.decode().split(" ", 1)
            assert int(posted) == step, f"rank {r}'s digest is of step {posted}, the vote is on {step}"
            out[r] = digest
        return out

    def count_disagreement(self, rank: int) -> int:
        """Count one more state disagreement of ``rank`` (over the job's life); returns the count."""
        return self._tcp.add(f"suspect/{rank}", 1)

    def disagreements(self, rank: int) -> int:
        return self._tcp.add(f"suspect/{rank}", 0)

    # -- tier 4 ------------------------------------------------------------
    def mark_state_recorded(self) -> None:
        """Some rank recorded a committed step in memory: a recovery can restore from memory."""
        self._tcp.set("state/recorded", "1")

    def forget_recorded_state(self) -> None:
        """No live copy of the recorded state is left (tier 4 starts over from the job's start)."""
        self._tcp.delete_key("state/recorded")

    def state_recorded(self) -> bool:
        return self._tcp.check(["state/recorded"])

    # -- completion ---------------------------------------------------------
    def mark_rank_finished(self, rank: int) -> None:
        """``rank`` trained to the end and passed its last collective (the final save included). Opens
        the current generation's join barrier: a rank waiting in it learns the job is over."""
        self._tcp.set(f"finished/{rank}", "1")
        self._tcp.add("finished", 1)
        self._tcp.set(f"gen{self.generation()}/open", "1")

    def rank_finished(self, rank: int) -> bool:
        return self._tcp.check([f"finished/{rank}"])

    def mark_job_ended(self, code: int, run_dir: str) -> None:
        """The job ended with exit ``code`` (node 0's agent, as it exits): a store serves one job."""
        self._tcp.set("ended", f"{code} {run_dir}")

    def job_ended(self) -> str | None:
        """``"<exit code> <run dir>"`` of the job this store served under this secret, once it ended."""
        return self._tcp.get("ended").decode() if self._tcp.check(["ended"]) else None

    def ranks_finished(self) -> int:
        """How many ranks passed their last collective: once one has, the job's output is complete."""
        return self._tcp.add("finished", 0)

    def mark_done(self, gen: int, node: int) -> None:
        self._tcp.set(f"done/{gen}/{node}", "1")

    def node_done(self, gen: int, node: int) -> bool:
        return self._tcp.check([f"done/{gen}/{node}"])

    def nodes_done(self, gen: int, nodes: int | Sequence[int]) -> bool:
        """Every one of ``nodes`` (a count: nodes ``0..nodes-1``) is done in ``gen``; one request."""
        return self._tcp.check(
            [f"done/{gen}/{n}" for n in (range(nodes) if isinstance(nodes, int) else nodes)]
        )
