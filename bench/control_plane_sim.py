"""``bench/control_plane.py``'s simulated job, one worker process's share of it.

The job's nodes are split over ``--procs`` forked worker processes (whole nodes: a node's ranks and
its agent share a process, as on a real node they share a machine), so that 1,024 simulated ranks
do not all wait for one interpreter lock. Each worker runs, as threads, its nodes' ranks
(:class:`SimRank`) and agents (:class:`SimAgent`) against the one job store the parent hosts; what
crosses between the processes is in ``control_plane_procs.py``. Everything a worker measured goes
to the parent in one message at its end.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from control_plane_procs import SETUP_S, CountingStore, JobSpec, PeerLost, ProcAllReduce, Shared

from ckless_lightning.agent.move_watch import MoveWatch
from ckless_lightning.agent.store_look import StoreLook
from ckless_lightning.comm import Generation, GenerationChanged, Heartbeat, JobStore
from ckless_lightning.comm.beat_board import BeatBoard, BoardBeats, HeartbeatWriter
from ckless_lightning.comm.node_relay import JoinRelay, NodeLink, NodeView
from ckless_lightning.comm.store import connect_store
from ckless_lightning.recovery.commit import StepCommit
from ckless_lightning.recovery.session import GenerationSession
from ckless_lightning.recovery.watch import GenerationWatch
from ckless_lightning.training.callbacks.heartbeat import HeartbeatCallback

SECRET = "control-plane-bench"
MONITOR_INTERVAL_S = 0.1  # agent.monitor_interval's default
STORE_INTERVAL_S = 1.0  # agent.store_interval's default
WHERE_INTERVAL_S = 1.0  # WhereReporter's interval
THREAD_JOIN_S = 60.0  # a worker's wait for its threads once the job is over


@dataclass
class WorkerJob:
    """A worker's view of the simulated job: its nodes, its counted clients, what its threads record."""

    spec: JobSpec
    index: int
    shared: Shared
    conn: Connection
    boards: dict[int, BeatBoard] = field(default_factory=dict)  # node -> its agent's heartbeat board
    lock: threading.Lock = field(default_factory=threading.Lock)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    connections: int = 0
    votes: list[tuple[float, float]] = field(default_factory=list)  # (monotonic end, seconds)
    # --vote collective: (monotonic end, the vote to the last rank's arrival, that arrival to the return)
    vote_parts: list[tuple[float, float, float]] = field(default_factory=list)
    looks: list[float] = field(default_factory=list)
    # agents' ordinary passes: (node, monotonic start, monotonic end, requests)
    passes: list[tuple[int, float, float, int]] = field(default_factory=list)
    joined_after_fault: dict[int, float] = field(default_factory=dict)  # rank -> monotonic join time
    barrier_full: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # node -> (gen, time)
    asked_at: dict[int, float] = field(default_factory=dict)  # rank -> its last join request after the fault
    fault: tuple[Counter[str], float] | None = None  # (every request so far, CPU seconds) at the fault
    recovered: tuple[Counter[str], float] | None = None  # the same once every rank joined after it
    dead: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    allreduce: ProcAllReduce = field(init=False)

    def __post_init__(self) -> None:
        self.allreduce = ProcAllReduce(len(self.ranks), self.send)
        if self.spec.local_beats:
            self.boards = {node: BeatBoard.create(self.spec.per_node) for node in self.nodes}

    @property
    def nodes(self) -> range:
        return self.spec.worker_nodes(self.index)

    @property
    def ranks(self) -> range:
        per_node = self.spec.per_node
        return range(self.nodes.start * per_node, self.nodes.stop * per_node)

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def fail(self, what: str, err: BaseException) -> None:
        """A thread of this worker failed: reported in the table's place; the job ends."""
        self.errors.append(f"{what}: {type(err).__name__}: {err}")
        self.shared.done.set()

    def beats(self, rank: int, store: JobStore) -> HeartbeatWriter:
        """Where ``rank``'s beats go (as ``RankContext.beats``): its node's board, or the store."""
        if not self.spec.local_beats:
            return store
        per_node = self.spec.per_node
        return BoardBeats(self.boards[rank // per_node], rank=rank, slot=rank % per_node)

    def client(self, *, agent: bool = False, own: Counter[str] | None = None) -> JobStore:
        """A new counted connection to the job store (each rank has three, each agent four); an
        ``agent``'s requests also count as the agents', and in ``own`` if given."""
        with self.lock:
            self.connections += 1
        inner = connect_store("127.0.0.1", self.spec.port, is_master=False)

        def count(kind: str) -> None:
            with self.lock:
                self.shared.count(self.index, kind, agent=agent)
                if own is not None:
                    own[kind] += 1

        return JobStore(CountingStore(inner, count), secret=SECRET)  # type: ignore[arg-type]

    def note_fault(self) -> None:
        """The killed rank's process ends now."""
        self.fault = (self.shared.snapshot(), self.shared.cpu_seconds())
        self.shared.fault.value = time.monotonic()

    def note_joined(self, rank: int) -> None:
        """``rank`` joined a generation; after the fault the last of the world to do so notes the end."""
        if self.shared.fault_at is None:
            return
        with self.lock:
            first = rank not in self.joined_after_fault
            self.joined_after_fault[rank] = time.monotonic()
        if not first:
            return
        with self.shared.joined.get_lock():
            self.shared.joined.value += 1
            last = self.shared.joined.value == self.spec.world
        if last:
            self.recovered = (self.shared.snapshot(), self.shared.cpu_seconds())

    def results(self) -> dict[str, Any]:
        return {
            "connections": self.connections,
            "votes": self.votes,
            "vote_parts": self.vote_parts,
            "looks": self.looks,
            "passes": self.passes,
            "joined_after_fault": self.joined_after_fault,
            "barrier_full": self.barrier_full,
            "asked_at": self.asked_at,
            "fault": self.fault,
            "recovered": self.recovered,
            "errors": self.errors,
        }


def run_worker(spec: JobSpec, index: int, shared: Shared, conn: Connection) -> None:
    """A forked worker's life: build its nodes' agents and ranks and say ready; once the parent says
    go, start the agents, say when each made its first store pass, and when each made one after every
    agent of the job did (a steady pass: one read for every key); once the parent says every worker's
    agents did (on a real job the agents run for seconds before the ranks have imported), start the
    ranks; send its results when the job is over, and end (``os._exit``: threads still blocked in the
    store's C++ calls would abort an interpreter's shutdown)."""
    shared.pids[index + 1] = os.getpid()
    job = WorkerJob(spec, index, shared, conn)
    try:
        ranks = [SimRank(job, rank) for rank in job.ranks]
        agents = [SimAgent(job, node) for node in job.nodes]
    except Exception as err:  # set-up failed: the parent reports it and ends the job
        job.fail(f"worker {index} set-up", err)
        job.send(("final", job.results()))
        os._exit(1)
    threading.Thread(target=_receive, args=(job,), name="receiver", daemon=True).start()
    job.send(("ready",))
    if shared.go.wait(SETUP_S):
        for agent in agents:
            agent.start()
        deadline = time.monotonic() + SETUP_S
        if all(agent.first_pass.wait(max(0.0, deadline - time.monotonic())) for agent in agents):
            job.send(("agents_up",))
        if shared.agents_known.wait(SETUP_S) and all(
            agent.steady_pass.wait(max(0.0, deadline - time.monotonic())) for agent in agents
        ):
            job.send(("agents_steady",))
        if shared.ranks_go.wait(SETUP_S):
            for rank in ranks:
                rank.start()
        shared.done.wait(spec.bound_s)  # rank 0's end, a failure, or the parent's own bound passed
        deadline = time.monotonic() + THREAD_JOIN_S
        for thread in (*ranks, *agents):
            if thread.is_alive():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
    job.send(("final", job.results()))
    os._exit(0)


def _receive(job: WorkerJob) -> None:
    """The parent's answers to the worker's collective votes, and broken generations."""
    while True:
        try:
            msg = job.conn.recv()
        except EOFError:  # the parent is gone; the worker's wait for the job's end ends with it
            job.shared.done.set()
            return
        if msg[0] == "result":
            job.allreduce.answered(*msg[1:])
        else:
            assert msg[0] == "break", msg
            job.allreduce.break_generation(msg[1], tell=False)


class TimedLink(NodeLink):
    """A rank's :class:`NodeLink` that notes when it asks to join after the fault (no request of its own)."""

    def __init__(self, job: WorkerJob, board: BeatBoard, *, slot: int, rank: int) -> None:
        super().__init__(board, slot=slot)
        self.job = job
        self.rank = rank

    def request_join(self, gen: int) -> None:
        if self.job.shared.fault_at is not None:
            self.job.asked_at[self.rank] = time.monotonic()
        super().request_join(gen)


class SimRank(threading.Thread):
    """One rank: join, then steps (sleep, beats, vote, fingerprint) across generations."""

    def __init__(self, job: WorkerJob, rank: int, *, generation: int = 0, first_step: int = 1) -> None:
        super().__init__(name=f"rank{rank}", daemon=True)
        self.job = job
        self.rank = rank
        spec = job.spec
        self.store = job.client()
        self.waiter = job.client()
        # What a waiting vote blocks in (and, as InProcessRecovery's, the join barrier between generations)
        self.barrier_waiter = job.client()
        self.vote_waiter = self.barrier_waiter if spec.blocking_vote else None
        self.beats = job.beats(rank, self.store)
        # Where it is goes with its beats (as InProcessRecovery's WhereReporter): the board, or the store
        self.where: BoardBeats | JobStore = self.beats if isinstance(self.beats, BoardBeats) else self.store
        # Its end of the node relay (as InProcessRecovery's: its slot of the node's board)
        board = job.boards.get(rank // spec.per_node)
        self.link = None
        if spec.node_join and board is not None:
            self.link = TimedLink(job, board, slot=rank % spec.per_node, rank=rank)
        self.session = GenerationSession(
            self.store,
            rank=rank,
            world_size=spec.world,
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
            self.job.fail(f"rank {self.rank}", err)

    def _run(self) -> None:
        job, spec, rank = self.job, self.job.spec, self.rank
        gen = self._join()
        step = self.session.completed_step + 1
        next_where = time.monotonic() + WHERE_INTERVAL_S
        while step <= spec.steps:
            generation = Generation(self.store, gen, rank, spec.world, (1, spec.world))
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
                while step <= spec.steps:
                    job.shared.mark_step(step)
                    beats.beat(step - 1)  # on_train_batch_start
                    time.sleep(spec.step_s)  # the step's compute
                    if step == spec.kill_step and rank == 1 and not self.replacement:
                        self._die(watch)
                        return
                    start = time.perf_counter()
                    if spec.collective_vote:
                        if job.allreduce.vote(gen, step, 0 if watch.moved else 1) != b"commit":
                            raise GenerationChanged(gen, gen + 1, f"voting on step {step}: abandoned")
                        full, end = job.allreduce.full_at[gen, step], time.perf_counter()
                        job.vote_parts.append((time.monotonic(), full - start, end - full))
                    else:
                        commit.vote(step)
                    job.votes.append((time.monotonic(), time.perf_counter() - start))
                    beats.beat(step)  # on_train_batch_end
                    if spec.tier >= 4 and not marked:  # SnapshotCallback's on_first_record, once a generation
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
            job.shared.done.set()

    def _on_moved(self, commit: StepCommit, gen: int) -> Any:
        """What the rank's watch does when the job leaves ``gen``: abandon a waiting store vote; for
        the collective, the cut that fails the generation's pending collectives."""
        if self.job.spec.collective_vote:
            return lambda store: self.job.allreduce.break_generation(gen)
        return commit.job_left if self.vote_waiter is not None else None

    def _join(self) -> int:
        gen = self.session.join()
        self.job.note_joined(self.rank)
        return gen

    def _die(self, watch: GenerationWatch) -> None:
        """The rank's process ends: no more requests of its own (its watch's pending wait dies too)."""
        job = self.job
        job.note_fault()
        watch._stop.set()  # a dead process's watch thread dies with it; here it just returns on its wake-up
        with job.lock:  # its agent sees the exit ...
            job.dead.add(self.rank)
        job.allreduce.break_generation(watch.generation)  # ... as its connections close: a collective fails


class SimAgent(threading.Thread):
    """One node's agent, as NodeAgent's supervision loop: a look at its node (the board) every
    ``MONITOR_INTERVAL_S``; a store pass (:meth:`StoreLook.look`) every ``STORE_INTERVAL_S``, at once
    when its :class:`MoveWatch` (on a connection of its own) sees the job's generation move, and when
    the node's look finds a rank of its node dead, which it then replaces."""

    def __init__(self, job: WorkerJob, node: int) -> None:
        super().__init__(name=f"agent{node}", daemon=True)
        self.job = job
        self.node = node
        spec = job.spec
        self.own: Counter[str] = Counter()  # this agent's main connection's requests (its thread's only)
        self.first_pass = threading.Event()  # its first store pass is done
        self.steady_pass = threading.Event()  # a pass begun after every agent's first is done
        self.store = job.client(agent=True, own=self.own)
        self.local = list(range(node * spec.per_node, (node + 1) * spec.per_node))
        self.board = job.boards.get(node)
        self.look = StoreLook(
            self.store,
            node=node,
            nnodes=spec.nodes,
            node_timeout_s=30.0,
            agent_id=f"sim-agent-{node}",
            watch_nodes=spec.agent_watch_nodes,
            board=self.board,
            slots={rank: slot for slot, rank in enumerate(self.local)} if self.board else None,
        )
        self.store.set_node_owner(node, f"sim-agent-{node}")  # as NodeAgent does as it starts
        for rank in self.local:  # as NodeAgent.start_rank, before the rank's process starts
            self._first_beat(rank, 0)
        self.relay = None
        if spec.node_join:
            assert self.board is not None
            self.relay = JoinRelay(
                self.board,
                ranks=self.local,
                world_size=spec.world,
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
        job, spec, gen, looked_once = self.job, self.job.spec, 0, False
        # A real job's agents start seconds apart, so their passes fall at unrelated moments; these
        # start together, so each makes its second pass a phase of its own after its first, and
        # goes on once per interval from there, before the ranks start (a store that sees every
        # agent's pass in the same instant, and a window that holds one pass of this agent and two
        # of that one, would be artefacts of the simulator)
        interval = random.Random(self.node).uniform(0.0, STORE_INTERVAL_S)
        self.watch.start()
        if self.relay is not None:
            self.relay.start()
        try:
            while not job.shared.done.is_set():
                with job.lock:  # the node's look: a dead rank's exit code, and the board (no request)
                    lost = [r for r in self.local if r in job.dead]
                    job.dead.difference_update(lost)
                moved = self.watch.take()
                due = moved or lost or self.look.since_pass() >= interval
                # NodeAgent glances at its board every tick (for hangs, not simulated here); with a board
                # that glance asks for a store pass only before the first, so the simulated agent skips
                # it after that (~0.1 ms of an interpreter, 10 times a second per node)
                if due or ((not looked_once or self.board is None) and self.look.glance(self.local) is None):
                    start, before = time.perf_counter(), self.own.total()
                    steady = job.shared.agents_known.is_set()
                    look = self.look.look(gen, self.local)
                    job.looks.append(time.perf_counter() - start)
                    if not (moved or lost):  # an ordinary pass (its interval), not one for a move or death
                        job.passes.append((self.node, start, time.monotonic(), self.own.total() - before))
                    gen, looked_once = max(gen, look.current), True
                    if self.first_pass.is_set():  # the second pass on: once an interval
                        interval = STORE_INTERVAL_S
                    self.first_pass.set()
                    if steady:
                        self.steady_pass.set()
                for rank in lost:  # what ReplaceFailed does for a rank that exited: next generation, spare
                    if self.relay is not None:
                        self.relay.slot_lost(rank % spec.per_node)
                    gen = max(gen, self.store.generation())
                    # Only if no generation answered the death yet (its survivors may have moved on)
                    if self.store.member(rank) >= gen:
                        gen = self.store.advance_generation(gen, world_size=spec.world)
                    if self.relay is not None:
                        self.relay.slot_started(rank % spec.per_node)
                    self._first_beat(rank, gen)
                    self.store.set_member(rank, gen)
                    SimRank(job, rank, generation=gen, first_step=spec.kill_step).start()
                self.watch.pause(MONITOR_INTERVAL_S)
        except Exception as err:  # a bench thread's failure is reported in the table's place
            job.fail(f"agent {self.node}", err)
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
            self.board.write(rank % self.job.spec.per_node, beat, by_agent=True)
            self.look.published(rank, beat)
