"""What the node agent does about what it saw: one policy per tier family.

Each pass of the agent's supervision loop (:class:`~ckless_lightning.agent.node_agent.NodeAgent`)
takes one :class:`Observation` and hands it to its policy's :meth:`Policy.decide`, which reports
what it detects (``fault_detected``), acts on single ranks where its tiers do, and returns a
:class:`Decision` that the loop carries out:

- :class:`RestartAll` (tiers 0-2): any fault ends the generation for the whole job: every agent
  stops all its ranks and starts them all in the next generation, resuming from the last disk
  checkpoint.
- :class:`ReplaceFailed` (tiers 3-4): only a dead or hung rank is replaced (warm spare first) in
  the job's current generation; the survivors recover in-process and move to the next generation
  by themselves.

Blame: a rank killed by a signal (not SIGABRT) first, then one that failed by itself, then one
that aborted (SIGABRT: gloo failing in one of its threads), and last one that lost a peer
(``ExitCode.PEER_FAILED``); for a hang, a stopped process (state T) first, then the rank silent
longest. No Lightning here.
"""

from __future__ import annotations

import enum
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ckless_lightning.agent.budget import RestartBudget
from ckless_lightning.agent.processes import RankProcess, is_stopped, reap
from ckless_lightning.comm import Heartbeat, JobStore
from ckless_lightning.record.events import EventLog
from ckless_lightning.record.faults import how_it_ended
from ckless_lightning.runtime.config import AgentConfig, JobConfig
from ckless_lightning.runtime.contract import ExitCode

__all__ = [
    "BLAME_ORDER",
    "Action",
    "Decision",
    "Node",
    "Observation",
    "Policy",
    "ReplaceFailed",
    "RestartAll",
    "silence_limit",
]

_SETTLE_S = 0.3  # after a first failure, collect the cascade before blaming one rank
# Tiers 3-4: survivors stay alive, so there is little cascade to wait for; a replacement is urgent.
_SETTLE_IN_PROCESS_S = 0.05
_POLL_S = 0.02
_GIVE_UP_SETTLE_S = 2.0  # before giving up on a move by survivors: the local exit that caused it
_PEER_REPORT_S = 2.0  # how long to wait for the agent of a remote culprit to report it
# Which stale rank a hang is blamed on first, by where it says it is (recovery/where.py): its own
# code, then the batch cache, then its accelerator (a kernel behind a peer's collective), then peers.
BLAME_ORDER = {"running": 0, "data": 1, "device": 2, "peers": 3}


def _blame_class(code: int) -> int:
    """Order of suspicion for a rank's exit code: 0 killed (not SIGABRT), 1 its own error, 2 SIGABRT,
    3 lost a peer."""
    if code == -signal.SIGABRT:
        return 2
    if code < 0:
        return 0
    return 3 if code == ExitCode.PEER_FAILED else 1


def silence_limit(beat: Heartbeat, cfg: AgentConfig) -> float:
    """How long a running rank may stay silent after ``beat`` before it counts as hung."""
    if beat.phase in ("recovery", "standby"):  # standby: an elastic job's rank outside the generation
        return cfg.recovery_timeout
    if beat.phase == "save":
        return cfg.save_timeout
    return cfg.startup_timeout if beat.completed_step < 0 else cfg.hang_timeout


def _how(code: int) -> str:
    return how_it_ended(code)


@dataclass(frozen=True)
class Observation:
    """One supervision pass's look at the node and the job, read in this order; nothing acted on yet."""

    gen: int  # the generation this node is in
    now: float  # time.time() at the start of the pass
    giveup: bool  # the job gave up (a reason is in the store)
    current: int  # the job's generation in the store
    codes: Mapping[int, int | None]  # local rank -> exit code; None: running; ``finished`` ranks: 0
    beats: Mapping[int, Heartbeat]  # local rank -> its last heartbeat
    stale: tuple[int, ...]  # running ranks stopped, or silent past agent.startup_timeout / hang_timeout
    silent_nodes: tuple[tuple[int, int], ...]  # (node, its generation): agents silent past node_timeout

    @property
    def failed(self) -> list[int]:
        """Local ranks that exited non-zero or were killed."""
        return [rank for rank, code in self.codes.items() if code not in (None, 0)]

    @property
    def all_exited_ok(self) -> bool:
        return all(code == 0 for code in self.codes.values())


