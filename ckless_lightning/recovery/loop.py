"""InProcessRecovery: ``trainer.fit`` in a loop that survives faults without restarting the process.

On a fault inside ``fit`` (an exception in this rank's code, a collective
failing because a peer died or was killed, or the commit vote abandoned
because the job moved to a new generation), Lightning unwinds ``fit`` and calls
the strategy's ``on_exception``, which runs this loop's ``_on_leave``: it cuts
this rank's connections (:mod:`~ckless_lightning.recovery.sever`) so its peers
fail fast. The loop sits above the strategy: it builds one per generation and
hands it the generation, the step vote, the leave hook and tier 4's memory
restore. The loop then drops the process group, leaves the generation
(moving the job to the next one if nobody has yet), waits in the join barrier
until every rank, replacements included, is in the new generation, and calls
``fit`` again on a new Trainer, strategy and LightningModule. Lightning's own
restore path (``fit(ckpt_path=...)``) brings back loops, callbacks, the LR
scheduler and the data position:

- tier 3 (``source="disk"``): every rank reloads the last disk checkpoint;
- tier 4 (``source="memory"``): the strategy serves the live state from memory.

Use it with your own Trainer (the job store comes from the node agent)::

    recovery = InProcessRecovery.from_env()
    trainer = recovery.fit(
        lambda strategy, callbacks: pl.Trainer(strategy=strategy, callbacks=[*callbacks, ...], ...),
        lambda: MyLightningModule(...),
        datamodule=my_datamodule,
    )
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from ckless_lightning.comm import Generation, GenerationChanged, JobStore
from ckless_lightning.comm.beat_board import BoardBeats, HeartbeatWriter
from ckless_lightning.comm.node_relay import NodeLink
from ckless_lightning.models import resolve_mesh
from ckless_lightning.record.events import EventLog
from ckless_lightning.record.process_memory import reset_peak_rss, rss_bytes
from ckless_lightning.recovery.commit import StateDisagreement, StepCommit
from ckless_lightning.recovery.device_fault import exit_on_device_fault
from ckless_lightning.recovery.digest import StateDigest
from ckless_lightning.recovery.elastic import ElasticPolicy, StandbyEnded
from ckless_lightning.recovery.memory import MemoryRestore, StartOver
from ckless_lightning.recovery.session import GenerationSession, JobFinished, JobGaveUp
from ckless_lightning.recovery.sever import fail_fast, unstick
from ckless_lightning.recovery.watch import GenerationWatch
from ckless_lightning.recovery.where import WhereReporter
from ckless_lightning.replication import SnapshotCopies, Transfer
from ckless_lightning.replication.state import (
    LiveParam,
    live_params,
    params_are_optimized,
    reshard_all,
    rng_state,
    set_rng_state,
)
from ckless_lightning.runtime.checkpointing import latest_checkpoint, quarantine_checkpoints
from ckless_lightning.runtime.contract import (
    ExitCode,
    RankContext,
    UsageError,
    is_device_fault,
    is_peer_failure,
)
from ckless_lightning.training.callbacks import (
    HeartbeatCallback,
    ResumedCheckpoints,
    SnapshotCallback,
    TimelineCallback,
)
from ckless_lightning.training.strategy import MEMORY_CHECKPOINT, CheckpointlessStrategy

__all__ = ["InProcessRecovery", "JobGaveUp", "MakeTrainer", "RecoveryFaults"]

# (strategy of this generation, callbacks to add to the Trainer) -> Trainer
MakeTrainer = Callable[[CheckpointlessStrategy, list[pl.Callback]], pl.Trainer]
_SUSPECT_AFTER = 2  # a rank whose state disagrees this many times is suspect hardware: replaced
_SETTLE_ON_LEAVE_S = 5.0  # tier 4: how long a leaving rank lets a buddy exchange in flight finish


class RecoveryFaults(Protocol):
    """Fault injection's hooks into a recovery (``FaultInjectionCallback`` implements them)."""

    def on_recovery(self, completed_step: int) -> None:
        """Between leaving a generation and joining the next (the ``recovery`` phase)."""

    def on_comm_init(self, completed_step: int) -> None:
        """As this rank starts forming a generation's process groups (the ``comm_init`` phase)."""

    def on_transfer(self, completed_step: int) -> None:
        """Tier 4: as the state transfer starts, on every rank (the ``transfer`` phase)."""

    def corrupt_transfer(self, pair: Transfer, bucket: int, buffer: torch.Tensor) -> None:
        """Tier 4, on a source: may flip bytes of a bucket in flight (the ``corrupt`` fault)."""


