"""NodeAgent: the per-node supervisor (the "training operator") of tiers 0 and 1.

One agent per node starts that node's ranks, watches them, and on a fault
moves the whole job to a new generation: every agent stops its ranks and
starts them again, and they resume from the last disk checkpoint. Node 0's
agent hosts the job store (``ckless_lightning.comm.store``), so losing any rank
never loses the store.

Detection: a rank process exits non-zero (its exit code or signal); a rank's
heartbeat goes stale (``agent.hang_timeout`` once it has done a step,
``agent.startup_timeout`` before: it is killed); another node's agent stops
beating for ``agent.node_timeout`` (node lost). More than ``agent.max_restarts``
restarts within ``agent.restart_window_s`` spends the fault budget: every
agent stops its ranks and exits with :data:`EXIT_FAULT_BUDGET`.

Reused rather than rewritten: the c10d ``TCPStore`` (as torchrun's
rendezvous), ``subprocess`` sessions for process lifetimes. torchelastic's
``LocalElasticAgent`` is not used because it restarts all workers of a node
as one unit and owns their store inside worker 0 on restart; the later tiers
need to replace single ranks and keep the store in the agent.
The agent never imports Lightning: the ranks and warm spares do.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ckless_lightning.agent.batch_cache_service import BatchCacheService
from ckless_lightning.agent.processes import RankProcess, RankSpec, SparePool
from ckless_lightning.comm import Heartbeat, JobStore, connect_store
from ckless_lightning.config import JobConfig
from ckless_lightning.events import EventLog
from ckless_lightning.faults import FaultSpec, claim_fault, injected_event, plan_faults
from ckless_lightning.rank import EXIT_PEER_FAILED

__all__ = ["EXIT_FAULT_BUDGET", "NodeAgent"]

EXIT_FAULT_BUDGET = 75  # EX_TEMPFAIL: "try again later" - the scheduler may requeue the job
_SETTLE_S = 0.3  # after a first failure, collect the cascade before blaming one rank
# Tiers 3-4: survivors stay alive, so there is little cascade to wait for; a replacement is urgent.
_SETTLE_IN_PROCESS_S = 0.05
_PEER_REPORT_S = 2.0  # how long to wait for the agent of a remote culprit to report it


@dataclass(frozen=True)
class _Outcome:
    kind: str  # "done" | "fault" | "generation" | "giveup"
    generation: int | None = None


def _blame_class(code: int) -> int:
    """Order of suspicion for a rank's exit code: 0 killed (not SIGABRT), 1 its own error, 2 SIGABRT,
    3 lost a peer."""
    if code == -signal.SIGABRT:
        return 2
    if code < 0:
        return 0
    return 3 if code == EXIT_PEER_FAILED else 1


def _process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (R, S, D, T, Z...); "?" where unavailable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class NodeAgent:
    """Supervises this node's ranks for the whole job. ``run()`` returns the process exit code."""

    def __init__(
        self, job: JobConfig, config_path: Path, *, prepared_path: Path, start_step: int = 0
    ) -> None:
        """``prepared_path``: the packed dataset (tier 2's reader reads it); ``start_step``: the
        optimizer step the job resumes from."""
        self.job = job
        self.cluster = job.cluster
        self.cfg = job.agent
        self.node = job.cluster.node_rank
        self.config_path = config_path
        self.run_dir = Path(job.run_dir)
        self.events = EventLog(self.run_dir / "events.jsonl", source=f"agent{self.node}")
        self.spares = SparePool(self.cfg.spares)
        self.ranks: dict[int, RankProcess] = {}
        first = self.node * self.cluster.nproc_per_node
        self.local_ranks = list(range(first, first + self.cluster.nproc_per_node))
        specs = plan_faults(
            job.fault,
            world_size=self.cluster.world_size,
            nnodes=self.cluster.nnodes,
            nproc_per_node=self.cluster.nproc_per_node,
            max_steps=job.trainer.max_steps,
        )
        self.outside_faults = [s for s in specs if s.injected_by == "outside" and s.rank in self.local_ranks]
        self.store: JobStore | None = None
        self._lost_nodes: set[int] = set()
        self._finished: set[int] = set()  # tiers 3-4: ranks that trained to the end, stopped by us
        self.store_port = 0
        self.batch_cache = BatchCacheService(job, prepared_path, self.local_ranks, self.events, start_step)

    # -- lifecycle -----------------------------------------------------------
    def run(self) -> int:
        is_host = self.node == 0
        port = self.cluster.master_port
        if is_host and port == 0:
            port = _free_port()
        self.store = JobStore(connect_store(self.cluster.master_addr, port, is_master=is_host))
        self.store_port = self.store.port
        if is_host:
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
        except KeyboardInterrupt as interrupt:
            signum = int(interrupt.args[0]) if interrupt.args else int(signal.SIGINT)
            self._stop_ranks(graceful=True)
            print(
                f"interrupted: stopped all {len(self.local_ranks)} ranks of node {self.node}", file=sys.stderr
            )
            code = 128 + signum
        finally:
            if is_host:
                self.events.emit("job_end", exit_code=code)
            self._stop_ranks(graceful=False)
            self.spares.close()
            self.batch_cache.close()
            self.store = None  # drops the TCPStore: node 0's server closes its port
        return code

    def _supervise(self) -> int:
        assert self.store is not None
        gen = self._join_generation()
        if gen is None:
            return self._give_up_exit()
        if self.job.tier >= 3:
            return self._supervise_in_process(gen)
        while True:
            self._start_ranks(gen)
            outcome = self._monitor(gen)
            if outcome.kind == "done":
                outcome = self._wait_for_other_nodes(gen)
                if outcome.kind == "done":
                    return 0
            self._stop_ranks(graceful=False, generation=gen)
            if outcome.kind == "giveup":
                return self._give_up_exit()
            if outcome.kind == "fault":
                next_gen = self._next_generation(gen)
                if next_gen is None:
                    return self._give_up_exit()
                gen = next_gen
            else:
                assert outcome.generation is not None
                gen = outcome.generation

    def _supervise_in_process(self, gen: int) -> int:
        """Tiers 3-4: replace only failed ranks; survivors move to the next generation by themselves.

        A rank that fails inside its own code recovers in-process and moves the
        job on itself; a dead or hung rank is replaced (warm spare first) in the
        job's current generation, after moving the job on if nobody has yet.
        """
        assert self.store is not None
        self._start_ranks(gen)
        spares_filled = self.cfg.spares == 0
        while True:
            now = time.time()
            self.store.set_agent_heartbeat(self.node, gen)
            if self.store.giveup_reason() is not None:
                return self._give_up_exit()
            current = self.store.generation()
            if current > gen:
                if self._budget_spent(current):
                    return self._give_up_exit()
                gen = current
            codes = {rank: proc.poll() for rank, proc in self.ranks.items()}
            codes.update({rank: 0 for rank in self._finished})
            failed = [rank for rank, code in codes.items() if code not in (None, 0)]
            if failed:
                time.sleep(_SETTLE_IN_PROCESS_S)  # a peer aborting with the dead one shows itself
                next_gen = self._replace_failed(gen)
                if next_gen is None:
                    return self._give_up_exit()
                gen = next_gen
                spares_filled = self.cfg.spares == 0
                continue
            if all(code == 0 for code in codes.values()):
                outcome = self._wait_for_other_nodes(gen)
                if outcome.kind == "done":
                    return 0
                if outcome.kind == "giveup":
                    return self._give_up_exit()
                # Another node failed after ours finished: our ranks rejoin (resuming from disk).
                assert outcome.generation is not None
                gen = outcome.generation
                self._stop_ranks(graceful=False)
                self._start_ranks(gen)
                continue
            beats = self.store.rank_heartbeats(self.local_ranks)
            stale = self._stale(codes, beats, now)
            stuck = [r for r in stale if beats[r].step >= self.job.trainer.max_steps]
            for rank in stuck:  # trained to the end but did not exit: done, not hung
                print(
                    f"[agent{self.node}] rank {rank} finished training but did not exit; killed it",
                    file=sys.stderr,
                )
                self.ranks[rank].stop(0)
                self._finished.add(rank)
            stale = [r for r in stale if r not in stuck]
            if stale:
                hung = self._report_hang(gen, stale, beats)
                self.ranks[hung].proc.wait()  # SIGKILLed: replaced on the next pass
                continue
            if self._lost_node(gen, now):
                next_gen = self._next_generation(gen)
                if next_gen is None:
                    return self._give_up_exit()
                gen = next_gen
                continue
            self.batch_cache.keep_running()
            if not spares_filled and all(beat.step >= 0 for beat in beats.values()):
                self.spares.fill()
                spares_filled = True
            self._inject_outside_faults(gen, beats)
            time.sleep(self.cfg.monitor_interval)

    def _replace_failed(self, gen: int) -> int | None:
        """Report and replace each failed rank; returns the generation they joined (None: give up).

        A rank whose process belonged to an older generation than the current one
        died of a fault the job has already moved past (survivors noticed first):
        no new generation for it. Otherwise the job moves on once, here.
        """
        assert self.store is not None
        failed = {
            rank: code
            for rank, proc in self.ranks.items()
            if (code := proc.poll()) not in (None, 0) and rank not in self._finished
        }
        self._restart_hang_clocks()
        current = max(gen, self.store.generation())
        member = {rank: self.store.member(rank) for rank in failed}
        if any(member[rank] >= current for rank in failed):
            next_gen = self._next_generation(current)
            if next_gen is None:
                return None
            current = next_gen
        for rank in sorted(failed, key=lambda r: (_blame_class(failed[r]), r)):
            code = failed[rank]
            self.events.emit(
                "fault_detected",
                by=f"agent{self.node}",
                rank=rank,
                reason="exit",
                exit_code=code,
                signal=signal.Signals(-code).name if code < 0 else None,
                failed_ranks=sorted(failed),
                last_step=self.store.rank_heartbeats([rank])[rank].step,
                gen=member[rank],  # the generation the dead process was in
            )
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            print(
                f"[agent{self.node}] rank {rank} {how}; replacing it in generation {current}. "
                f"Last lines of its log:\n{self.ranks[rank].log_tail(15)}",
                file=sys.stderr,
            )
            self.ranks[rank].stop(0)
            proc = self._start_rank(rank, current)
            self.events.emit(
                "ranks_started", gen=current, node=self.node, ranks=[rank], pids=[proc.pid], warm=[proc.warm]
            )
        return current

    def _restart_hang_clocks(self) -> None:
        """A recovery begins: give every live local rank a full ``hang_timeout`` from now.

        Survivors blocked on a failed peer stop beating until they notice it
        (milliseconds to seconds); without this they could be taken for hung.
        """
        assert self.store is not None
        beats = self.store.rank_heartbeats(self.local_ranks)
        now = time.time()
        for rank, proc in self.ranks.items():
            if proc.poll() is None:
                self.store.set_rank_heartbeat(rank, Heartbeat(beats[rank].gen, beats[rank].step, now))

    def _recent_restarts(self, up_to_gen: int) -> list[float]:
        """Start times of generations 1..``up_to_gen`` within ``agent.restart_window_s``."""
        assert self.store is not None
        window_start = time.time() - self.cfg.restart_window_s
        return [t for t in self.store.restart_times(up_to_gen) if t >= window_start]

    def _stale(self, codes: dict[int, int | None], beats: dict[int, Heartbeat], now: float) -> list[int]:
        """Live ranks whose heartbeat is older than the startup (before step 1) or hang timeout."""
        return [
            rank
            for rank, beat in beats.items()
            if codes[rank] is None
            and now - beat.time > (self.cfg.startup_timeout if beat.step < 0 else self.cfg.hang_timeout)
        ]

    def _budget_spent(self, current: int) -> bool:
        """The job moved to ``current`` (by a rank or another agent): give up if that spent the budget."""
        assert self.store is not None
        recent = self._recent_restarts(current)
        if len(recent) <= self.cfg.max_restarts:
            return False
        self.store.give_up(
            f"fault budget spent: {len(recent)} faults within {self.cfg.restart_window_s:g} s "
            f"(agent.max_restarts={self.cfg.max_restarts})"
        )
        return True

    def _join_generation(self) -> int | None:
        """The generation to start in; a replacement node whose predecessor ran it asks for a new one."""
        assert self.store is not None
        gen = self.store.generation()
        if self.store.store.check([f"started/{gen}/{self.node}"]):
            self.events.emit("node_rejoined", node=self.node, gen=gen)
            return self._next_generation(gen)
        return gen

    # -- ranks -----------------------------------------------------------------
    def _start_ranks(self, gen: int) -> None:
        assert self.store is not None
        for rank in self.local_ranks:
            self._start_rank(rank, gen)
        self.store.store.set(f"started/{gen}/{self.node}", "1")
        self.events.emit(
            "ranks_started",
            gen=gen,
            node=self.node,
            ranks=self.local_ranks,
            pids=[self.ranks[r].pid for r in self.local_ranks],
            warm=[self.ranks[r].warm for r in self.local_ranks],
        )

    def _start_rank(self, rank: int, gen: int) -> RankProcess:
        """Start ``rank``'s process in generation ``gen``: a warm spare if one is ready, else a cold one."""
        assert self.store is not None
        if self.job.comm.rootless:
            master_port = self.store_port
        elif self.node == 0:
            master_port = self.store.master_port(gen) if self.store.has_master_port(gen) else _free_port()
            self.store.publish_master_port(gen, master_port)
        else:
            master_port = self.store.master_port(gen)
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
            store_addr=self.cluster.master_addr,
            store_port=self.store_port,
            batch_cache=str(self.batch_cache.root) if self.batch_cache.root else None,
        )
        self.store.set_rank_heartbeat(rank, Heartbeat(gen, -1, time.time()))
        self.store.set_member(rank, gen)
        spare = self.spares.take()
        log_dir = self.run_dir / "rank_logs"
        if spare is not None:
            self.ranks[rank] = RankProcess.adopt(spec, spare, argv, log_dir)
        else:
            command = [sys.executable, "-m", "ckless_lightning.rank", *argv]
            self.ranks[rank] = RankProcess.spawn(spec, command, log_dir)
        return self.ranks[rank]

    def _stop_ranks(self, *, graceful: bool, generation: int | None = None) -> None:
        if not self.ranks:
            return
        grace = self.cfg.stop_grace_s if graceful else 0.0
        for proc in self.ranks.values():
            proc.stop(grace)
        if generation is not None:
            self.events.emit("ranks_stopped", gen=generation, node=self.node, ranks=sorted(self.ranks))
        self.ranks.clear()

    # -- watching --------------------------------------------------------------
    def _monitor(self, gen: int) -> _Outcome:
        assert self.store is not None
        spares_filled = self.cfg.spares == 0
        while True:
            now = time.time()
            self.store.set_agent_heartbeat(self.node, gen)
            if self.store.giveup_reason() is not None:
                return _Outcome("giveup")
            current = self.store.generation()
            if current > gen:
                return _Outcome("generation", current)

            codes = {rank: proc.poll() for rank, proc in self.ranks.items()}
            if any(code not in (None, 0) for code in codes.values()):
                return self._on_rank_failure(gen)
            if all(code == 0 for code in codes.values()):
                return _Outcome("done")

            beats = self.store.rank_heartbeats(self.local_ranks)
            stale = self._stale(codes, beats, now)
            if stale:
                self._report_hang(gen, stale, beats)
                return _Outcome("fault")
            if self._lost_node(gen, now):
                return _Outcome("fault")
            self.batch_cache.keep_running()
            if not spares_filled and all(beat.step >= 0 for beat in beats.values()):
                self.spares.fill()  # refill once training runs again, not while ranks start
                spares_filled = True
            self._inject_outside_faults(gen, beats)
            time.sleep(self.cfg.monitor_interval)

    def _report_hang(self, gen: int, stale: list[int], beats: dict[int, Heartbeat]) -> int:
        """Kill the hung rank and say so; returns it.

        When a rank hangs, its peers block in the next collective and go stale
        too, possibly before it (they beat earlier). Blame a stopped process
        (state T) first, stale or not, else the stale rank that beat least
        recently; a rank that hangs while running cannot be told from peers
        blocked on it, which matters for the report only (all ranks restart).
        """
        stopped = [r for r, p in self.ranks.items() if p.poll() is None and _process_state(p.pid) == "T"]
        candidates = sorted(set(stale) | set(stopped))
        rank = min(candidates, key=lambda r: (r not in stopped, beats[r].time, r))
        beat = beats[rank]
        self.ranks[rank].kill()
        self.events.emit(
            "fault_detected",
            by=f"agent{self.node}",
            rank=rank,
            reason="hang",
            exit_code=None,
            last_step=beat.step,
            last_beat=beat.time,
            limit_s=self.cfg.startup_timeout if beat.step < 0 else self.cfg.hang_timeout,
            stale_ranks=sorted(stale),
            gen=gen,
        )
        print(f"[agent{self.node}] rank {rank} hung after step {beat.step}; killed it", file=sys.stderr)
        return rank

    def _on_rank_failure(self, gen: int) -> _Outcome:
        """Blame one rank: killed by a signal, else failed by itself, before one that lost a peer.

        A rank whose peer vanished exits with EXIT_PEER_FAILED, or aborts
        (SIGABRT) when gloo fails in one of its threads, so those come last.
        If every local failure is a lost peer, the culprit is on another node:
        give its agent a moment to report it and move the job on.
        """
        time.sleep(_SETTLE_S)
        failed = {rank: code for rank, proc in self.ranks.items() if (code := proc.poll()) not in (None, 0)}
        rank = min(failed, key=lambda r: (_blame_class(failed[r]), r))
        code = failed[rank]
        assert self.store is not None
        if _blame_class(code) >= 2 and self.cluster.nnodes > 1:
            deadline = time.monotonic() + _PEER_REPORT_S
            while time.monotonic() < deadline:
                if (current := self.store.generation()) > gen:
                    return _Outcome("generation", current)
                time.sleep(self.cfg.monitor_interval)
        last_step = self.store.rank_heartbeats([rank])[rank].step
        self.events.emit(
            "fault_detected",
            by=f"agent{self.node}",
            rank=rank,
            reason="exit" if code != EXIT_PEER_FAILED else "peer_lost",
            exit_code=code,
            signal=signal.Signals(-code).name if code < 0 else None,
            failed_ranks=sorted(failed),
            last_step=last_step,
            gen=gen,
        )
        tail = self.ranks[rank].log_tail(15)
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        print(f"[agent{self.node}] rank {rank} {how}; restarting. Last lines of its log:", file=sys.stderr)
        print(tail, file=sys.stderr)
        return _Outcome("fault")

    def _lost_node(self, gen: int, now: float) -> bool:
        """Another node's agent stopped beating. A fault if that node was part of this generation."""
        assert self.store is not None
        for node in range(self.cluster.nnodes):
            if node == self.node or node in self._lost_nodes:
                continue
            beat = self.store.agent_heartbeat(node)
            if beat is None or now - beat[1] <= self.cfg.node_timeout:
                continue
            self._lost_nodes.add(node)
            self.events.emit(
                "fault_detected",
                by=f"agent{self.node}",
                rank=node * self.cluster.nproc_per_node,
                reason="node_lost",
                node=node,
                exit_code=None,
                last_step=None,
                gen=gen,
            )
            if beat[0] == gen:
                return True
        return False

    def _inject_outside_faults(self, gen: int, beats: dict[int, Heartbeat]) -> None:
        """Faults injected by the agent: signal the target rank once it is working on the fault's step."""
        for spec in list(self.outside_faults):
            if beats[spec.rank].step < spec.step - 1:
                continue  # step N starts once step N-1 is complete
            self.outside_faults.remove(spec)
            if claim_fault(self.run_dir / "faults", spec):  # not already fired in an earlier generation
                self._fire(spec, gen)

    def _fire(self, spec: FaultSpec, gen: int) -> None:
        self.events.emit("fault_injected", **injected_event(spec, "outside"), gen=gen)
        if spec.fault_type == "kill":
            os.kill(self.ranks[spec.rank].pid, signal.SIGKILL)
        elif spec.fault_type == "hang":
            os.kill(self.ranks[spec.rank].pid, signal.SIGSTOP)
        elif spec.fault_type == "node_loss":
            for proc in self.ranks.values():
                proc.kill()
            os.kill(os.getpid(), signal.SIGKILL)  # the whole node goes, agent included
        else:
            raise AssertionError(f"fault type {spec.fault_type} cannot be injected from outside")

    # -- generations and the budget ----------------------------------------------
    def _next_generation(self, gen: int) -> int | None:
        """Advance the job past ``gen`` (once, whoever asks first), or give up if the budget is spent."""
        assert self.store is not None
        recent = self._recent_restarts(gen)
        if len(recent) >= self.cfg.max_restarts:
            reason = (
                f"fault budget spent: {len(recent) + 1} faults within {self.cfg.restart_window_s:g} s "
                f"(agent.max_restarts={self.cfg.max_restarts})"
            )
            self.store.give_up(reason)
            return None
        current = self.store.advance_generation(gen)
        if current == gen + 1 and self.store.store.add(f"announced/{current}", 1) == 1:
            self.events.emit("generation", gen=current, reason="fault")
        return current

    def _give_up_exit(self) -> int:
        assert self.store is not None
        reason = self.store.giveup_reason() or "fault budget spent"
        self.events.emit("giveup", reason=reason, exit_code=EXIT_FAULT_BUDGET)
        print(f"giving up: {reason}; exit code {EXIT_FAULT_BUDGET}", file=sys.stderr)
        return EXIT_FAULT_BUDGET

    def _wait_for_other_nodes(self, gen: int) -> _Outcome:
        """This node's ranks are done; node 0 keeps the store up until every node is done.

        If another node fails meanwhile, the job moves on and this node reruns
        the new generation too (a cheap resume from the final checkpoint).
        """
        assert self.store is not None
        self.store.mark_done(gen, self.node)
        if self.node != 0:
            return _Outcome("done")
        while not self.store.nodes_done(gen, self.cluster.nnodes):
            if self.store.giveup_reason() is not None:
                return _Outcome("giveup")
            if (current := self.store.generation()) > gen:
                return _Outcome("generation", current)
            self.store.set_agent_heartbeat(self.node, gen)
            time.sleep(self.cfg.monitor_interval)
        return _Outcome("done")