class Action(enum.Enum):
    """What the supervision loop does after a pass."""

    WATCH = "watch"  # nothing to do: keep the node running (reader, spares, outside faults), sleep
    CONTINUE = "continue"  # the policy acted (replaced or killed ranks): observe again at once
    DONE = "done"  # every local rank finished training: wait for the other nodes
    NEXT_GENERATION = "next_generation"  # leave the generation: :meth:`Policy.move_on`
    GIVE_UP = "give_up"  # stop for good: :meth:`Policy.give_up`, then exit with FAULT_BUDGET


@dataclass(frozen=True)
class Decision:
    """A policy's answer to one observation (also the answer of the wait for the other nodes)."""

    action: Action
    generation: int  # the generation the node is in now (ReplaceFailed follows a job that moved on)
    target: int | None = None  # NEXT_GENERATION: the job already moved there; None: move on past a fault


class Node(Protocol):
    """What a policy uses of its node agent: the node's ranks and how to start and stop them."""

    node: int
    job: JobConfig
    cfg: AgentConfig
    events: EventLog
    ranks: dict[int, RankProcess]  # local rank -> its current process
    local_ranks: list[int]
    finished: set[int]  # ranks that trained to the end but did not exit, stopped by the agent

    def start_ranks(self, gen: int) -> None: ...

    def start_rank(self, rank: int, gen: int) -> RankProcess: ...

    def emit_ranks_started(self, gen: int, ranks: list[int]) -> None: ...

    def stop_ranks(self, *, graceful: bool, generation: int | None = None) -> None: ...

    def refill_spares_later(self) -> None: ...

    def local_beats(self, ranks: list[int]) -> dict[int, Heartbeat]: ...

    def local_where(self, ranks: list[int]) -> dict[int, str]: ...

    def restart_hang_clock(self, rank: int, beat: Heartbeat) -> None: ...