class InProcessRecovery:
    """Runs ``fit`` until it completes, rejoining the job in-process after each fault (tiers 3, 4).

    Args:
        generation: the generation this process starts in: the job store, this rank, the world
            size, the (replicate, shard) mesh and the process groups' timeout.
        checkpoint_dir: where the disk checkpoints are (tier 3 reloads the latest).
        events: the job's event log (recovery phases as ``rank_phase`` events).
        faults: fault injection's hooks into recoveries (tests and demos).
        snapshots: tier 4: this rank's :class:`SnapshotCopies`; recoveries then restore from
            memory (``MEMORY_CHECKPOINT``) instead of the last disk checkpoint.
        bucket_bytes: tier 4: transfer bucket size.
        digest: HSDP: the state digest the replicas compare in each commit vote.
        elastic: an elastic HSDP job's rules (:mod:`~ckless_lightning.recovery.elastic`): a
            generation may train a subset of the job's ranks; this rank then stands by outside it,
            and each generation's strategy gets the subset's view (its rank among them, their
            mesh). ``make_trainer`` sees it in ``strategy.generation``.
        device_busy: on an accelerator, whether it has unfinished work (:func:`~ckless_lightning.
            recovery.where.cuda_busy`): the agent's hang blame then tells a rank waiting on its
            device from one running its own code.
        beats: where this rank's heartbeats go (:meth:`RankContext.beats`: its slot of the node
            agent's board); None: the job store.
        warm_first_step: a replaced rank (a fresh process) warms DTensor's caches for its first
            optimizer step before it (tier 4: while its state moves; tier 3: after the checkpoint
            loads), so that the survivors do not wait ~0.3 s for it in that step
            (:mod:`~ckless_lightning.replication.warmup`; no bit changes).
    """

    def __init__(
        self,
        generation: Generation,
        *,
        checkpoint_dir: str | Path | None = None,
        events: EventLog | None = None,
        faults: RecoveryFaults | None = None,
        snapshots: SnapshotCopies | None = None,
        bucket_bytes: int = 64 << 20,
        digest: StateDigest | None = None,
        elastic: ElasticPolicy | None = None,
        device_busy: Callable[[], bool] | None = None,
        beats: HeartbeatWriter | None = None,
        warm_first_step: bool = True,
    ) -> None:
        self.generation = generation  # the job's view: every rank, the full mesh
        self.device_busy = device_busy
        self.store: JobStore = generation.store
        self.rank = generation.rank
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.events = events
        self.faults = faults
        self.beats: HeartbeatWriter = self.store if beats is None else beats
        # Its node agent's relay: joins and generation moves through the agent (comm/node_relay.py)
        self.link = NodeLink(beats.board, slot=beats.slot) if isinstance(beats, BoardBeats) else None
        # What a waiting step vote blocks in, and the join barrier between generations (never both)
        self._vote_waiter = self.store.another_client()
        self.session = GenerationSession(
            self.store,
            beats=self.beats,
            waiter=self._vote_waiter,
            rank=self.rank,
            world_size=generation.world_size,
            generation=generation.number,
            join_timeout_s=generation.join_timeout_s,
            on_phase=self._phase,
            announce=self._announce if events is not None else None,
            elastic=elastic,
            on_standby=self._on_standby,
            link=self.link,
        )
        self.elastic = elastic
        self.snapshots = snapshots
        self.bucket_bytes = bucket_bytes
        self.warm_first_step = warm_first_step
        # HSDP: replicas compare state digests in the vote (None: no replicas, or switched off)
        self.digest = digest if generation.mesh[0] >= 2 else None
        self.snapshot_callback: SnapshotCallback | None = None  # the current generation's (its cost)
        self.record_s = 0.0
        self.record_cpu_s = 0.0
        self.settle_s = 0.0
        self.records = 0
        self.recoveries = 0
        self.watch: GenerationWatch | None = None  # frees this rank if it stays in a generation left behind
        self._waiter: JobStore | None = None  # the store connection the watches block in
        self.commit: StepCommit | None = None  # the current generation's vote (its cost: wait_s, votes)
        self.vote_s = 0.0
        self.vote_cpu_s = 0.0
        self.votes = 0

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        replicate: int = 1,
        shard: int = -1,
        pg_timeout_s: float = 600.0,
        init_timeout_s: float = 60.0,
        join_timeout_s: float = 900.0,
        **kwargs: Any,
    ) -> InProcessRecovery:
        """Join the job whose store the node agent names in the environment (``CKLESS_STORE_ADDR``...).

        ``replicate``/``shard`` give the mesh (``shard=-1`` derives it); ``kwargs`` go to the constructor.
        """
        context = RankContext.from_env(env)
        if not context.has_store:
            raise ValueError(
                "InProcessRecovery needs the node agent's job store: start the ranks with launch.py, "
                "or set CKLESS_STORE_ADDR / CKLESS_STORE_PORT to a running agent's store"
            )
        store = JobStore.connect(context.store_addr, context.store_port, secret=context.store_secret)  # type: ignore[arg-type]
        if context.generation == 0 and (store.job_ended() is not None or store.ranks_finished() > 0):
            raise ValueError(
                f"the job store at {context.store_addr}:{context.store_port} served a job under this "
                "secret that finished: a store serves one job, so that no job reads another's keys; "
                "start a new store or secret per job (python -m ckless_lightning.run does both)"
            )
        generation = Generation(
            store,
            number=context.generation,
            rank=context.rank,
            world_size=context.world_size,
            mesh=resolve_mesh(context.world_size, replicate, shard),
            pg_timeout_s=pg_timeout_s,
            init_timeout_s=init_timeout_s,
            join_timeout_s=join_timeout_s,
        )
        return cls(generation, **{"beats": context.beats(store), **kwargs})

    # -- the loop ------------------------------------------------------------------------------------
    def fit(
        self,
        make_trainer: MakeTrainer,
        make_module: Callable[[], pl.LightningModule],
        *,
        datamodule: pl.LightningDataModule | None = None,
        ckpt_path: str | Path | None = None,
        after_fit: Callable[[pl.Trainer], None] | None = None,
    ) -> pl.Trainer | None:
        """Train to the end; returns the Trainer of the generation that finished (None: this rank of an
        elastic job stood by when the job finished).

        ``ckpt_path`` is where the job starts (generation 0); a process started in
        a later generation (a replacement) and every recovery resume from the
        latest disk checkpoint instead (or ``ckpt_path`` while there is none).
        ``after_fit(trainer)`` (the final checkpoint save) runs after ``fit`` in the same
        generation: a fault during it is recovered like one during a step. On return this rank
        passed its last collective, and the job store says so (``JobStore.mark_rank_finished``).
        """
        # The agent's hang blame: to the node's board with the beats (agent.local_beats), else the store
        writer = self.beats if isinstance(self.beats, BoardBeats) else self.store
        where = WhereReporter(writer, self.rank, device_busy=self.device_busy)
        where.start()
        try:
            trainer = self._fit(
                make_trainer, make_module, datamodule=datamodule, ckpt_path=ckpt_path, after_fit=after_fit
            )
        finally:
            where.stop()
        if trainer is not None:
            self.store.mark_rank_finished(self.rank)
        return trainer

    def _fit(
        self,
        make_trainer: MakeTrainer,
        make_module: Callable[[], pl.LightningModule],
        *,
        datamodule: pl.LightningDataModule | None,
        ckpt_path: str | Path | None,
        after_fit: Callable[[pl.Trainer], None] | None,
    ) -> pl.Trainer | None:
        resume: str | Path | None = ckpt_path
        recovering = self.session.generation > 0
        # A generation that starts over (no checkpoint) starts from the RNG state the job started
        # with, as a run without faults did: a user's module may draw its weights or its data
        # order from torch's global RNG when it is built.
        start_rng = rng_state()
        left_after: int | None = None  # the completed step, while between generations
        while True:
            trainer: pl.Trainer | None = None
            try:
                if left_after is not None and self.faults is not None:
                    self.faults.on_recovery(left_after)
                gen = self._view(self.session.join())
                self._watch(gen.number)
                left_after = None
                if recovering:
                    resume = self._resume_point(ckpt_path)
                    self._phase("resume_chosen", gen.number, resumed_from=str(resume) if resume else None)
                    if self.snapshots is not None and resume != MEMORY_CHECKPOINT:
                        # A timeline the job leaves: its live capture and copies describe none of
                        # the steps this generation will train, nor do fingerprints recorded so far.
                        self.snapshots.resumed_at(None, timeline=gen.number)
                if resume is None:
                    set_rng_state(start_rng)
                trainer = make_trainer(self._strategy(gen, resume), self._callbacks(gen.number))
                trainer.fit(make_module(), datamodule=datamodule, ckpt_path=resume)
                if after_fit is not None:
                    after_fit(trainer)
                self._unwatch()
                self._count_votes()
                return trainer
            except (JobGaveUp, UsageError):  # a usage error repeats in every generation: not a fault
                self._unwatch()
                raise
            except (StandbyEnded, JobFinished) as ended:
                self._unwatch()
                print(f"{ended}: nothing left to train", file=sys.stderr)
                return None
            except Exception as err:  # any fault: leave this generation and rejoin the next
                self._unwatch()
                if is_device_fault(err):  # its CUDA context is poisoned: this process ends here
                    self._phase(
                        "device_fault", self.session.generation, error=f"{type(err).__name__}: {err}"[:200]
                    )
                    exit_on_device_fault(err, rank=self.rank, keep_ports={self.store.port})
                self._count_votes()
                if trainer is not None and self.store.ranks_finished() > 0:
                    # A peer passed its last collective, so this rank entered it too: its training
                    # and the final save are done, and a new generation nobody else joins would wait.
                    print(
                        f"rank {self.rank}: {type(err).__name__} after a peer finished the job, in or "
                        "after the last collective: nothing left to train",
                        file=sys.stderr,
                    )
                    self._phase("finished_at_fault", self.session.generation, error=f"{err}"[:200])
                    return trainer
                if trainer is not None:
                    self.session.completed_step = trainer.global_step
                self.session.beat_recovering()
                self._capture_live_state(trainer, err)
                if isinstance(err, StateDisagreement):
                    self._on_disagreement(err)
                self._leave(err)
                left_after = self.session.completed_step
                recovering = True
            # Out of the except block, the traceback (and with it the old Trainer, module,
            # FSDP state and process groups) is unreachable: free them, threads and sockets too.
            trainer = None
            if datamodule is not None:
                datamodule.trainer = None  # it would keep the old Trainer alive
            start = time.perf_counter()
            gc.collect()
            gc_s = round(time.perf_counter() - start, 6)
            # The steady state this recovery's memory is measured against (``memory_restore``).
            gen = self.session.generation
            self._phase("state_released", gen, rss=rss_bytes(), peak_reset=reset_peak_rss(), gc_s=gc_s)

    # -- pieces --------------------------------------------------------------------------------------
    def _view(self, number: int) -> Generation:
        """Generation ``number`` as this rank trains in it: the job's view, or an elastic generation's
        (this rank's place among the ranks that train, their mesh)."""
        active = self.session.active
        if self.elastic is None or len(active) == self.generation.world_size:
            return self.generation.next(number)
        return replace(
            self.generation,
            number=number,
            rank=active.index(self.rank),
            world_size=len(active),
            mesh=self.elastic.mesh(active),
            active=active,
        )

    def _on_standby(self, gen: int) -> None:
        """From the session: this rank stands by in ``gen`` (its replica is out of the job). Its state
        will be stale when the replica rejoins: drop it (the rejoin copies a live replica's)."""
        if self.snapshots is not None:
            self.snapshots.capture_live(None, trusted=False)
        print(
            f"rank {self.rank}: standing by in generation {gen} (its replica is out of the job until "
            "every rank of it is back)",
            file=sys.stderr,
        )

    def _strategy(self, gen: Generation, resume: str | Path | None) -> CheckpointlessStrategy:
        """Generation ``gen``'s strategy, handed the vote, the leave hook and (tier 4) the memory restore;
        ``resume`` is what its ``fit`` restores from (weights are then not initialized)."""
        self.commit = StepCommit(
            gen,
            digest=self.digest,
            on_disagreement=lambda **fields: self._emit("state_disagreement", gen.number, **fields),
            waiter=self._vote_waiter,
        )
        if self.watch is not None and self.watch.moved:  # the job left before the vote existed
            self.commit.job_left(self.store)
        memory = None
        if self.snapshots is not None:
            faults = self.faults
            memory = MemoryRestore(
                self.snapshots,
                gen,
                checkpoint_dir=self.checkpoint_dir,
                bucket_bytes=self.bucket_bytes,
                events=self.events,
                corrupt=faults.corrupt_transfer if faults is not None else None,
                on_transfer=(
                    (lambda: faults.on_transfer(self.session.completed_step)) if faults is not None else None
                ),
                adopt_live=resume == MEMORY_CHECKPOINT,
                warm_first_step=self.warm_first_step,
            )
        return CheckpointlessStrategy(
            generation=gen,
            on_phase=lambda phase, **fields: self._on_strategy_phase(phase, gen.number, **fields),
            weights_from_checkpoint=resume is not None,
            step_vote=self.commit.vote,
            on_leave=self._on_leave,
            memory=memory,
            warm_first_step=self.warm_first_step,
        )

    def _on_strategy_phase(self, phase: str, gen: int, **fields: Any) -> None:
        self._phase(phase, gen, **fields)
        if phase == "comm_init_start" and self.faults is not None:
            self.faults.on_comm_init(self.session.completed_step)

    def _on_leave(self) -> None:
        """From the strategy's ``on_exception``: make peers notice at once that this rank is leaving.

        Tier 4 first lets a buddy exchange in flight finish (peers' gloo threads progress it even
        while they wait in a collective), so its copies stay usable.
        """
        self._unwatch()
        self.session.beat_recovering()
        if self.snapshots is not None:
            self.snapshots.settle(timeout_s=_SETTLE_ON_LEAVE_S)
        fail_fast(keep_ports={self.store.port})

    def _watch(self, gen: int) -> None:
        if self._waiter is None:
            self._waiter = self.store.another_client()
        self.watch = GenerationWatch(
            self.store,
            gen,
            self.rank,
            waiter=self._waiter,
            on_stuck=lambda: self._cut_stuck(gen),
            grace_s=self.generation.stuck_grace_s,
            on_left_behind=lambda: self._exit_left_behind(gen),
            exit_after_s=self.generation.stuck_exit_s,
            on_unstick=lambda: self._unstick(gen),
            on_moved=lambda store: self._job_left(gen, store),
            moves=self.link,
        )
        self.watch.start()

    def _job_left(self, gen: int, store: JobStore) -> None:
        """From the watch's thread: the job left ``gen``; a step vote of it this rank waits on ends."""
        commit = self.commit
        if commit is not None and commit.generation.number == gen:
            commit.job_left(store)

    def _unwatch(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    def _cut_stuck(self, gen: int) -> None:
        """From the watch's thread: the job left generation ``gen`` and this rank is still in it."""
        print(
            f"rank {self.rank}: still in generation {gen} after the job moved on: cutting its connections",
            file=sys.stderr,
        )
        self._phase("stuck_cut", gen)
        fail_fast(keep_ports={self.store.port})

    def _unstick(self, gen: int) -> None:
        """From its own thread: cut, and still blocked on peers (a gloo wait the cut does not end):
        reset the connections and write on every gloo one, so that the wait raises."""
        reset, sends = unstick(keep_ports={self.store.port})
        print(
            f"rank {self.rank}: still blocked on peers in generation {gen} after its cut: reset "
            f"{reset} connection(s), {sends} gloo send(s) taken",
            file=sys.stderr,
        )
        self._phase("stuck_reset", gen, reset=reset, sends=sends)

    def _exit_left_behind(self, gen: int) -> None:
        """From the watch's thread: cut, and still blocked on peers ``comm.stuck_exit_s`` later (a
        wait in C++ no cut reaches): this process cannot rejoin; it ends, its agent replaces it."""
        print(
            f"rank {self.rank}: still blocked on peers in generation {gen} "
            f"{self.generation.stuck_exit_s:g} s after its connections were cut (comm.stuck_exit_s): "
            "exiting for the agent to replace it "
            f"(exit code {ExitCode.LEFT_BEHIND})",
            file=sys.stderr,
        )
        main = sys._current_frames().get(threading.main_thread().ident)
        if main is not None:  # where it is blocked, for whoever reads the rank's log
            traceback.print_stack(main, file=sys.stderr)
        sys.stderr.flush()
        self._phase("left_behind_exit", gen)
        os._exit(ExitCode.LEFT_BEHIND)  # the main thread is blocked in C++: no unwinding reaches it

    def _callbacks(self, gen: int) -> list[pl.Callback]:
        """This generation's callbacks, in order; put them first in the Trainer's list (tier 4's
        snapshot must run before any callback that communicates)."""
        callbacks: list[pl.Callback] = []
        if self.snapshots is not None:
            self.snapshot_callback = SnapshotCallback(
                self.snapshots, generation=gen, on_first_record=self.store.mark_state_recorded
            )
            callbacks.append(self.snapshot_callback)
        callbacks.append(HeartbeatCallback(self.beats, rank=self.rank, generation=gen))
        if self.events is not None:
            callbacks.append(TimelineCallback(self.events, rank=self.rank, generation=gen))
        # The user's own ModelCheckpoint does not write again the checkpoint a recovery resumed from
        callbacks.append(ResumedCheckpoints())
        return callbacks

    def _leave(self, err: Exception) -> None:
        """Drop the process group and move past the current generation (a fault, also in recovery)."""
        old = self.session.generation
        completed = self.session.completed_step
        # A start-over is the recovery's own fallback (state lost, no disk checkpoint), part of the
        # recovery of the fault that lost the state: not a fault of this rank's.
        own = not (is_peer_failure(err) or isinstance(err, (GenerationChanged, StartOver)))
        self._phase(
            "recovery_start",
            old,
            error=f"{type(err).__name__}: {str(err)[:200]}",
            own=own,
            completed_step=completed,
            **({"start_over": True} if isinstance(err, StartOver) else {}),
        )
        print(
            f"rank {self.rank}: leaving generation {old} after step {completed} "
            f"({type(err).__name__}: {str(err)[:200]})",
            file=sys.stderr,
        )
        if own:
            # Its own error: where it was raised. A lost peer or a moved generation says all in the
            # line above; its traceback (a collective's internals) was noise on every recovery.
            traceback.print_exception(err, file=sys.stderr)
        if self.digest is not None:
            self.digest.release()  # its views would keep this generation's state alive
        if self.snapshots is not None:
            self.snapshots.detach()  # the buddy pair groups end with the generation's groups
        if dist.is_initialized():
            dist.destroy_process_group()
        self.session.leave()
        self.recoveries += 1

    def _resume_point(self, ckpt_path: str | Path | None) -> str | Path | None:
        """Where a recovery resumes: memory (tier 4, once any step was committed), else disk."""
        if self.snapshots is not None and self.store.state_recorded():
            return MEMORY_CHECKPOINT
        return self._latest_checkpoint() or ckpt_path

    def _capture_live_state(self, trainer: pl.Trainer | None, err: Exception) -> None:
        """Tier 4: keep views of this rank's live tensors if they hold its last recorded step.

        Trusted only when this rank's own code did not fail (the error came from a lost peer or
        a changed generation) and no optimizer step completed after the last snapshot. The views
        are the ones the snapshot listed (the optimizer's sharded parameters and their state),
        whatever a fault inside an FSDP2 collective left registered on the module.
        """
        if self.snapshots is None:
            return
        not_ours = is_peer_failure(err) or isinstance(err, GenerationChanged)
        recorded_here = self.snapshot_callback is not None and self.snapshot_callback.records > 0
        if self.snapshots.capture is not None and not recorded_here:
            # The fault hit this generation before it recorded a step (in its restore, or before its
            # first step). A peer lost: the state captured when leaving the generation before is
            # still the one to restore, untouched. This rank's own error (its capture did not fit
            # the new model): never offer it again. (A generation that recorded a step trained past
            # the capture: a restore consumed it, or the generation resumed from elsewhere and
            # dropped it; either way what follows is a new capture.)
            if not not_ours:
                self.snapshots.capture_live(None, trusted=False)
            self._collect_snapshot_cost()
            return
        params, why = self._live_state(trainer, err, not_ours)
        self.snapshots.capture_live(params, trusted=params is not None)
        self._phase("live_captured", self.session.generation, trusted=params is not None, why=why)
        self._collect_snapshot_cost()

    def _on_disagreement(self, err: StateDisagreement) -> None:
        """Every rank: set aside the checkpoints that may hold the corrupt state, before any rank can
        resume from one (each does it before joining the next generation); no rank offers its live
        state (:meth:`_live_state`), so the job resumes from the last checkpoint up to
        ``err.trusted_step`` (none: from its start). A suspect rank that disagreed before is
        suspect hardware: it exits, and the agent replaces it."""
        moved = quarantine_checkpoints(
            self.checkpoint_dir, after_step=err.trusted_step, tag=f"gen{self.session.generation}"
        )
        if moved:
            print(
                f"rank {self.rank}: set aside {len(moved)} checkpoint(s) after step {err.trusted_step}: "
                f"{', '.join(p.name for p in moved)}",
                file=sys.stderr,
            )
        if self.rank not in err.suspects:
            return
        times = self.store.disagreements(self.rank)
        print(
            f"rank {self.rank}: its state disagreed with its replicas at step {err.step} "
            f"({times} time(s) in this job)",
            file=sys.stderr,
        )
        if times >= _SUSPECT_AFTER:
            self._emit("suspect_hardware", self.session.generation, step=err.step, times=times)
            print(
                f"rank {self.rank}: suspect hardware (state disagreed {times} times): exiting so that the "
                f"agent replaces this process (exit code {ExitCode.SUSPECT_STATE})",
                file=sys.stderr,
            )
            raise SystemExit(ExitCode.SUSPECT_STATE)

    def _live_state(
        self, trainer: pl.Trainer | None, err: Exception, not_ours: bool
    ) -> tuple[list[LiveParam] | None, str]:
        """This rank's live state to offer its peers, or None and why not."""
        if trainer is None:
            return None, "no trainer"
        if isinstance(err, StateDisagreement):
            # Not even the majority's: the corrupt replica's gradients entered every replica's
            # update since the corruption (measured: 3x1, a flip found 2 steps later had changed
            # every rank's weights). Only state up to err.trusted_step is known clean: the disk.
            return None, f"replicas disagreed at step {err.step}; clean only up to step {err.trusted_step}"
        if not not_ours:
            return None, "this rank's own code failed"
        assert self.snapshots is not None
        if self.snapshots.live_step != trainer.global_step:
            return None, f"step {trainer.global_step} is not the recorded step {self.snapshots.live_step}"
        module, optimizers = trainer.lightning_module, trainer.optimizers
        if self.snapshot_callback is not None:
            listed = self.snapshot_callback.live_params(module, optimizers)
            if listed is not None:
                return listed, "as recorded"
        # No snapshot of this generation listed them: the module must be back in its sharded state.
        reshard_all(module)
        if not params_are_optimized(module, optimizers):
            return None, "registered parameters are not the optimized ones"
        return live_params(module, optimizers), "listed after the fault"

    def _collect_snapshot_cost(self) -> None:
        if self.snapshot_callback is not None:
            self.record_s += self.snapshot_callback.record_s
            self.record_cpu_s += self.snapshot_callback.record_cpu_s
            self.settle_s += self.snapshot_callback.settle_s
            self.records += self.snapshot_callback.records
            self.snapshot_callback = None

    def _latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir is not None else None

    def finish(self) -> None:
        """Account the last generation's snapshot cost (call after ``fit`` returned)."""
        self._collect_snapshot_cost()

    def _count_votes(self) -> None:
        if self.commit is not None:
            self.vote_s += self.commit.wait_s
            self.vote_cpu_s += self.commit.cpu_s
            self.votes += self.commit.votes
            self.commit = None

    def _announce(self, gen: int, reason: str = "fault", **fields: Any) -> None:
        """This rank moved the job to generation ``gen`` first (job-wide): record it once. An elastic
        resize (``reason`` shrink or grow) also records the new set (``elastic_resize``)."""
        assert self.events is not None
        self.events.emit("generation", gen=gen, reason=reason)
        if reason in ("shrink", "grow"):
            assert self.elastic is not None
            active = fields.get("active", [])
            self.events.emit("elastic_resize", gen=gen, reason=reason, dp_size=len(active), **fields)
            print(
                f"rank {self.rank}: generation {gen} trains on {fields.get('replicas')} of "
                f"{self.elastic.replicate} replicas ({reason})",
                file=sys.stderr,
            )

    def _emit(self, kind: str, gen: int, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, rank=self.rank, gen=gen, **fields)

    def _phase(self, phase: str, gen: int, **fields: Any) -> None:
        if self.events is not None:
            if phase == "generation_joined":
                fields["pid"] = os.getpid()  # survivors keep their process: the tests compare pids
            self.events.emit("rank_phase", rank=self.rank, gen=gen, phase=phase, step=None, **fields)
        if phase == "generation_joined" and self.recoveries:
            print(f"rank {self.rank}: joined generation {gen} ({time.strftime('%H:%M:%S')})", file=sys.stderr)
