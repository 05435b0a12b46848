"""InProcessRecovery: ``trainer.fit`` in a loop that survives faults without restarting the process.

On a fault inside ``fit`` (an exception in this rank's code, a collective
failing because a peer died or was killed, or the commit vote abandoned
because the job moved to a new generation), Lightning unwinds ``fit`` and calls
the strategy's ``on_exception``, which cuts this rank's connections so its
peers fail fast. The loop then drops the process group, leaves the generation
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
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from ckless_lightning.callbacks.heartbeat import HeartbeatCallback
from ckless_lightning.callbacks.replication import ReplicationCallback
from ckless_lightning.callbacks.timeline import TimelineCallback
from ckless_lightning.checkpointing import latest_checkpoint
from ckless_lightning.comm import GenerationChanged, JobStore, StepCommit, connect_store
from ckless_lightning.events import EventLog
from ckless_lightning.rank import is_peer_failure
from ckless_lightning.recovery.memory import MEMORY_CHECKPOINT, MemoryRestore
from ckless_lightning.recovery.session import GenerationSession, JobGaveUp
from ckless_lightning.replication import SnapshotStore, Transfer
from ckless_lightning.replication.state import local_state_tensors, reshard_all
from ckless_lightning.strategy import CheckpointlessStrategy

__all__ = ["InProcessRecovery", "JobGaveUp", "MakeTrainer"]

_STATE_KEY = "tier4/state"  # set once any rank recorded a committed step: memory can serve a restore
# (strategy of this generation, callbacks to add to the Trainer) -> Trainer
MakeTrainer = Callable[[CheckpointlessStrategy, list[pl.Callback]], pl.Trainer]


class InProcessRecovery:
    """Runs ``fit`` until it completes, rejoining the job in-process after each fault (tiers 3, 4).

    Args:
        store: the job store (hosted by node 0's agent).
        rank, world_size: this rank and the job's world size.
        generation: the generation this process was started in.
        replicate, shard: the strategy's mesh (see :class:`CheckpointlessStrategy`).
        checkpoint_dir: where the disk checkpoints are (tier 3 reloads the latest).
        timeout_s: collective timeout of each generation's process group.
        events: the job's event log (recovery phases as ``rank_phase`` events).
        on_recovery: called with the last completed step after leaving a generation
            and before joining the next (fault injection's ``recovery`` phase).
        snapshots: tier 4: this rank's :class:`SnapshotStore`; recoveries then restore from
            memory (``source="memory"``) instead of the last disk checkpoint.
        bucket_bytes: tier 4: transfer bucket size.
        corrupt: tier 4 test hook: flips bytes of a bucket in flight on a source.
        on_transfer: tier 4: called with the last completed step as a state transfer starts
            (fault injection's ``transfer`` phase).
    """

    def __init__(
        self,
        store: JobStore,
        *,
        rank: int,
        world_size: int,
        generation: int = 0,
        replicate: int = 1,
        shard: int = -1,
        checkpoint_dir: str | Path | None = None,
        timeout_s: float = 600.0,
        events: EventLog | None = None,
        on_recovery: Callable[[int], None] | None = None,
        snapshots: SnapshotStore | None = None,
        bucket_bytes: int = 64 << 20,
        corrupt: Callable[[Transfer, int, torch.Tensor], None] | None = None,
        on_transfer: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.replicate = replicate
        self.shard = shard
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.timeout_s = timeout_s
        self.events = events
        self.on_recovery = on_recovery or (lambda step: None)
        self.session = GenerationSession(
            store, rank=rank, world_size=world_size, generation=generation, on_phase=self._phase
        )
        self.snapshots = snapshots
        self.bucket_bytes = bucket_bytes
        self.corrupt = corrupt
        self.on_transfer = on_transfer or (lambda step: None)
        self.replication: ReplicationCallback | None = None  # the current generation's (its cost)
        self.record_s = 0.0
        self.settle_s = 0.0
        self.records = 0
        self.recoveries = 0
        self.commit: StepCommit | None = None  # the current generation's vote (its cost: wait_s, votes)
        self.vote_s = 0.0
        self.votes = 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **kwargs: Any) -> InProcessRecovery:
        """Connect to the job store named by the agent's variables (CKLESS_STORE_ADDR/PORT, ...)."""
        env = dict(os.environ if env is None else env)
        store = connect_store(env["CKLESS_STORE_ADDR"], int(env["CKLESS_STORE_PORT"]), is_master=False)
        return cls(
            JobStore(store),
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            generation=int(env.get("CKLESS_GENERATION", "0")),
            **kwargs,
        )

    # -- the loop ------------------------------------------------------------------------------------
    def fit(
        self,
        make_trainer: MakeTrainer,
        make_module: Callable[[], pl.LightningModule],
        *,
        datamodule: pl.LightningDataModule | None = None,
        ckpt_path: str | Path | None = None,
    ) -> pl.Trainer:
        """Train to the end; returns the Trainer of the generation that finished.

        ``ckpt_path`` is where the job starts (generation 0); a process started in
        a later generation (a replacement) and every recovery resume from the
        latest disk checkpoint instead (or ``ckpt_path`` while there is none).
        """
        resume: str | Path | None = ckpt_path
        recovering = self.session.generation > 0
        left_after: int | None = None  # the last completed step, while between generations
        while True:
            trainer: pl.Trainer | None = None
            try:
                if left_after is not None:
                    self.on_recovery(left_after)
                gen = self.session.join()
                left_after = None
                if recovering:
                    resume = self._resume_point(ckpt_path)
                    self._phase("resume_chosen", gen, resumed_from=str(resume) if resume else None)
                trainer = make_trainer(self._strategy(gen), self._callbacks(gen))
                trainer.fit(make_module(), datamodule=datamodule, ckpt_path=resume)
                self._count_votes()
                return trainer
            except JobGaveUp:
                raise
            except Exception as err:  # any fault: leave this generation and rejoin the next
                self._count_votes()
                if trainer is not None:
                    self.session.last_step = trainer.global_step
                self._capture_live_state(trainer, err)
                self._leave(err)
                left_after = self.session.last_step
                recovering = True
            # Out of the except block, the traceback (and with it the old Trainer, module,
            # FSDP state and process groups) is unreachable: free them, threads and sockets too.
            trainer = None
            if datamodule is not None:
                datamodule.trainer = None  # it would keep the old Trainer alive
            gc.collect()

    # -- pieces --------------------------------------------------------------------------------------
    def _strategy(self, gen: int) -> CheckpointlessStrategy:
        self.commit = StepCommit(self.store, generation=gen, world_size=self.world_size)
        memory = None
        if self.snapshots is not None:
            memory = MemoryRestore(
                self.snapshots,
                replicate=self.replicate,
                shard=self.shard if self.shard != -1 else self.world_size // self.replicate,
                checkpoint_dir=self.checkpoint_dir,
                bucket_bytes=self.bucket_bytes,
                events=self.events,
                generation=gen,
                corrupt=self.corrupt,
                on_transfer=lambda: self.on_transfer(self.session.last_step),
            )
        return CheckpointlessStrategy(
            replicate=self.replicate,
            shard=self.shard,
            timeout=timedelta(seconds=self.timeout_s),
            job_store=self.store.store,
            generation=gen,
            on_comm_phase=lambda phase: self._phase(phase, gen),
            commit=self.commit,
            keep_ports=frozenset({self.store.port}),
            memory=memory,
        )

    def _callbacks(self, gen: int) -> list[pl.Callback]:
        """This generation's callbacks, in order; put them first in the Trainer's list (tier 4's
        snapshot must run before any callback that communicates)."""
        callbacks: list[pl.Callback] = []
        if self.snapshots is not None:
            self.replication = ReplicationCallback(self.snapshots, on_first_record=self._mark_state_exists)
            callbacks.append(self.replication)
        callbacks.append(HeartbeatCallback(self.store, rank=self.rank, generation=gen))
        if self.events is not None:
            callbacks.append(TimelineCallback(self.events, rank=self.rank, generation=gen))
        return callbacks

    def _leave(self, err: Exception) -> None:
        """Drop the process group and move past the current generation (a fault, also in recovery)."""
        old = self.session.generation
        last_step = self.session.last_step
        self._phase("recovery_start", old, error=f"{type(err).__name__}: {str(err)[:200]}")
        print(
            f"rank {self.rank}: leaving generation {old} after step {last_step} "
            f"({type(err).__name__}: {str(err)[:200]})",
            file=sys.stderr,
        )
        if dist.is_initialized():
            dist.destroy_process_group()
        new = self.session.leave()
        if self.events is not None and self.store.store.add(f"announced/{new}", 1) == 1:
            self.events.emit("generation", gen=new, reason="fault")
        self.recoveries += 1

    def _resume_point(self, ckpt_path: str | Path | None) -> str | Path | None:
        """Where a recovery resumes: memory (tier 4, once any step was committed), else disk."""
        if self.snapshots is not None and self.store.store.check([_STATE_KEY]):
            return MEMORY_CHECKPOINT
        return self._latest_checkpoint() or ckpt_path

    def _mark_state_exists(self) -> None:
        self.store.store.set(_STATE_KEY, "1")

    def _capture_live_state(self, trainer: pl.Trainer | None, err: Exception) -> None:
        """Tier 4: keep views of this rank's live tensors if they hold its last recorded step.

        Trusted only when this rank's own code did not fail (the error came from a lost peer
        or a changed generation) and no optimizer step completed after the last snapshot.
        """
        if self.snapshots is None:
            return
        if self.snapshots.live_tensors is not None:
            # The fault hit the restore itself (e.g. a peer lost during the transfer): the state
            # captured when leaving the generation before is still the one to restore, untouched.
            self._collect_snapshot_cost()
            return
        module = trainer.lightning_module if trainer is not None else None
        trusted = (
            module is not None
            and (is_peer_failure(err) or isinstance(err, GenerationChanged))
            and self.snapshots.live_step == trainer.global_step  # type: ignore[union-attr]
        )
        tensors = None
        if trusted:
            reshard_all(module)  # type: ignore[arg-type]
            tensors = local_state_tensors(module, trainer.optimizers)  # type: ignore[arg-type, union-attr]
        self.snapshots.capture_live(tensors, trusted=trusted)
        self._collect_snapshot_cost()

    def _collect_snapshot_cost(self) -> None:
        if self.replication is not None:
            self.record_s += self.replication.record_s
            self.settle_s += self.replication.settle_s
            self.records += self.replication.records
            self.replication = None

    def _latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir is not None else None

    def finish(self) -> None:
        """Account the last generation's snapshot cost (call after ``fit`` returned)."""
        self._collect_snapshot_cost()

    def _count_votes(self) -> None:
        if self.commit is not None:
            self.vote_s += self.commit.wait_s
            self.votes += self.commit.votes
            self.commit = None

    def _phase(self, phase: str, gen: int, **fields: Any) -> None:
        if self.events is not None:
            if phase == "generation_joined":
                fields["pid"] = os.getpid()  # survivors keep their process: the tests compare pids
            self.events.emit("rank_phase", rank=self.rank, gen=gen, phase=phase, step=None, **fields)
        if phase == "generation_joined" and self.recoveries:
            print(f"rank {self.rank}: joined generation {gen} ({time.strftime('%H:%M:%S')})", file=sys.stderr)