class Policy(ABC):
    """Decides what the supervision loop does after each pass; one instance for the whole job."""

    def __init__(self, agent: Node, store: JobStore, budget: RestartBudget) -> None:
        self.agent = agent
        self.store = store
        self.budget = budget
        self.lost_nodes: set[int] = set()  # reported once each

    @abstractmethod
    def decide(self, obs: Observation) -> Decision:
        """Report what ``obs`` shows, act on single ranks where the tier does, and say what comes next."""

    def _gave_up_on_usage_error(self, obs: Observation) -> bool:
        """A local rank exited :attr:`ExitCode.CONFIG` (a :class:`~ckless_lightning.runtime.contract.
        UsageError`: the same in every generation): give the job up with that exit code, naming the
        rank and its log's last traceback, instead of spending the fault budget on it."""
        wrong = sorted(rank for rank, code in obs.codes.items() if code == ExitCode.CONFIG)
        if not wrong:
            return False
        rank = wrong[0]
        report = self.agent.ranks[rank].failure_report()
        self.store.give_up(
            f"rank {rank} exited with a config error, which a restart would repeat "
            f"({self.agent.ranks[rank].log_path}). {report}",
            code=ExitCode.CONFIG,
        )
        return True

    @abstractmethod
    def move_on(self, gen: int, target: int | None) -> int | None:
        """Carry out NEXT_GENERATION from ``gen``; returns the generation the node is in (None: give up)."""

    @abstractmethod
    def give_up(self, gen: int) -> None:
        """Carry out GIVE_UP in ``gen``, before the agent emits ``giveup`` and exits."""

    def _report_hang(self, gen: int, stale: list[int], beats: Mapping[int, Heartbeat]) -> int:
        """Kill the hung rank and say so; returns it.

        When a rank hangs, its peers block in the next collective and go stale
        too, at about the same moment (their beats are milliseconds apart). Blame
        a stopped process (state T) first, stale or not; else a stale rank that
        says it is running its own code before one that waits for the batch
        cache, before one that waits for its accelerator (a kernel behind a peer's collective),
        before one that waits on its peers (tiers 3-4 report it: ``recovery/where.py``); else the
        one that beat least recently. When every stale rank says it waits on its peers or its
        device, the one they wait for may not be stale yet (it beat a few milliseconds after
        them): every live local rank is a candidate then, so a rank running its own code is
        blamed, never a waiting one.
        """
        ranks, cfg, node = self.agent.ranks, self.agent.cfg, self.agent.node
        stopped = [r for r, p in ranks.items() if p.poll() is None and is_stopped(p.pid)]
        candidates = sorted(set(stale) | set(stopped))
        where = self.agent.local_where(candidates)  # read from the node's board (recovery/where.py)
        if not stopped and all(where.get(r) in ("peers", "device") for r in stale):
            live = [r for r, p in ranks.items() if p.poll() is None and r not in self.agent.finished]
            candidates = sorted(set(candidates) | set(live))
            where = self.agent.local_where(candidates)
        rank = min(
            candidates,
            key=lambda r: (r not in stopped, BLAME_ORDER.get(where.get(r, ""), 0), beats[r].time, r),
        )
        beat = beats[rank]
        ranks[rank].kill()
        self.agent.events.emit(
            "fault_detected",
            by=f"agent{node}",
            rank=rank,
            reason="hang",
            exit_code=None,
            completed_step=beat.completed_step,
            last_beat=beat.time,
            limit_s=silence_limit(beat, cfg),
            stale_ranks=sorted(stale),
            stopped=rank in stopped,
            where={str(r): w for r, w in sorted(where.items())},
            gen=gen,
        )
        how = "was stopped (state T)" if rank in stopped else "hung"
        print(f"[agent{node}] rank {rank} {how} after step {beat.completed_step}; killed it", file=sys.stderr)
        return rank

    def _report_lost_node(self, gen: int, obs: Observation) -> bool:
        """Report each newly silent node; True at the first one that was part of generation ``gen``."""
        cluster = self.agent.job.cluster
        for node, node_gen in obs.silent_nodes:
            if node in self.lost_nodes:
                continue
            self.lost_nodes.add(node)
            self.agent.events.emit(
                "fault_detected",
                by=f"agent{self.agent.node}",
                rank=node * cluster.nproc_per_node,
                reason="node_lost",
                node=node,
                exit_code=None,
                completed_step=None,
                gen=gen,
            )
            if node_gen == gen:
                return True
        return False


class RestartAll(Policy):
    """Tiers 0-2: on any fault, stop every local rank and start them all in the next generation."""

    def decide(self, obs: Observation) -> Decision:
        gen = obs.gen
        if obs.giveup or self._gave_up_on_usage_error(obs):
            return Decision(Action.GIVE_UP, gen)
        if obs.current > gen:
            return Decision(Action.NEXT_GENERATION, gen, target=obs.current)
        if obs.failed:
            return self._on_rank_failure(gen)
        if obs.all_exited_ok:
            return Decision(Action.DONE, gen)
        if obs.stale:
            self._report_hang(gen, list(obs.stale), obs.beats)
            return Decision(Action.NEXT_GENERATION, gen)
        if self._report_lost_node(gen, obs):
            return Decision(Action.NEXT_GENERATION, gen)
        return Decision(Action.WATCH, gen)

    def move_on(self, gen: int, target: int | None) -> int | None:
        """Stop every local rank (``ranks_stopped``), move past a fault if ``target`` is None, start all."""
        self.agent.stop_ranks(graceful=False, generation=gen)
        if target is None:
            target = self.budget.advance(gen)
            if target is None:
                return None
        self.agent.start_ranks(target)
        self.agent.refill_spares_later()
        return target

    def give_up(self, gen: int) -> None:
        """Stop every local rank (``ranks_stopped``)."""
        self.agent.stop_ranks(graceful=False, generation=gen)

    def _on_rank_failure(self, gen: int) -> Decision:
        """Blame one rank: killed by a signal, else failed by itself, before one that lost a peer.

        A rank whose peer vanished exits with ExitCode.PEER_FAILED, or aborts
        (SIGABRT) when gloo fails in one of its threads, so those come last.
        If every local failure is a lost peer, the culprit is on another node:
        give its agent a moment to report it and move the job on.
        """
        time.sleep(_SETTLE_S)
        ranks, node = self.agent.ranks, self.agent.node
        failed = {rank: code for rank, proc in ranks.items() if (code := proc.poll()) not in (None, 0)}
        rank = min(failed, key=lambda r: (_blame_class(failed[r]), r))
        code = failed[rank]
        if _blame_class(code) >= 2 and self.agent.job.cluster.nnodes > 1:
            deadline = time.monotonic() + _PEER_REPORT_S
            while time.monotonic() < deadline:
                if (current := self.store.generation()) > gen:
                    return Decision(Action.NEXT_GENERATION, gen, target=current)
                time.sleep(self.agent.cfg.monitor_interval)
        completed = self.agent.local_beats([rank])[rank].completed_step
        self.agent.events.emit(
            "fault_detected",
            by=f"agent{node}",
            rank=rank,
            reason="exit" if code != ExitCode.PEER_FAILED else "peer_lost",
            exit_code=code,
            signal=signal.Signals(-code).name if code < 0 else None,
            failed_ranks=sorted(failed),
            completed_step=completed,
            gen=gen,
        )
        print(
            f"[agent{node}] rank {rank} {_how(code)}; restarting. {ranks[rank].failure_report()}",
            file=sys.stderr,
        )
        return Decision(Action.NEXT_GENERATION, gen)


