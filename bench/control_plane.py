"""The job's control plane at scale, without training: N simulated ranks against the real job store.

    python bench/control_plane.py [--ranks 8 64 256 1024] [--ranks-per-node 8] [--step-ms 100]
                                  [--steps 30] [--kill-step 15] [--tier 4] [--vote wait|poll|collective]
                                  [--beats local|store] [--join node|store] [--json PATH]

Everything that is not the model runs as the job runs it, one thread per simulated rank and per
simulated node agent, in this process, against a real ``TCPStore`` hosting the job store:

- each rank joins generation 0 through :class:`GenerationSession` (the join barrier; it leaves and
  joins through its node agent's :class:`JoinRelay`, or with ``--join store`` through the store), holds a
  :class:`GenerationWatch` (told the job's moves by its agent's relay, or with ``--join store`` by a
  key of its own in the store, on a second connection), and per step sleeps ``--step-ms`` (the
  step's compute), beats twice (:class:`HeartbeatCallback`, as at a batch's start and end: into its
  node's heartbeat board, or with ``--beats store`` to the store), votes
  (:class:`StepCommit`) and, at tier 4, marks the job's state recorded once a generation (a step's
  fingerprint stays with the rank and its copy: no store request),
  and reports where it is once a second, as ``WhereReporter`` does when the place changed (to its
  slot of the node's board, or with ``--beats store`` to the store);
- each node agent (``--ranks-per-node`` ranks) looks at its node every ``agent.monitor_interval``
  (0.1 s: the board, no request) and makes the store pass every ``agent.store_interval`` (1 s;
  :class:`StoreLook`, the node agent's own code: its beat, and its ranks' beats that changed, in
  one request after one read), at once when its :class:`MoveWatch` sees the generation move (which
  it also tells its relay); when
  one of its ranks dies, it moves the job to the next generation (``JobStore.advance_generation``)
  and starts a replacement rank (new connections; heartbeat and membership written as the agent
  does);
- one rank dies before its vote on ``--kill-step`` (its thread ends; a real rank's process would);
  the others find out in the vote, leave, and join the next generation with the replacement.

``--vote collective`` (``comm.vote=collective``): the vote is an all-reduce on the generation's
process group, not store traffic; here an in-memory rendezvous of the generation's rank threads
stands in for it (the MIN of each rank's flag: 0 once its watch saw the job move), and a rank's death
fails its peers' pending rendezvous as a closed connection fails a collective.

Not simulated: process groups (their formation through the store is torch's: gloo's full mesh
costs O(world) store requests per rank; ``bench/scale_model.py`` models it), tier 4's state
transfer, data. Requests are counted at the store's door: every client connection of the simulated
job is a ``CountingStore`` around a ``TCPStore`` client, which counts each request it sends (a
``multi_get`` of k keys is one request; a ``get`` or ``multi_get`` is two, as c10d's client sends a
``WAIT`` for its keys before it reads them: counted as ``get_wait``). The store's own host
connection is not used by the job.

Per N it prints: store requests per rank-step (steady state: from the 5th step to the one before
the fault), requests per second at the store, the vote's latency (p50, p99: from a rank's vote to
its decision, which includes waiting for the last voter), the agent's store look (p50 time), and
for the killed rank: the time from its death to every rank having joined the next generation, and
the store requests in that window (all of the job's, per node too). The simulator shares this
machine's cores with the store: ``sim_cpu_s`` is the process's CPU time per wall second over the
steady window (2.0 = both cores of a 2-core machine busy), so that a latency can be read against it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch.distributed import Store, TCPStore  # noqa: E402

from ckless_lightning.agent.move_watch import MoveWatch  # noqa: E402
from ckless_lightning.agent.store_look import StoreLook  # noqa: E402
from ckless_lightning.comm import Generation, GenerationChanged, Heartbeat, JobStore  # noqa: E402
from ckless_lightning.comm.beat_board import BeatBoard, BoardBeats, HeartbeatWriter  # noqa: E402
from ckless_lightning.comm.node_relay import JoinRelay, NodeLink, NodeView  # noqa: E402
from ckless_lightning.comm.store import connect_store  # noqa: E402
from ckless_lightning.recovery.commit import StepCommit  # noqa: E402
from ckless_lightning.recovery.session import GenerationSession  # noqa: E402
from ckless_lightning.recovery.watch import GenerationWatch  # noqa: E402
from ckless_lightning.training.callbacks.heartbeat import HeartbeatCallback  # noqa: E402

SECRET = "control-plane-bench"
MONITOR_INTERVAL_S = 0.1  # agent.monitor_interval's default
STORE_INTERVAL_S = 1.0  # agent.store_interval's default
WHERE_INTERVAL_S = 1.0  # WhereReporter's interval


class CountingStore(Store):
    """A ``TCPStore`` client that counts the requests it sends (into each of ``counts``, by kind)."""

    def __init__(self, inner: TCPStore, counts: tuple[Counter[str], ...], lock: threading.Lock) -> None:
        super().__init__()
        self._inner = inner
        self._counts = counts
        self._lock = lock

    @property
    def host(self) -> str:
        return self._inner.host

    @property
    def port(self) -> int:
        return self._inner.port

    def _count(self, kind: str) -> None:
        with self._lock:
            for counts in self._counts:
                counts[kind] += 1

    def set(self, key: str, value: Any) -> None:
        self._count("set")
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get_wait")  # c10d's client sends a WAIT for the key first, then the GET
        self._count("get")
        return self._inner.get(key)

    def add(self, key: str, value: int) -> int:
        self._count("add")
        return self._inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count("compare_set")
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        self._count("check")
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait")
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count("get_wait")  # as get: a WAIT for the keys, then the MULTI_GET
        self._count("multi_get")
        return self._inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._count("multi_set")
        self._inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        self._count("num_keys")
        return self._inner.num_keys()


@dataclass
class Row:
    """One simulated job's figures (``--json`` writes a list of these)."""

    ranks: int
    nodes: int
    step_ms: float
    store_requests_per_rank_step: float
    store_requests_per_s: float
    # The two halves of the steady state: what ranks send per step (the vote, beats to the store), and
    # what node agents send per second (their store pass and move watch, per agent.store_interval).
    rank_requests_per_rank_step: float
    agent_requests_per_node_s: float
    requests_by_kind: dict[str, float]  # per rank-step, steady state
    vote_p50_s: float
    vote_p99_s: float
    # --vote collective, the vote's two parts (p50, p99; NaN otherwise): from a rank's vote to the last
    # rank's arrival (the ranks' skew: their steps end apart), and from that arrival to its return
    # (the simulated collective's release: every waiting thread woken, one at a time, for the interpreter)
    vote_skew_p50_s: float
    vote_skew_p99_s: float
    vote_release_p50_s: float
    vote_release_p99_s: float
    agent_look_p50_s: float
    recovery_s: float
    # --join node: from the fault to the last node agent seeing the next generation's barrier full (the
    # store's part of a recovery; what is left is each node waking its own ranks). None: --join store
    recovery_store_s: float | None
    # --join node, the same recovery's earlier marks: the fault to the last rank asking its agent to
    # join the next generation (every survivor noticed the fault, left, and the replacement started),
    # and to the first node agent seeing that barrier full (the node that filled it, at once)
    recovery_asked_s: float | None
    recovery_filled_s: float | None
    recovery_store_requests: int
    recovery_store_requests_per_node: float
    recovery_requests_by_kind: dict[str, float]  # per rank, from the fault to every rank joined
    # Of recovery_store_requests_per_node: the node agents' ordinary store passes in that window (one
    # per agent.store_interval, a recovery or not: the steady state's agents/s, paid for as long as
    # the recovery lasts); the rest is the recovery's own (moves, counts, waits, the replacement)
    recovery_pass_requests_per_node: float
    sim_cpu_s: float  # this process's CPU seconds per wall second in the steady window
    recovery_cpu_s: float  # the same from the fault to every rank joined (the simulator's own load in it)
    connections: int

    @property
    def vote_parts_measured(self) -> bool:
        return self.vote_skew_p50_s == self.vote_skew_p50_s  # not NaN: --vote collective


