"""NodeAgent: the per-node supervisor (the "training operator") of every tier.

One agent per node starts that node's ranks, watches them, and recovers the job
from faults. Node 0's agent hosts the job store (``ckless_lightning.comm.store``),
so losing any rank never loses the store; with ``cluster.store`` every agent joins a
standalone store (``python -m ckless_lightning.store``) instead, and node 0 is a node
like any other: losing it is a node loss, not the job's end.

The supervision loop: each pass observes the node and the job once
(:class:`~ckless_lightning.agent.policies.Observation`: the give-up reason, the
job's generation, each local rank's exit code and heartbeat, stale ranks, silent
nodes) and hands that to the tier's policy. Two cadences: every
``agent.monitor_interval`` (0.1 s) the agent looks at its node (exit codes, the
board's heartbeats: no store request); the store pass
(:class:`~ckless_lightning.agent.store_look.StoreLook`: two requests, the job's
generation and give-up, the other agents' beats, this agent's beat) runs every
``agent.store_interval`` (1 s), at once when the job's generation moves (a
:class:`~ckless_lightning.agent.move_watch.MoveWatch` thread blocked in the
store wakes the loop), and whenever the node's look finds something to act on
(a rank exited or is stale), so the policy decides on the job's current state.
The policy decides:

- :class:`~ckless_lightning.agent.policies.RestartAll` (tiers 0-2): on any fault
  the whole job moves to a new generation: every agent stops its ranks and
  starts them all again, and they resume from the last disk checkpoint;
- :class:`~ckless_lightning.agent.policies.ReplaceFailed` (tiers 3-4): only a
  failed or hung rank is replaced (warm spare first) in the job's current
  generation; survivors recover in-process and move on by themselves.

When all is well the pass keeps the batch cache reader running (tier 2+),
starts the warm spares once training runs and from then on keeps their pool
full (:class:`~ckless_lightning.agent.processes.SparePool`: a spare taken, dead
or stopped is replaced in the background, in a pass where every local rank
trains), fires due outside faults
(:class:`~ckless_lightning.runtime.outside_faults.OutsideFaultInjector`, and
``fault=chaos``'s :class:`~ckless_lightning.runtime.outside_faults.ChaosInjector`) and
sleeps ``agent.monitor_interval`` (less if the job's generation moves meanwhile).

A lost slot (``fault=slot_lost``: a rank's device gone, no spare) has no process: the agent
starts nothing in its place until the job completed ``fault.return_step``, then starts one in
the job's current generation (an elastic job trains without that rank's replica meanwhile,
and grows back once it is whole: :mod:`ckless_lightning.recovery.elastic`).

Detection: a rank process exits non-zero (its exit code or signal); a rank's
heartbeat goes stale (``agent.hang_timeout`` once it has done a step,
``agent.startup_timeout`` before: it is killed); another node's agent stops
beating for ``agent.node_timeout`` (node lost). The budget
(:class:`~ckless_lightning.agent.budget.RestartBudget`): more than
``agent.max_restarts`` restarts within ``agent.restart_window_s`` spends it:
every agent stops its ranks and exits with :data:`EXIT_FAULT_BUDGET`.

Reused rather than rewritten: the c10d ``TCPStore`` (as torchrun's
rendezvous), ``subprocess`` sessions for process lifetimes. torchelastic's
``LocalElasticAgent`` is not used because it restarts all workers of a node
as one unit and owns their store inside worker 0 on restart; tiers 3-4
replace single ranks and keep the store in the agent.
The agent never imports Lightning: the ranks and warm spares do.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from torch.distributed import DistNetworkError

from ckless_lightning.agent.batch_cache_service import BatchCacheService
from ckless_lightning.agent.budget import RestartBudget
from ckless_lightning.agent.fork_server import ForkServer
from ckless_lightning.agent.move_watch import MoveWatch
from ckless_lightning.agent.node_fence import NodeFence, end_store_requests
from ckless_lightning.agent.peer_reach import (
    PeerReach,
    ReachListener,
    Verdict,
    fence_cut_off,
    wait_for_replacement,
)
from ckless_lightning.agent.policies import (
    Action,
    Decision,
    Observation,
    ReplaceFailed,
    RestartAll,
    silence_limit,
)
from ckless_lightning.agent.processes import RankProcess, SparePool, is_stopped, reap
from ckless_lightning.agent.store_lease import NodeFenced
from ckless_lightning.agent.store_look import Look, StoreLook
from ckless_lightning.comm import Heartbeat, JobStore, StoreRefused
from ckless_lightning.comm.beat_board import BeatBoard
from ckless_lightning.comm.node_relay import JoinRelay
from ckless_lightning.record.events import EventLog
from ckless_lightning.runtime.config import JobConfig
from ckless_lightning.runtime.contract import ExitCode, RankSpec
from ckless_lightning.runtime.faults import FaultSpec
from ckless_lightning.runtime.outside_faults import ChaosInjector, OutsideFaultInjector

__all__ = ["EXIT_FAULT_BUDGET", "NodeAgent"]

EXIT_FAULT_BUDGET = ExitCode.FAULT_BUDGET


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class NodeAgent:
    """Supervises this node's ranks for the whole job. ``run()`` returns the process exit code.

    The policies act through :meth:`start_ranks`, :meth:`start_rank`, :meth:`stop_ranks` and
    :meth:`refill_spares_later` (the :class:`~ckless_lightning.agent.policies.Node` protocol).
    """

    def __init__(
        self,
        job: JobConfig,
        config_path: Path,
        *,
        prepared_path: Path | None,
        secret: str,
        start_step: int = 0,
        fork_server: ForkServer | None = None,
        reach_listener: ReachListener | None = None,
    ) -> None:
        """``prepared_path``: the packed dataset (tier 2's reader reads it; None: a user's DataModule,
        no batch cache); ``secret``: the job store's (:mod:`ckless_lightning.comm.secret`);
        ``start_step``: the optimizer step the job resumes from; ``fork_server``: one ``launch.py``
        started early (with ``agent.fork_server`` and none given, the agent starts its own);
        ``reach_listener``: answers peer probes (``agent/peer_reach.py``; None: no probes)."""
        self.job = job
        self.secret = secret
        self.agent_id = f"{socket.gethostname()}:{os.getpid()}"  # who acts as this node (ownership)
        self.cluster = job.cluster
        self.cfg = job.agent
        self.node = job.cluster.node_rank
        self.config_path = config_path
        self.run_dir = Path(job.run_dir)
        self.events = EventLog(self.run_dir / "events.jsonl", source=f"agent{self.node}")
        if fork_server is None and self.cfg.fork_server:
            fork_server = ForkServer(self.run_dir / "rank_logs" / f"forkserver{self.node}.log")
        self.fork_server = fork_server
        if self.fork_server is not None:
            self.fork_server.prepare(config_path, self.events)
        self.spares = SparePool(
            self.cfg.spares, config_path=config_path, events=self.events, fork_server=self.fork_server
        )
        self.ranks: dict[int, RankProcess] = {}
        first = self.node * self.cluster.nproc_per_node
        self.local_ranks = list(range(first, first + self.cluster.nproc_per_node))
        # The ranks' heartbeats: into shared memory this agent reads and publishes (comm/beat_board.py)
        self.board = BeatBoard.create(len(self.local_ranks)) if self.cfg.local_beats else None
        self.outside_faults = OutsideFaultInjector(
            [
                s
                for s in job.fault_specs()
                if s.injected_by == "outside"
                and s.rank in self.local_ranks
                and s.fault_type != "reader_stall"
            ],
            self.run_dir / "faults",
            self.events,
        )
        self.chaos = ChaosInjector(job.fault, self.node, self.events) if job.fault.type == "chaos" else None
        self.store: JobStore | None = None
        self.finished: set[int] = set()  # tiers 3-4: ranks that trained to the end, stopped by us
        self.store_port = 0
        self.batch_cache = BatchCacheService(
            job, prepared_path, self.local_ranks, self.events, start_step, fork_server=self.fork_server
        )
        self.lost_slots: dict[int, int | None] = {}  # rank -> the completed step its device is back after
        self._spares_due = False  # fill the spare pool once every local rank has done a step
        self._look: StoreLook | None = None  # this agent's passes' look at the store, once it has one
        self._watch: MoveWatch | None = None  # wakes the loop when the job's generation moves
        self._relay: JoinRelay | None = None  # the node's ranks join generations through it (tiers 3-4)
        self._fence: NodeFence | None = None  # a store silent for agent.fence_after: the ranks stop
        self._reach_listener = reach_listener
        self._reach: PeerReach | None = None  # which node is cut off from the others' peer network

    # -- lifecycle -----------------------------------------------------------
    def run(self) -> int:
        is_host = self.node == 0 and self.cluster.store is None
        if self.fork_server is not None:
            self.fork_server.start()  # if launch.py did not: imports while the store and the cache start
        host, port = self.cluster.store_address
        try:
            if is_host:
                self.store = JobStore.host(host, port, secret=self.secret)
            else:
                self.store = JobStore.connect(host, port, secret=self.secret)
        except StoreRefused as err:
            print(f"config error: {err}", file=sys.stderr)
            return ExitCode.CONFIG
        ended = self.store.job_ended()
        if ended is not None:
            code, _, run_dir = ended.partition(" ")
            print(
                f"config error: the job store at {host}:{port} served a job under this secret that ended "
                f"(exit {code}, run dir {run_dir}): a store serves one job, so that no job reads another's "
                "keys; start a new store (python -m ckless_lightning.store) or give this job its own "
                "CKLESS_JOB_SECRET",
                file=sys.stderr,
            )
            self.store = None
            return ExitCode.CONFIG
        self.store_port = self.store.port
        self._attach_store(self.store)
        self.store.set_node_owner(self.node, self.agent_id)
        if not is_host:  # a store in this process answers as long as the agent lives
            self._fence = NodeFence(self, self.store, self.cfg, self.cluster.store_address)
            self._fence.lease.start()
        if self._reach_listener is not None:
            assert self.cfg.probe_after is not None
            self._reach = PeerReach(
                self.store,
                self._reach_listener,
                agent_id=self.agent_id,
                node=self.node,
                nnodes=self.cluster.nnodes,
                probe_after_s=self.cfg.probe_after,
                connect=lambda: self.store.another_client(timeout_s=10.0),  # type: ignore[union-attr]
            )
            self._reach.register()
        if self.node == 0 and self.store.claim_job_start():  # not again by a replacement of node 0
            self.events.emit(
                "job_start",
                tier=self.job.tier,
                world_size=self.cluster.world_size,
                nnodes=self.cluster.nnodes,
            )
        code = 1
        try:
            self.batch_cache.start()
            code = self._supervise()
        except DistNetworkError as err:  # the store's host is gone (node 0's agent, or the standalone store)
            code = self._store_lost(host, port, err)
        except KeyboardInterrupt as interrupt:
            signum = int(interrupt.args[0]) if interrupt.args else int(signal.SIGINT)
            # Before the ranks stop: what they do from now on (peers vanish) is the job ending, not a fault.
            self.events.emit("interrupted", node=self.node, signal=signal.Signals(signum).name)
            self.stop_ranks(graceful=True)
            print(
                f"interrupted: stopped all {len(self.local_ranks)} ranks of node {self.node}", file=sys.stderr
            )
            code = 128 + signum
        finally:
            if self.node == 0:
                self.events.emit("job_end", exit_code=code)
                self._mark_ended(code)
            self.stop_ranks(graceful=False)
            self.close_processes()
            if self._fence is not None:
                self._fence.lease.stop()
            self._stop_watch(release=is_host)  # (if the job's end did not already)
            if not is_host:
                end_store_requests(self.cluster.store_address, self.node)
            if self.board is not None:  # after the node relay, which uses it
                self.board.close()
            self.store = None  # drops the TCPStore: node 0's server closes its port
        return code

    def _attach_store(self, store: JobStore) -> None:
        """Use ``store`` (hosted or joined) from now on: this agent's passes' look at it."""
        self.store = store
        self._look = StoreLook(
            store,
            node=self.node,
            nnodes=self.cluster.nnodes,
            node_timeout_s=self.cfg.node_timeout,
            agent_id=self.agent_id,
            watch_nodes=self.cfg.watch_nodes,
            board=self.board,
            slots={rank: slot for slot, rank in enumerate(self.local_ranks)} if self.board else None,
        )

    def rank_pids(self) -> list[int]:
        """The local rank processes' pids (:class:`~ckless_lightning.agent.node_fence.FencedNode`)."""
        return [proc.pid for proc in list(self.ranks.values())]

    def kill_ranks(self) -> None:
        """SIGKILL every local rank process (``FencedNode``; also from the lease's thread)."""
        for proc in list(self.ranks.values()):
            proc.kill()

    def close_processes(self) -> None:
        """Stop the spares, the fork server and the batch cache reader (``FencedNode``)."""
        self.spares.close()
        if self.fork_server is not None:
            self.fork_server.close()
        self.batch_cache.close()

    def _node_relay(self, gen: int) -> JoinRelay | None:
        """Tiers 3-4 with a heartbeat board: the node's ranks join generations through this agent
        (``comm/node_relay.py``); None: they join through the store."""
        if self.board is None or self.job.tier < 3:
            return None
        assert self.store is not None
        return JoinRelay(
            self.board,
            ranks=self.local_ranks,
            world_size=self.cluster.world_size,
            store=self.store.another_client(),
            waiter=self.store.another_client(),
            generation=gen,
            announce=lambda new: self.events.emit("generation", gen=new, reason="fault"),
        )

    def ranks_lost(self, ranks: Iterable[int]) -> None:
        """``ranks`` (local) died: the node relay counts nothing for them until they are started again."""
        if self._relay is not None:
            for rank in ranks:
                self._relay.slot_lost(self.local_ranks.index(rank))

    def _stop_watch(self, *, release: bool) -> None:
        """End the node relay and the move watch as the agent leaves, before the store connection goes
        (bounded: :meth:`JoinRelay.stop`, :meth:`MoveWatch.stop`). ``release``: the job is over for
        every agent (or the store closes with this agent, its host): end every agent's watch now."""
        if self._relay is not None:
            try:
                self._relay.stop()
            except RuntimeError as err:  # the store failed: the relay's threads end with their connections
                print(f"[agent{self.node}] could not end the node relay ({err})", file=sys.stderr)
            self._relay = None
        if self._watch is None:
            return
        try:
            self._watch.stop(release=self.store if release else None)
        except RuntimeError as err:  # the store failed: the watch's thread ends with its connection
            print(f"[agent{self.node}] could not release the move watch ({err})", file=sys.stderr)
        self._watch = None

    def _pause(self) -> None:
        """Sleep ``agent.monitor_interval``, less if the job's generation moves meanwhile."""
        if self._watch is None:
            time.sleep(self.cfg.monitor_interval)
        else:
            self._watch.pause(self.cfg.monitor_interval)

    def local_beats(self, ranks: list[int]) -> dict[int, Heartbeat]:
        """This node's ranks' latest heartbeats (from the board, fresher than the store's copy)."""
        assert self.store is not None
        if self.board is None:
            return self.store.rank_heartbeats(ranks)
        slots = {rank: self.local_ranks.index(rank) for rank in ranks}
        beats = {rank: self.board.read(slot) for rank, slot in slots.items()}
        missing = [rank for rank, beat in beats.items() if beat is None]
        return {**beats, **(self.store.rank_heartbeats(missing) if missing else {})}  # type: ignore[dict-item]

    def local_where(self, ranks: list[int]) -> dict[int, str]:
        """Where ``ranks`` last said their main threads were (``recovery/where.py``), for the hang
        blame; ranks that never said are left out. Read from the board (no store request when every
        one of ``ranks`` is on it); the store's ``where/<rank>`` for the others, and for all of them
        with ``agent.local_beats=false``."""
        assert self.store is not None
        if self.board is None:
            return self.store.rank_where(ranks)
        board = self.board
        where = {r: board.read_where(self.local_ranks.index(r)) for r in ranks if r in self.local_ranks}
        missing = [r for r in ranks if where.get(r) is None]
        found = {r: w for r, w in where.items() if w is not None}
        return {**found, **(self.store.rank_where(missing) if missing else {})}

    def restart_hang_clock(self, rank: int, beat: Heartbeat) -> None:
        """Give local ``rank`` a fresh silence limit: ``beat`` (its own, timed now) on its behalf."""
        assert self.store is not None
        if self.board is None:
            self.store.set_rank_heartbeat(rank, beat)
        else:  # the agent's record of its slot; the next pass publishes it
            self.board.write(self.local_ranks.index(rank), beat, by_agent=True)

    def _mark_ended(self, code: int) -> None:
        """Node 0's agent, still its owner, records the job's end in the store (a standalone store
        then refuses a second job under the same secret, which would read this job's keys)."""
        if self.store is None or self.cluster.store is None:
            return  # a store this agent hosts closes with it
        try:
            if self.store.node_owner(0) == self.agent_id:
                self.store.mark_job_ended(code, str(self.run_dir))
        except (DistNetworkError, RuntimeError) as err:  # the store is gone: nothing to protect
            print(f"[agent0] could not record the job's end in the store ({err})", file=sys.stderr)

    def _store_lost(self, host: str, port: int, err: BaseException) -> int:
        """The job store stopped answering: nothing can be coordinated any more; requeue."""
        where = "node 0's agent, which hosts it" if self.cluster.store is None else "the standalone store"
        self.events.emit("store_lost", node=self.node, error=f"{type(err).__name__}: {err}"[:300])
        print(
            f"giving up: lost the job store at {host}:{port} ({where}, is gone: {type(err).__name__}); "
            f"exit code {EXIT_FAULT_BUDGET} (requeue: the job resumes from its last checkpoint)",
            file=sys.stderr,
        )
        return EXIT_FAULT_BUDGET

    def _taken_over(self) -> int:
        """Another agent (a standby) took this node over while this one was silent: leave it the node."""
        assert self.store is not None
        owner = self.store.node_owner(self.node)
        self.stop_ranks(graceful=False)
        self.events.emit("agent_replaced", node=self.node, by=owner)
        print(
            f"node {self.node} was taken over by agent {owner} while this agent was silent; leaving",
            file=sys.stderr,
        )
        return ExitCode.OK

    def _supervise(self) -> int:
        """The supervision loop: observe, let the tier's policy decide, carry the decision out."""
        assert self.store is not None
        budget = RestartBudget(self.store, self.cfg, self.events, world_size=self.cluster.world_size)
        gen = self._join_generation(budget)
        if gen is None:
            return self._give_up_exit()
        policy = (RestartAll if self.job.tier < 3 else ReplaceFailed)(self, self.store, budget)
        self._relay = self._node_relay(gen)
        self._watch = MoveWatch(
            self.store.another_client(),
            gen,
            name=f"agent{self.node}-move-watch",
            on_moved=self._relay.moved if self._relay is not None else None,
        )
        self._watch.start()
        if self._relay is not None:
            self._relay.start()
        self.start_ranks(gen)
        self.refill_spares_later()
        while True:
            try:
                gen, code = self._supervise_step(policy, gen)
            except NodeFenced as fenced:  # a store pass decides first (agent/store_lease.py)
                print(f"[agent{self.node}] {fenced}", file=sys.stderr)
                self._pause()
                continue
            if code is not None:
                return code

    def _supervise_step(self, policy: RestartAll | ReplaceFailed, gen: int) -> tuple[int, int | None]:
        """One turn of :meth:`_supervise`'s loop: the generation to go on in, and the exit code when
        the agent is done (None: go on)."""
        obs = self._observe(gen)
        if obs is None:
            return gen, self._taken_over()
        if self._reach is not None and (verdict := self._check_peers(gen, obs)) is not None:
            return gen, self._leave_cut_off(gen, verdict)
        decision = policy.decide(obs)
        gen = decision.generation
        if decision.action is Action.DONE:
            decision = self._wait_for_other_nodes(gen)
            if decision.action is Action.DONE:
                if self.node == 0:  # it waited for every node: the job is over for every agent
                    self._stop_watch(release=True)
                return gen, 0
        if decision.action is Action.GIVE_UP:
            policy.give_up(gen)
            return gen, self._give_up_exit()
        if decision.action is Action.NEXT_GENERATION:
            moved = policy.move_on(gen, decision.target)
            if moved is None:
                return gen, self._give_up_exit()
            gen = moved
        elif decision.action is Action.WATCH:
            self._tend(gen, obs.beats)
            self._pause()
        # Action.CONTINUE: the policy acted; observe again at once
        return gen, None

    def _check_peers(self, gen: int, obs: Observation) -> Verdict | None:
        """Probe the other agents once ranks have been silent in a step for ``agent.probe_after``
        (``agent/peer_reach.py``); the verdict when it says this node is cut off from the others. When
        it says another node is, the live local ranks get a fresh hang timeout for the job's move."""
        assert self._reach is not None
        running = [rank for rank, code in obs.codes.items() if code is None]
        if self._reach.suspects(obs.now, obs.beats, running):
            self._reach.check(gen)
        verdict = self._reach.take()
        if verdict is None or verdict.gen != gen or not verdict.cut_off:
            return None
        if self.node in verdict.cut_off:
            return verdict
        self.events.emit(
            "peers_cut_off", node=self.node, cut_off=list(verdict.cut_off), gen=gen, round=verdict.round
        )
        now = time.time()
        for rank in running:
            beat = obs.beats[rank]
            self.restart_hang_clock(rank, Heartbeat(beat.gen, beat.completed_step, now, beat.phase))
        return None

    def _leave_cut_off(self, gen: int, verdict: Verdict) -> int:
        """The job's verdict: this node is cut off from the others. Kill its ranks, give the node up
        (:meth:`StoreLook.release`: the job moves on and a standby claims it without waiting for
        ``agent.node_timeout``), and wait until the job no longer needs it (taken over: exit 0; given
        up; done)."""
        assert self.store is not None and self._look is not None
        fence_cut_off(self, verdict)
        self._look.release(gen)
        lease = self._fence.lease if self._fence is not None else None
        how = wait_for_replacement(
            self.store,
            self.node,
            self.agent_id,
            interval_s=self.cfg.store_interval,
            renewed=(lambda: lease.renew() and None) if lease is not None else (lambda: None),
            others=[n for n in range(self.cluster.nnodes) if n != self.node],
            silent_s=2 * self.cfg.node_timeout,
            hosting=self._fence is None,  # an agent that hosts the store keeps it open to the end
        )
        if how == "taken":
            return self._taken_over()
        if how == "lost":
            print(
                f"[agent{self.node}] no other node's agent beat for {2 * self.cfg.node_timeout:g} s "
                f"(2 x agent.node_timeout) while this cut-off node waited to be replaced: the job is gone; "
                f"exit code {EXIT_FAULT_BUDGET} (requeue)",
                file=sys.stderr,
            )
            return EXIT_FAULT_BUDGET
        return self._give_up_exit() if how == "giveup" else ExitCode.OK

    def _observe(self, gen: int) -> Observation | None:
        """One pass's look; acts on nothing. None: another agent (a standby) took this node over while
        this one was silent (nothing was written).

        The node's look (exit codes, the board's beats; no store request) with what the last store
        pass read of the job; a store pass (:meth:`StoreLook.look`, writing this agent's heartbeat
        in ``gen``) instead once ``agent.store_interval`` has passed since the last one, at once when
        the move watch saw the job's generation move, and again when the node's look finds
        something the policy acts on (a rank exited or is stale, or all finished): it then decides
        on the job's current generation and give-up."""
        assert self._look is not None
        ranks = [r for r in self.local_ranks if r not in self.lost_slots]
        moved = self._watch is not None and self._watch.take()
        fenced = self._fence is not None and self._fence.lease.fenced  # only a store pass ends a fence
        if not moved and not fenced and self._look.since_pass() < self.cfg.store_interval:
            now = time.time()
            glance = self._look.glance(ranks)
            if glance is not None:
                obs = self._observation(gen, now, glance)
                if not (obs.failed or obs.stale or obs.all_exited_ok):
                    return obs
        now = time.time()
        look = self._look.look(gen, ranks)
        if self._fence is not None and self._fence.lease.renew():
            self.events.emit("unfenced", node=self.node, owned=look.owned)
            print(f"[agent{self.node}] the job store answers again", file=sys.stderr)
        if not look.owned:
            return None
        return self._observation(gen, now, look)

    def _observation(self, gen: int, now: float, look: Look) -> Observation:
        """The pass's observation from ``look`` (begun at ``now``) and the ranks' exit codes."""
        codes = {rank: proc.poll() for rank, proc in self.ranks.items()}
        codes.update({rank: 0 for rank in self.finished})
        cfg = self.cfg
        stale = tuple(
            rank
            for rank, beat in look.beats.items()
            if codes[rank] is None
            and (now - beat.time > silence_limit(beat, cfg) or is_stopped(self.ranks[rank].pid))
        )
        return Observation(
            gen=gen,
            now=now,
            giveup=look.giveup,
            current=look.current,
            codes=codes,
            beats=look.beats,
            stale=stale,
            silent_nodes=look.silent_nodes,
        )

    def _tend(self, gen: int, beats: Mapping[int, Heartbeat]) -> None:
        """All is well: fire due outside faults, keep the batch cache reader running, tend the spares."""
        # First, so that the fault hits the step the heartbeats just read say is in progress (the
        # other work of the pass took long enough, under load, for a fast step to end first).
        self.outside_faults.inject_due(
            gen,
            beats,
            pid_of=lambda rank: self.ranks[rank].pid,
            kill_ranks=self.kill_ranks,
            lose_slot=self._lose_slot,
        )
        self.batch_cache.keep_running()
        self._return_slots()
        # New spares start only while every local rank trains (or stands by, elastic): not while
        # ranks start or recover.
        training = all(
            beat.completed_step >= 0 and beat.phase in ("step", "standby") for beat in beats.values()
        )
        if self._spares_due and training:
            self.spares.fill()
            self._spares_due = False
        self.spares.tend(start=training)  # replaces a spare taken, dead or stopped (once filled)
        if self.fork_server is not None:
            self.fork_server.tend()  # replaces a fork server that died or was stopped
        if self.chaos is not None:
            self.chaos.inject_due(gen, self._live_processes(), beats)

    def _lose_slot(self, spec: FaultSpec) -> None:
        """``fault=slot_lost``: rank ``spec.rank``'s device is gone: kill the rank, start nothing for it
        until the job completed ``spec.return_step`` (:meth:`_return_slots`)."""
        proc = self.ranks.pop(spec.rank)
        proc.kill()
        reap(proc.proc, f"rank {spec.rank}")
        self.lost_slots[spec.rank] = spec.return_step
        self.events.emit("slot_lost", rank=spec.rank, node=self.node, return_step=spec.return_step)
        back = "never" if spec.return_step is None else f"once step {spec.return_step} is complete"
        print(
            f"[agent{self.node}] rank {spec.rank}'s device is lost (fault=slot_lost): nothing replaces it; "
            f"it comes back {back}",
            file=sys.stderr,
        )

    def _return_slots(self) -> None:
        """Start a process for each lost slot whose device is back (the job completed its return step),
        in the job's current generation."""
        due = [rank for rank, back in self.lost_slots.items() if back is not None]
        if not due:
            return
        assert self.store is not None
        beats = self.store.rank_heartbeats(list(range(self.cluster.world_size)))
        completed = max(beat.completed_step for beat in beats.values())
        for rank in due:
            if completed < self.lost_slots[rank]:  # type: ignore[operator]
                continue
            del self.lost_slots[rank]
            gen = self.store.generation()
            self.start_rank(rank, gen)
            self.events.emit("slot_returned", rank=rank, node=self.node, gen=gen, completed_step=completed)
            self.emit_ranks_started(gen, [rank])
            print(
                f"[agent{self.node}] rank {rank}'s device is back after step {completed}: started it in "
                f"generation {gen}",
                file=sys.stderr,
            )

    def _live_processes(self) -> dict[str, dict[int, int]]:
        """This node's live processes by kind (chaos targets): ranks by rank, spares and reader by pid."""
        reader = self.batch_cache.reader
        return {
            "rank": {rank: proc.pid for rank, proc in self.ranks.items() if proc.poll() is None},
            "spare": {pid: pid for pid in self.spares.pids},
            "reader": {reader.pid: reader.pid} if reader is not None and reader.poll() is None else {},
            "forkserver": {pid: pid for pid in [self.fork_server.pid] if pid is not None}
            if self.fork_server is not None
            else {},
        }

    def _join_generation(self, budget: RestartBudget) -> int | None:
        """The generation to start in; a replacement node whose predecessor ran it asks for a new one."""
        assert self.store is not None
        gen = self.store.generation()
        if self.store.was_started(gen, self.node):
            self.events.emit("node_rejoined", node=self.node, gen=gen)
            return budget.advance(gen)
        return gen

    def _wait_for_other_nodes(self, gen: int) -> Decision:
        """This node's ranks are done; node 0 keeps the store up until every node is done.

        Returns DONE, GIVE_UP, or NEXT_GENERATION with the job's new generation as
        target if another node failed meanwhile: this node reruns it too (a cheap
        resume from the final checkpoint).
        """
        assert self.store is not None
        self.store.mark_done(gen, self.node)
        if self.node != 0:
            return Decision(Action.DONE, gen)
        nodes = list(range(self.cluster.nnodes))
        if self.job.elastic.enabled:  # a node with no rank in the generation's set has nothing to finish
            per_node = self.cluster.nproc_per_node  # (one lost, or cut off, with no standby: a shrink)
            nodes = sorted(
                {rank // per_node for rank in self.store.active_ranks(gen, self.cluster.world_size)}
            )
        while not self.store.nodes_done(gen, nodes):
            if self._watch is not None:
                self._watch.take()  # what woke the last pause (a move, a give-up) is read below
            if self.store.giveup_reason() is not None:
                return Decision(Action.GIVE_UP, gen)
            if (current := self.store.generation()) > gen:
                return Decision(Action.NEXT_GENERATION, gen, target=current)
            assert self._look is not None
            if self._look.since_beat() >= self.cfg.store_interval:  # beats once a store pass would
                self._look.beat(gen)
            self._pause()
        return Decision(Action.DONE, gen)

    def _give_up_exit(self) -> int:
        """The job is given up: the exit code given with its reason (a rank's config error: 2), else
        :data:`EXIT_FAULT_BUDGET` (requeue)."""
        assert self.store is not None
        self._stop_watch(release=True)  # the job is over for every agent
        reason = self.store.giveup_reason() or "fault budget spent"
        code = self.store.giveup_code() or EXIT_FAULT_BUDGET
        self.events.emit("giveup", reason=reason, exit_code=code)
        print(f"giving up: {reason}; exit code {code}", file=sys.stderr)
        return code

    # -- ranks -----------------------------------------------------------------
    def start_ranks(self, gen: int) -> None:
        """Start every local rank (but lost slots) in generation ``gen``; emits ``ranks_started``."""
        assert self.store is not None
        ranks = [r for r in self.local_ranks if r not in self.lost_slots]
        for rank in ranks:
            self.start_rank(rank, gen)
        self.store.mark_started(gen, self.node)
        self.emit_ranks_started(gen, ranks)

    def emit_ranks_started(self, gen: int, ranks: list[int]) -> None:
        """The ``ranks_started`` event of ``ranks``, just started in ``gen`` (how each started)."""
        self.events.emit(
            "ranks_started",
            gen=gen,
            node=self.node,
            ranks=ranks,
            pids=[self.ranks[r].pid for r in ranks],
            warm=[self.ranks[r].warm for r in ranks],
            forked=[self.ranks[r].forked for r in ranks],
        )

    def start_rank(self, rank: int, gen: int) -> RankProcess:
        """Start ``rank``'s process in generation ``gen``: a warm spare if one is ready, else one forked
        by the fork server (``agent.fork_server``), else a cold one.

        Writes the rank's first heartbeat (step -1, now) and its membership; emits nothing.
        """
        assert self.store is not None
        if self._fence is not None and self._fence.lease.fenced:
            raise NodeFenced(
                f"not starting rank {rank} in generation {gen}: no answer from the job store for "
                f"{self._fence.lease.silent_s():.1f} s; the next store pass decides whether the node is ours"
            )
        if self.job.comm.rootless:
            master_port = self.store_port
        elif self.node == 0:
            master_port = (
                self.store.master_port(gen)
                if self.store.has_master_port(gen)
                else _free_port(self.cluster.master_addr)
            )
            self.store.publish_master_port(gen, master_port)
        else:
            master_port = self.store.master_port(gen)
        if self._relay is not None:
            self._relay.slot_started(self.local_ranks.index(rank))
        argv = ["--config", str(self.config_path)]
        spec = RankSpec(
            global_rank=rank,
            local_rank=self.local_ranks.index(rank),
            world_size=self.cluster.world_size,
            local_world_size=self.cluster.nproc_per_node,
            node_rank=self.node,
            master_addr=self.cluster.master_addr,
            master_port=master_port,
            generation=gen,
            store_addr=self.cluster.store_address[0],
            store_port=self.store_port,
            store_secret=self.secret,
            batch_cache=str(self.batch_cache.root) if self.batch_cache.root else None,
            beat_board=self.board.path if self.board is not None else None,
        )
        beat = Heartbeat(gen, -1, time.time())
        self.store.set_rank_heartbeat(rank, beat)
        if self.board is not None:
            self.board.write(self.local_ranks.index(rank), beat, by_agent=True)
            if self._look is not None:
                self._look.published(rank, beat)
        self.store.set_member(rank, gen)
        spare = self.spares.take()
        log_dir = self.run_dir / "rank_logs"
        forked = None
        if spare is None and self.fork_server is not None:
            forked = RankProcess.fork(spec, self.fork_server, argv, log_dir)
        if spare is not None:
            self.ranks[rank] = RankProcess.adopt(spec, spare, argv, log_dir)
        elif forked is not None:
            self.ranks[rank] = forked
        else:
            command = [sys.executable, "-m", "ckless_lightning.rank", *argv]
            self.ranks[rank] = RankProcess.spawn(spec, command, log_dir)
        return self.ranks[rank]

    def stop_ranks(self, *, graceful: bool, generation: int | None = None) -> None:
        """Stop every local rank (SIGTERM and ``agent.stop_grace_s`` if ``graceful``, else SIGKILL) and
        forget them; with ``generation``, emit ``ranks_stopped`` for it."""
        if not self.ranks:
            return
        grace = self.cfg.stop_grace_s if graceful else 0.0
        for proc in self.ranks.values():
            proc.stop(grace)
        if generation is not None:
            self.events.emit("ranks_stopped", gen=generation, node=self.node, ranks=sorted(self.ranks))
        self.ranks.clear()

    def refill_spares_later(self) -> None:
        """Fill the warm spare pool once every local rank has done a step (not while ranks start).

        The first call starts the pool; afterwards the pool refills itself at every pass in which
        the ranks train (:meth:`_tend`), and this only confirms it."""
        self._spares_due = self.cfg.spares > 0