class ReplaceFailed(Policy):
    """Tiers 3-4: replace only failed or hung ranks (warm spare first) in the job's current generation.

    A rank that fails inside its own code recovers in-process and moves the job on itself;
    a dead or hung rank is replaced, after moving the job on if nobody has yet. Survivors
    follow the job to its next generation by themselves; so does this node (no restart).
    """

    def decide(self, obs: Observation) -> Decision:
        gen = obs.gen
        if obs.giveup or self._gave_up_on_usage_error(obs):
            return Decision(Action.GIVE_UP, gen)
        if obs.current > gen:
            if self.budget.spent_by(obs.current):
                self._report_failed(self._failed_settled())  # what it saw, before it gives up
                return Decision(Action.GIVE_UP, gen)
            gen = obs.current
        if obs.failed:
            time.sleep(_SETTLE_IN_PROCESS_S)  # a peer aborting with the dead one shows itself
            joined = self._replace_failed(gen)
            if joined is None:
                return Decision(Action.GIVE_UP, gen)
            self.agent.refill_spares_later()
            return Decision(Action.CONTINUE, joined)
        if obs.all_exited_ok:
            return Decision(Action.DONE, gen)
        stale = self._stop_finished(obs)
        if stale:
            hung = self._report_hang(gen, stale, obs.beats)
            reap(self.agent.ranks[hung].proc, f"rank {hung}")  # SIGKILLed: replaced on the next pass
            return Decision(Action.CONTINUE, gen)
        if self._report_lost_node(gen, obs):
            return Decision(Action.NEXT_GENERATION, gen)
        return Decision(Action.WATCH, gen)

    def move_on(self, gen: int, target: int | None) -> int | None:
        """A lost node (``target`` None): move the job past ``gen``; the survivors follow by themselves.
        The job moved to ``target`` after this node's ranks finished (another node failed): they
        rejoin it, resuming from disk."""
        if target is None:
            return self.budget.advance(gen)
        self.agent.stop_ranks(graceful=False)
        self.agent.start_ranks(target)
        return target

    def give_up(self, gen: int) -> None:
        """Nothing: the ranks are stopped, without ``ranks_stopped``, when the agent ends."""

    def _stop_finished(self, obs: Observation) -> list[int]:
        """Stop the stale ranks that finished (passed their last collective) but did not exit; the rest.

        A rank that trained its last step but is still in the final save is not finished: its peers
        wait for it there, so a hang there is a hang."""
        stuck = [r for r in obs.stale if self.store.rank_finished(r)]
        for rank in stuck:
            print(
                f"[agent{self.agent.node}] rank {rank} finished training but did not exit; killed it",
                file=sys.stderr,
            )
            self.agent.ranks[rank].stop(0)
            self.agent.finished.add(rank)
        return [r for r in obs.stale if r not in stuck]

    def _replace_failed(self, gen: int) -> int | None:
        """Report and replace each failed rank; returns the generation they joined (None: give up).

        A rank whose process belonged to an older generation than the current one
        died of a fault the job has already moved past (survivors noticed first):
        no new generation for it. Otherwise the job moves on once, here.
        """
        agent = self.agent
        failed = self._failed()
        agent.ranks_lost(failed)  # before the membership is read: no count for them in flight then
        if self.store.ranks_finished() > 0:
            # A peer passed its last collective (the final save included), so every rank did: a
            # rank lost now was ending. Replacing it would wait in a join barrier nobody else enters.
            for rank in sorted(failed):
                agent.events.emit("rank_lost_after_end", rank=rank, exit_code=failed[rank], gen=gen)
                print(
                    f"[agent{agent.node}] rank {rank} {_how(failed[rank])} after the job's end "
                    "(a peer had finished); not replaced",
                    file=sys.stderr,
                )
                agent.finished.add(rank)
            return gen
        self._restart_hang_clocks()
        current = max(gen, self.store.generation())
        member = {rank: self.store.member(rank) for rank in failed}
        if current > gen and self.budget.spent_by(current):  # survivors moved the job on: it counts
            self._report_failed(failed, member)
            return None
        if any(member[rank] >= current for rank in failed):
            next_gen = self.budget.advance(current)
            if next_gen is None:
                self._report_failed(failed, member)  # what it saw, before it gives up
                return None
            current = next_gen
        self._report_failed(failed, member)
        for rank in sorted(failed, key=lambda r: (_blame_class(failed[r]), r)):
            how = _how(failed[rank])
            print(
                f"[agent{agent.node}] rank {rank} {how}; replacing it in generation {current}. "
                f"{agent.ranks[rank].failure_report()}",
                file=sys.stderr,
            )
            agent.ranks[rank].stop(0)
            agent.start_rank(rank, current)
            agent.emit_ranks_started(current, [rank])
        return current

    def _failed(self) -> dict[int, int]:
        """Local ranks whose process failed (exit code), but those that finished the job."""
        return {
            rank: code
            for rank, proc in self.agent.ranks.items()
            if (code := proc.poll()) not in (None, 0) and rank not in self.agent.finished
        }

    def _failed_settled(self) -> dict[int, int]:
        """:meth:`_failed`, once a local rank's exit shows or after ``_GIVE_UP_SETTLE_S``: survivors
        can move the job on within milliseconds of a SIGKILL, before the killed process has
        finished exiting (tearing down gigabytes takes that long on busy cores); the fault that
        spent the budget would then go unreported (a fault on another node shows no local exit)."""
        deadline = time.monotonic() + _GIVE_UP_SETTLE_S
        while not (failed := self._failed()) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return failed

    def _report_failed(self, failed: dict[int, int], member: dict[int, int] | None = None) -> None:
        """``fault_detected`` for each failed rank, in order of blame: how its process ended."""
        for rank in sorted(failed, key=lambda r: (_blame_class(failed[r]), r)):
            code = failed[rank]
            self.agent.events.emit(
                "fault_detected",
                by=f"agent{self.agent.node}",
                rank=rank,
                reason="exit",
                exit_code=code,
                signal=signal.Signals(-code).name if code < 0 else None,
                failed_ranks=sorted(failed),
                completed_step=self.agent.local_beats([rank])[rank].completed_step,
                # the generation the dead process was in
                gen=member[rank] if member is not None else self.store.member(rank),
            )

    def _restart_hang_clocks(self) -> None:
        """A recovery begins: give every live local rank a full ``hang_timeout`` from now.

        Survivors blocked on a failed peer stop beating until they notice it
        (milliseconds to seconds); without this they could be taken for hung.
        """
        beats = self.agent.local_beats(self.agent.local_ranks)
        now = time.time()
        for rank, proc in self.agent.ranks.items():
            if proc.poll() is None:
                beat = beats[rank]
                self.agent.restart_hang_clock(rank, Heartbeat(beat.gen, beat.completed_step, now, beat.phase))