@dataclass
class Job:
    """The simulated job: the store, its counted clients, and what the threads record."""

    world: int
    per_node: int
    step_s: float
    steps: int
    kill_step: int
    tier: int
    blocking_vote: bool = True  # False: waiting votes poll the decision (the design before)
    collective_vote: bool = False  # True: comm.vote=collective (SimAllReduce), no store request
    local_beats: bool = True  # False: every rank beats to the store (agent.local_beats=false, before)
    node_join: bool = True  # False: every rank joins through the store (the design before the relay)
    host: TCPStore = field(init=False)
    boards: dict[int, BeatBoard] = field(default_factory=dict)  # node -> its agent's heartbeat board
    counts: Counter[str] = field(default_factory=Counter)
    agent_counts: Counter[str] = field(default_factory=Counter)  # the node agents' share of counts
    lock: threading.Lock = field(default_factory=threading.Lock)
    connections: int = 0
    votes: list[tuple[float, float]] = field(default_factory=list)  # (monotonic end, seconds)
    # --vote collective: (monotonic end, the vote to the last rank's arrival, that arrival to the return)
    vote_parts: list[tuple[float, float, float]] = field(default_factory=list)
    looks: list[float] = field(default_factory=list)
    passes: list[tuple[float, int]] = field(default_factory=list)  # agents' ordinary passes: (end, requests)
    step_started: dict[int, float] = field(default_factory=dict)  # step -> first rank's monotonic start
    joined_after_fault: dict[int, float] = field(default_factory=dict)  # rank -> monotonic join time
    barrier_full: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # node -> (gen, time)
    fault_at: float | None = None
    fault_cpu: float | None = None  # the process's CPU time at the fault, and once every rank joined
    recovered_cpu: float | None = None
    asked_at: dict[int, float] = field(default_factory=dict)  # rank -> its last join request after the fault
    fault_counts: Counter[str] | None = None
    recovered_counts: Counter[str] | None = None  # once every rank joined the next generation
    dead: set[int] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)
    allreduce: SimAllReduce = field(init=False)

    def __post_init__(self) -> None:
        self.allreduce = SimAllReduce(self.world)
        self.host = connect_store("127.0.0.1", 0, is_master=True)
        JobStore(self.host, secret=SECRET).open_job()  # as JobStore.host does
        assert self.local_beats or not self.node_join, "the node relay goes through the board"
        if self.local_beats:
            self.boards = {node: BeatBoard.create(self.per_node) for node in range(self.nodes)}

    def beats(self, rank: int, store: JobStore) -> HeartbeatWriter:
        """Where ``rank``'s beats go (as ``RankContext.beats``): its node's board, or the store."""
        if not self.local_beats:
            return store
        return BoardBeats(self.boards[rank // self.per_node], rank=rank, slot=rank % self.per_node)

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    def client(self, *, agent: bool = False, own: Counter[str] | None = None) -> JobStore:
        """A new counted connection to the job store (each rank has three, each agent four); an
        ``agent``'s requests also count as the agents', and in ``own`` if given."""
        with self.lock:
            self.connections += 1
        inner = connect_store("127.0.0.1", self.host.port, is_master=False)
        counts = (self.counts, self.agent_counts) if agent else (self.counts,)
        counts += (own,) if own is not None else ()
        return JobStore(CountingStore(inner, counts, self.lock), secret=SECRET)  # type: ignore[arg-type]

    def snapshot(self, *, agents: bool = False) -> Counter[str]:
        """The requests counted so far (``agents``: the node agents' only)."""
        with self.lock:
            return Counter(self.agent_counts if agents else self.counts)


class PeerLost(RuntimeError):
    """The simulated collective vote lost a member (a real one fails with "Connection closed by peer")."""


class SimAllReduce:
    """The collective vote's stand-in, in memory: per (generation, step), the MIN of the ranks' flags
    once all ``world`` arrived; a member's death, or the job leaving the generation (its ranks'
    watches cut their connections), fails every vote of the generation still waiting
    (:meth:`break_generation`)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cond = threading.Condition()
        self.votes: dict[tuple[int, int], list[int]] = {}
        self.full_at: dict[tuple[int, int], float] = {}  # (gen, step) -> perf_counter of the last arrival
        self.broken: set[int] = set()

    def vote(self, gen: int, step: int, flag: int, timeout_s: float = 600.0) -> bytes:
        with self.cond:
            flags = self.votes.setdefault((gen, step), [])
            flags.append(flag)
            if len(flags) == self.world:  # only the last arrival can end the others' wait (waking
                self.full_at[gen, step] = time.perf_counter()  # every waiter at each arrival is N**2
                self.cond.notify_all()  # wake-ups a step)
            self.cond.wait_for(lambda: gen in self.broken or len(flags) >= self.world, timeout_s)
            if len(flags) < self.world:  # (a real one can also end on some ranks and fail on others)
                raise PeerLost(f"generation {gen}, step {step}: a peer left the collective")
            return b"commit" if min(flags) == 1 else b"abandon"

    def break_generation(self, gen: int) -> None:
        with self.cond:
            self.broken.add(gen)
            self.cond.notify_all()


class TimedLink(NodeLink):
    """A rank's :class:`NodeLink` that notes when it asks to join after the fault (no request of its own)."""

    def __init__(self, job: Job, board: BeatBoard, *, slot: int, rank: int) -> None:
        super().__init__(board, slot=slot)
        self.job = job
        self.rank = rank

    def request_join(self, gen: int) -> None:
        if self.job.fault_at is not None:
            self.job.asked_at[self.rank] = time.monotonic()
        super().request_join(gen)


class SimRank(threading.Thread):
    """One rank: join, then steps (sleep, beats, vote, fingerprint) across generations."""

    def __init__(self, job: Job, rank: int, *, generation: int = 0, first_step: int = 1) -> None:
        super().__init__(name=f"rank{rank}", daemon=True)
        self.job = job
        self.rank = rank
        self.store = job.client()
        self.waiter = job.client()
        # What a waiting vote blocks in (and, as InProcessRecovery's, the join barrier between generations)
        self.barrier_waiter = job.client()
        self.vote_waiter = self.barrier_waiter if job.blocking_vote else None
        self.beats = job.beats(rank, self.store)
        # Where it is goes with its beats (as InProcessRecovery's WhereReporter): the board, or the store
        self.where: BoardBeats | JobStore = self.beats if isinstance(self.beats, BoardBeats) else self.store
        # Its end of the node relay (as InProcessRecovery's: its slot of the node's board)
        board = job.boards.get(rank // job.per_node)
        self.link = None
        if job.node_join and board is not None:
            self.link = TimedLink(job, board, slot=rank % job.per_node, rank=rank)
        self.session = GenerationSession(
            self.store,
            rank=rank,
            world_size=job.world,
            generation=generation,
            join_timeout_s=600,
            beats=self.beats,
            waiter=self.barrier_waiter,
            link=self.link,
        )
        self.session.completed_step = first_step - 1
        self.replacement = generation > 0

    def run(self) -> None:
        try:
            self._run()
        except Exception as err:  # a bench thread's failure is reported in the table's place
            self.job.errors.append(f"rank {self.rank}: {type(err).__name__}: {err}")
            self.job.done.set()

    def _run(self) -> None:
        job, rank = self.job, self.rank
        gen = self._join()
        step = self.session.completed_step + 1
        next_where = time.monotonic() + WHERE_INTERVAL_S
        while step <= job.steps:
            generation = Generation(self.store, gen, rank, job.world, (1, job.world))
            commit = StepCommit(generation, waiter=self.vote_waiter)
            beats = HeartbeatCallback(self.beats, rank=rank, generation=gen)
            watch = GenerationWatch(
                self.store,
                gen,
                rank,
                waiter=self.waiter,
                on_stuck=lambda: None,
                on_moved=self._on_moved(commit, gen),
                moves=self.link,
            )
            watch.start()
            marked = False  # the state/recorded mark of this generation's first step (tier 4)
            try:
                while step <= job.steps:
                    job.step_started.setdefault(step, time.monotonic())
                    beats.beat(step - 1)  # on_train_batch_start
                    time.sleep(job.step_s)  # the step's compute
                    if step == job.kill_step and rank == 1 and not self.replacement:
                        self._die(watch)
                        return
                    start = time.perf_counter()
                    if job.collective_vote:
                        if job.allreduce.vote(gen, step, 0 if watch.moved else 1) != b"commit":
                            raise GenerationChanged(gen, gen + 1, f"voting on step {step}: abandoned")
                        full, end = job.allreduce.full_at[gen, step], time.perf_counter()
                        job.vote_parts.append((time.monotonic(), full - start, end - full))
                    else:
                        commit.vote(step)
                    job.votes.append((time.monotonic(), time.perf_counter() - start))
                    beats.beat(step)  # on_train_batch_end
                    if job.tier >= 4 and not marked:  # SnapshotCallback's on_first_record, once a generation
                        self.store.mark_state_recorded()
                        marked = True
                    if time.monotonic() >= next_where:
                        self.where.set_rank_where(rank, "running" if step % 2 else "data")
                        next_where = time.monotonic() + WHERE_INTERVAL_S
                    self.session.completed_step = step
                    step += 1
            except (GenerationChanged, PeerLost):
                watch.stop()
                self.session.leave()
                gen = self._join()
                step = self.session.completed_step + 1  # the abandoned step is done again
                continue
            watch.stop()
        if rank == 0:
            job.done.set()

    def _on_moved(self, commit: StepCommit, gen: int) -> Any:
        """What the rank's watch does when the job leaves ``gen``: abandon a waiting store vote; for
        the collective, the cut that fails the generation's pending collectives."""
        if self.job.collective_vote:
            return lambda store: self.job.allreduce.break_generation(gen)
        return commit.job_left if self.vote_waiter is not None else None

    def _join(self) -> int:
        gen = self.session.join()
        job = self.job
        if job.fault_at is not None:
            with job.lock:
                job.joined_after_fault[self.rank] = time.monotonic()
                last = len(job.joined_after_fault) == job.world
            if last:
                job.recovered_counts = job.snapshot()
                job.recovered_cpu = time.process_time()
        return gen

    def _die(self, watch: GenerationWatch) -> None:
        """The rank's process ends: no more requests of its own (its watch's pending wait dies too)."""
        job = self.job
        watch._stop.set()  # a dead process's watch thread dies with it; here it just returns on its wake-up
        job.allreduce.break_generation(watch.generation)  # its connections close: a collective fails
        job.fault_counts = job.snapshot()
        job.fault_cpu = time.process_time()
        job.fault_at = time.monotonic()
        with job.lock:
            job.dead.add(self.rank)


class SimAgent(threading.Thread):
    """One node's agent, as NodeAgent's supervision loop: a look at its node (the board) every
    ``MONITOR_INTERVAL_S``; a store pass (:meth:`StoreLook.look`) every ``STORE_INTERVAL_S``, at once
    when its :class:`MoveWatch` (on a connection of its own) sees the job's generation move, and when
    the node's look finds a rank of its node dead, which it then replaces."""

    def __init__(self, job: Job, node: int) -> None:
        super().__init__(name=f"agent{node}", daemon=True)
        self.job = job
        self.node = node
        self.own: Counter[str] = Counter()  # this agent's main connection's requests (its thread's only)
        self.store = job.client(agent=True, own=self.own)
        self.local = list(range(node * job.per_node, (node + 1) * job.per_node))
        self.board = job.boards.get(node)
        self.look = StoreLook(
            self.store,
            node=node,
            nnodes=job.nodes,
            node_timeout_s=30.0,
            agent_id=f"sim-agent-{node}",
            board=self.board,
            slots={rank: slot for slot, rank in enumerate(self.local)} if self.board else None,
        )
        self.store.set_node_owner(node, f"sim-agent-{node}")  # as NodeAgent does as it starts
        for rank in self.local:  # as NodeAgent.start_rank, before the rank's process starts
            self._first_beat(rank, 0)
        self.relay = None
        if job.node_join:
            assert self.board is not None
            self.relay = JoinRelay(
                self.board,
                ranks=self.local,
                world_size=job.world,
                store=job.client(agent=True),
                waiter=job.client(agent=True),
                generation=0,
                on_view=self._seen,
            )
        self.watch = MoveWatch(
            job.client(agent=True),
            0,
            name=f"agent{node}-move-watch",
            on_moved=self.relay.moved if self.relay is not None else None,
        )

    def run(self) -> None:
        job, gen, looked_once = self.job, 0, False
        self.watch.start()
        if self.relay is not None:
            self.relay.start()
        try:
            while not job.done.is_set():
                with job.lock:  # the node's look: a dead rank's exit code, and the board (no request)
                    lost = [r for r in self.local if r in job.dead]
                    job.dead.difference_update(lost)
                moved = self.watch.take()
                due = moved or lost or self.look.since_pass() >= STORE_INTERVAL_S
                # NodeAgent glances at its board every tick (for hangs, not simulated here); with a board
                # that glance asks for a store pass only before the first, so the simulated agent skips
                # it after that (~0.1 ms of the one interpreter, 10 times a second per node)
                if due or ((not looked_once or self.board is None) and self.look.glance(self.local) is None):
                    start, before = time.perf_counter(), self.own.total()
                    look = self.look.look(gen, self.local)
                    job.looks.append(time.perf_counter() - start)
                    if not (moved or lost):  # an ordinary pass (its interval), not one for a move or death
                        job.passes.append((time.monotonic(), self.own.total() - before))
                    gen, looked_once = max(gen, look.current), True
                for rank in lost:  # what ReplaceFailed does for a rank that exited: next generation, spare
                    if self.relay is not None:
                        self.relay.slot_lost(rank % job.per_node)
                    gen = max(gen, self.store.generation())
                    # Only if no generation answered the death yet (its survivors may have moved on)
                    if self.store.member(rank) >= gen:
                        gen = self.store.advance_generation(gen, world_size=job.world)
                    if self.relay is not None:
                        self.relay.slot_started(rank % job.per_node)
                    self._first_beat(rank, gen)
                    self.store.set_member(rank, gen)
                    SimRank(job, rank, generation=gen, first_step=job.kill_step).start()
                self.watch.pause(MONITOR_INTERVAL_S)
        except Exception as err:  # a bench thread's failure is reported in the table's place
            job.errors.append(f"agent {self.node}: {type(err).__name__}: {err}")
            job.done.set()
        finally:
            # The job is over: end the watch's wait before the job's store closes (as the agent
            # hosting the store does), so no wait is left on a connection that closes.
            if self.relay is not None:
                self.relay.stop()
            self.watch.stop(release=self.store)

    def _seen(self, view: NodeView) -> None:
        """The relay's node record changed: when it says a barrier opened full, note the time."""
        if view.full:
            self.job.barrier_full.setdefault(self.node, []).append((view.barrier, time.monotonic()))

    def _first_beat(self, rank: int, gen: int) -> None:
        """The beat NodeAgent.start_rank writes for a rank it starts: to the store and the board."""
        beat = Heartbeat(gen, -1, time.time())
        self.store.set_rank_heartbeat(rank, beat)
        if self.board is not None:
            self.board.write(rank % self.job.per_node, beat, by_agent=True)
            self.look.published(rank, beat)


def _store_phase(job: Job, *, first: bool = False) -> float | None:
    """From the fault to the last node agent (``first``: the first) seeing the barrier of the
    generation every rank joined after it open full (--join node; None with --join store, where the
    ranks wait themselves)."""
    if not job.node_join:
        return None
    assert job.fault_at is not None
    last = max(gen for times in job.barrier_full.values() for gen, _ in times)
    seen = [t for times in job.barrier_full.values() for gen, t in times if gen == last]
    return (min(seen) if first else max(seen)) - job.fault_at


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def simulate(
    world: int,
    *,
    per_node: int,
    step_ms: float,
    steps: int,
    kill_step: int,
    tier: int,
    blocking_vote: bool = True,
    local_beats: bool = True,
    collective_vote: bool = False,
    node_join: bool = True,
) -> Row:
    """Run one simulated job of ``world`` ranks to its end; its figures."""
    if world % per_node:
        raise SystemExit(f"--ranks {world} is not a multiple of --ranks-per-node {per_node}")
    if not 6 < kill_step < steps:
        raise SystemExit(f"--kill-step {kill_step} must be in 7..{steps - 1} (a steady window before it)")
    job = Job(
        world,
        per_node,
        step_ms / 1000.0,
        steps,
        kill_step,
        tier,
        blocking_vote=blocking_vote,
        local_beats=local_beats,
        collective_vote=collective_vote,
        node_join=node_join and local_beats,
    )
    ranks = [SimRank(job, r) for r in range(world)]
    agents = [SimAgent(job, n) for n in range(job.nodes)]
    for thread in (*agents, *ranks):
        thread.start()
    steady_from, steady_to = 5, kill_step - 1
    window: dict[str, Any] = {}
    while not job.done.wait(0.01):
        if "start" not in window and steady_from in job.step_started:
            window.update(
                start=time.monotonic(),
                cpu=time.process_time(),
                counts=job.snapshot(),
                agents=job.snapshot(agents=True),
            )
        if "end" not in window and steady_to + 1 in job.step_started:
            window.update(
                end=time.monotonic(),
                cpu_end=time.process_time(),
                counts_end=job.snapshot(),
                agents_end=job.snapshot(agents=True),
            )
    if job.errors:
        raise SystemExit(f"{world} ranks: " + "; ".join(job.errors[:3]))
    for thread in (*ranks, *agents):
        thread.join(timeout=60)
    wall = window["end"] - window["start"]
    rank_steps = world * (steady_to + 1 - steady_from)
    steady = window["counts_end"] - window["counts"]
    total = sum(steady.values())
    by_agents = sum((window["agents_end"] - window["agents"]).values())
    assert job.fault_at is not None and job.fault_counts is not None and job.recovered_counts is not None
    assert job.fault_cpu is not None and job.recovered_cpu is not None
    recovered_at = max(job.joined_after_fault.values())
    recovery_counts = job.recovered_counts - job.fault_counts
    recovery_requests = sum(recovery_counts.values())
    steady_votes = [s for t, s in job.votes if window["start"] <= t <= window["end"]]
    steady_parts = [(a, b) for t, a, b in job.vote_parts if window["start"] <= t <= window["end"]]
    return Row(
        ranks=world,
        nodes=job.nodes,
        step_ms=step_ms,
        store_requests_per_rank_step=total / rank_steps,
        store_requests_per_s=total / wall,
        rank_requests_per_rank_step=(total - by_agents) / rank_steps,
        agent_requests_per_node_s=by_agents / (job.nodes * wall),
        requests_by_kind={k: v / rank_steps for k, v in sorted(steady.items())},
        vote_p50_s=_percentile(steady_votes, 0.5),
        vote_p99_s=_percentile(steady_votes, 0.99),
        vote_skew_p50_s=_percentile([a for a, _ in steady_parts], 0.5),
        vote_skew_p99_s=_percentile([a for a, _ in steady_parts], 0.99),
        vote_release_p50_s=_percentile([b for _, b in steady_parts], 0.5),
        vote_release_p99_s=_percentile([b for _, b in steady_parts], 0.99),
        agent_look_p50_s=_percentile(job.looks, 0.5),
        recovery_s=recovered_at - job.fault_at,
        recovery_store_s=_store_phase(job),
        recovery_asked_s=max(job.asked_at.values()) - job.fault_at if job.node_join else None,
        recovery_filled_s=_store_phase(job, first=True),
        recovery_store_requests=recovery_requests,
        recovery_store_requests_per_node=recovery_requests / job.nodes,
        recovery_requests_by_kind={k: v / world for k, v in sorted(recovery_counts.items())},
        recovery_pass_requests_per_node=sum(n for t, n in job.passes if job.fault_at <= t <= recovered_at)
        / job.nodes,
        sim_cpu_s=(window["cpu_end"] - window["cpu"]) / wall,
        recovery_cpu_s=(job.recovered_cpu - job.fault_cpu) / (recovered_at - job.fault_at),
        connections=job.connections,
    )


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=15)
    parser.add_argument("--tier", type=int, choices=(3, 4), default=4)
    parser.add_argument(
        "--vote",
        choices=("wait", "poll", "collective"),
        default="wait",
        help="the step vote: through the store, a waiting voter blocked in it (comm.vote=store) or "
        "polling it (before); or an all-reduce (comm.vote=collective)",
    )
    parser.add_argument(
        "--beats",
        choices=("local", "store"),
        default="local",
        help="where ranks beat: their node agent's board, published once per pass (today), or the store",
    )
    parser.add_argument(
        "--join",
        choices=("node", "store"),
        default="node",
        help="how ranks join a generation: through their node agent's relay (today; needs --beats "
        "local) or each through the store (before)",
    )
    parser.add_argument("--json", type=Path, help="write the rows here (a JSON list)")
    args = parser.parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # three connections per rank, both ends here
    threading.stack_size(256 * 1024)  # thousands of threads
    rows = []
    for world in args.ranks:
        print(f"simulating {world} ranks ({world // args.ranks_per_node} nodes) ...", file=sys.stderr)
        row = simulate(
            world,
            per_node=args.ranks_per_node,
            step_ms=args.step_ms,
            steps=args.steps,
            kill_step=args.kill_step,
            tier=args.tier,
            blocking_vote=args.vote != "poll",
            local_beats=args.beats == "local",
            collective_vote=args.vote == "collective",
            node_join=args.join == "node",
        )
        rows.append(row)
        print(
            f"  {row.store_requests_per_rank_step:.2f} requests per rank-step, "
            f"vote p99 {row.vote_p99_s * 1000:.1f} ms, recovery {row.recovery_s:.2f} s",
            file=sys.stderr,
        )
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return rows


def _table(rows: list[Row]) -> str:
    head = (
        f"{'ranks':>6} {'nodes':>5} {'req/rank-step':>13} {'ranks':>6} {'agents/s':>8} {'req/s':>7} "
        f"{'vote p50':>9} {'vote p99':>9} "
        f"{'look p50':>9} {'recovery':>9} {'of it store':>11} {'rec. req':>9} {'req/node':>9} {'passes':>7} "
        f"{'sim cpu':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.ranks:>6} {r.nodes:>5} {r.store_requests_per_rank_step:>13.2f} "
            f"{r.rank_requests_per_rank_step:>6.2f} {r.agent_requests_per_node_s:>8.2f} "
            f"{r.store_requests_per_s:>7.0f} {r.vote_p50_s * 1e3:>7.1f}ms {r.vote_p99_s * 1e3:>7.1f}ms "
            f"{r.agent_look_p50_s * 1e3:>7.2f}ms {r.recovery_s:>8.2f}s {_seconds(r.recovery_store_s):>11} "
            f"{r.recovery_store_requests:>9} "
            f"{r.recovery_store_requests_per_node:>9.1f} {r.recovery_pass_requests_per_node:>7.1f} "
            f"{r.sim_cpu_s:>8.2f}"
        )
    lines.append(
        "(req/rank-step: every request; of them, 'ranks': the ranks' own per rank-step, 'agents/s': the node"
        " agents' per node and second; 'of it store': the fault to the last node agent seeing the next"
        " barrier full, the rest is each node waking its ranks; 'req/node': a recovery's store requests"
        " per node, all of the job's from the fault to every rank joined; 'passes': of them, the node"
        " agents' ordinary store passes meanwhile, one per agent.store_interval, a recovery or not)"
    )
    kinds = sorted({k for r in rows for k in r.requests_by_kind})
    lines.append("")
    lines.append("requests per rank-step by kind: " + ", ".join(kinds))
    for r in rows:
        lines.append(f"{r.ranks:>6}: " + "  ".join(f"{k} {r.requests_by_kind.get(k, 0):.2f}" for k in kinds))
    lines.append("")
    lines.append(
        "the recovery, from the fault (--join node): every rank asked its agent to join -> the barrier"
        " filled -> the last node agent saw it -> every rank joined; the simulator's CPU meanwhile"
        " (CPU seconds per wall second; its rank and agent threads share one interpreter lock)"
    )
    for r in rows:
        lines.append(
            f"{r.ranks:>6}: asked {_seconds(r.recovery_asked_s)}  filled {_seconds(r.recovery_filled_s)}  "
            f"last agent {_seconds(r.recovery_store_s)}  joined {r.recovery_s:.2f}s  "
            f"cpu {r.recovery_cpu_s:.2f}"
        )
    if any(r.vote_parts_measured for r in rows):
        lines.append("")
        lines.append(
            "the collective vote's parts (p50 / p99): the vote -> the last rank's arrival (the ranks'"
            " skew), that arrival -> the vote's return (the release: threads woken one at a time)"
        )
        for r in rows:
            lines.append(
                f"{r.ranks:>6}: skew {r.vote_skew_p50_s * 1e3:.1f} / {r.vote_skew_p99_s * 1e3:.1f} ms  "
                f"release {r.vote_release_p50_s * 1e3:.1f} / {r.vote_release_p99_s * 1e3:.1f} ms"
            )
    kinds = sorted({k for r in rows for k in r.recovery_requests_by_kind})
    lines.append("")
    lines.append("recovery store requests per rank by kind: " + ", ".join(kinds))
    for r in rows:
        by_kind = r.recovery_requests_by_kind
        lines.append(f"{r.ranks:>6}: " + "  ".join(f"{k} {by_kind.get(k, 0):.2f}" for k in kinds))
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # c10d looks up the name of every client socket's address (for its messages); the address is
    # IPv4-mapped IPv6, which /etc/hosts does not name, so each connect asks DNS. A resolver that
    # drops a burst of such queries stalls the connect for its timeout (5 s per ~50 connections on
    # the machine this was written on): 1 s, one try, keeps thousands of connections quick.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    main()
    # Threads of the last job still blocked in the store's C++ calls would abort the interpreter's
    # shutdown (std::terminate); everything is printed and written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
