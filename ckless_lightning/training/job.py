"""Train one rank of a job: build its Lightning objects from a JobConfig and run them.

This is what every rank process runs (``ckless_lightning.rank``); users who
build their own Trainer can call :func:`build_trainer` and friends directly.
Tiers 0-2 run ``trainer.fit`` once; tiers 3-4 run it inside
:class:`~ckless_lightning.recovery.InProcessRecovery`.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from ckless_lightning.comm import Generation, JobStore
from ckless_lightning.record.events import EventLog
from ckless_lightning.recovery import InProcessRecovery
from ckless_lightning.recovery.digest import StateDigest
from ckless_lightning.recovery.elastic import ElasticPolicy
from ckless_lightning.recovery.where import cuda_busy
from ckless_lightning.replication import SnapshotCopies
from ckless_lightning.runtime.checkpointing import checkpoint_name, is_complete_checkpoint, resolve_resume
from ckless_lightning.runtime.config import JobConfig
from ckless_lightning.runtime.contract import RankContext
from ckless_lightning.runtime.faults import FaultSpec, injected_event
from ckless_lightning.runtime.memory_plan import resolve_accelerator
from ckless_lightning.training.callbacks import (
    DataPositionCallback,
    ElasticAccumulationCallback,
    FaultInjectionCallback,
    HeartbeatCallback,
    LossHistoryCallback,
    RecoveryMetricsCallback,
    SampleLogCallback,
    StepCheckpoint,
    StepProgressBar,
    StepStatsCallback,
    TimelineCallback,
)
from ckless_lightning.training.datamodule import TokenDataModule
from ckless_lightning.training.environment import GenerationEnvironment
from ckless_lightning.training.module import CausalLMModule
from ckless_lightning.training.quiet import quiet_known_noise
from ckless_lightning.training.strategy import CheckpointlessStrategy

__all__ = [
    "ScriptParts",
    "build_datamodule",
    "build_elastic_policy",
    "build_logger",
    "build_module",
    "build_trainer",
    "train_rank",
]


def build_logger(job: JobConfig) -> Logger:
    """The job's experiment logger (``logger``: ``conf/logger/``, CSV by default), built with
    ``hydra.utils.instantiate``. Each Trainer gets a new one: CSV and TensorBoard start a new version
    folder (``losses.jsonl`` holds the whole loss curve across restarts)."""
    assert job.logger is not None  # JobConfig.__post_init__ resolves the default
    logger = instantiate(job.logger.to_mapping(), _convert_="all")
    if not isinstance(logger, Logger):
        raise TypeError(f"logger._target_={job.logger.target} built a {type(logger).__name__}, not a Logger")
    return logger


def build_trainer(
    job: JobConfig,
    *,
    callbacks: list[pl.Callback] | None = None,
    strategy: CheckpointlessStrategy | None = None,
    rank: int = 0,
    generation: int = 0,
    user: Mapping[str, Any] | None = None,
) -> pl.Trainer:
    """A Trainer for ``job`` on this rank: our strategy, the job's logger, DCP checkpoints.

    ``rank``: this process's global rank. Only rank 0 gets the logger (Lightning's loggers write on
    rank 0 only; building them there alone keeps the other ranks off the tracking store, which
    MLflow's client opens in its constructor). ``generation``: the job generation this Trainer
    trains in; after a recovery (``> 0``) rank 0 logs what it cost (``RecoveryMetricsCallback``).
    ``user``: a script's Trainer keyword arguments (:func:`~ckless_lightning.training.script_rank.fit`):
    they replace the recipe's ``trainer.*`` (Lightning's defaults where they say nothing); their
    ``callbacks`` come after ours, a ``logger`` of theirs replaces the job's.
    A strategy of an elastic generation that trains part of the job (``strategy.generation.active``)
    sets the Trainer's world: its ranks, its accumulation (the same global batch on fewer ranks).
    """
    run_dir = Path(job.run_dir)
    view = strategy.generation if strategy is not None else None
    environment = TorchElasticEnvironment()
    world_size = job.cluster.world_size
    if view is not None and view.active is not None:
        environment = GenerationEnvironment(view)
        rank, world_size = view.rank, view.world_size
    # ``callbacks`` right after the data position and the loss record: tier 4's snapshot must see the
    # committed loader position and run before any callback that communicates (see SnapshotCallback),
    # and a step's loss must be on disk before the step is recorded in memory: a rank 0 killed
    # between the two would otherwise leave a step the job resumes after with no loss (chaos soak,
    # 2026-12-08). LossHistoryCallback does not communicate at a step's end (its all-reduce is
    # before the update); a kill after its record and before the snapshot redoes the step, whose
    # loss is then recorded twice, the same.
    all_callbacks: list[pl.Callback] = [
        DataPositionCallback(),
        LossHistoryCallback(run_dir / "losses.jsonl"),
        *(callbacks or []),
        StepStatsCallback(run_dir / "step_stats"),
    ]
    if job.checkpoint.every_n_steps:
        all_callbacks.append(
            StepCheckpoint(
                job.checkpoint.dir,
                every_n_train_steps=job.checkpoint.every_n_steps,
                keep_last=job.checkpoint.keep_last,
            )
        )
    if job.data.record_samples:
        all_callbacks.append(SampleLogCallback(run_dir / "samples", generation=generation))
    if job.elastic.enabled:
        all_callbacks.append(ElasticAccumulationCallback())
    if rank == 0 and generation > 0:  # after LossHistoryCallback: losses.jsonl has the step
        all_callbacks.append(RecoveryMetricsCallback(run_dir, generation=generation, world_size=world_size))
    trainer_cfg = job.trainer
    if user is not None:
        user = dict(user)
        all_callbacks.extend(_as_list(user.pop("callbacks", None)))
        settings: dict[str, Any] = {"default_root_dir": run_dir, **user}
    else:
        if trainer_cfg.enable_progress_bar:
            all_callbacks.append(StepProgressBar())
        settings = dict(
            precision=trainer_cfg.precision,
            max_steps=trainer_cfg.max_steps,
            accumulate_grad_batches=job.accumulate_at(world_size),
            gradient_clip_val=trainer_cfg.gradient_clip_val,
            gradient_clip_algorithm="norm",
            log_every_n_steps=trainer_cfg.log_every_n_steps,
            enable_progress_bar=trainer_cfg.enable_progress_bar,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=run_dir,
        )
    if "logger" not in settings:
        settings["logger"] = build_logger(job) if rank == 0 else False
    # Checkpoints are ours (checkpoint.*): without this, checkpoint.every_n_steps=0 would get
    # Lightning's default ModelCheckpoint, a full checkpoint at the end of each epoch (1.3 GB at 100M).
    settings.setdefault("enable_checkpointing", any(isinstance(c, ModelCheckpoint) for c in all_callbacks))
    return pl.Trainer(
        accelerator=resolve_accelerator(job.cluster.accelerator),
        devices=job.cluster.nproc_per_node,
        num_nodes=job.cluster.nnodes,
        strategy=strategy or CheckpointlessStrategy(replicate=job.cluster.replicate, shard=job.cluster.shard),
        plugins=[environment],
        # The built-in loader shards the data itself; a user's loader is sharded by the strategy
        # (CheckpointlessStrategy.process_dataloader), with an order that survives a recovery.
        use_distributed_sampler=False,
        callbacks=all_callbacks,
        **settings,
    )


def _as_list(callbacks: Any) -> list[pl.Callback]:
    if callbacks is None:
        return []
    return [callbacks] if isinstance(callbacks, pl.Callback) else list(callbacks)


def build_module(job: JobConfig) -> pl.LightningModule:
    """The job's LightningModule (``module``): the built-in CausalLMModule from ``model``/``optim``/
    ``fsdp``, or the user's class built by ``hydra.utils.instantiate``. Called once per generation
    (tiers 3-4: every recovery builds a new one)."""
    if job.module.builtin:
        return CausalLMModule(
            job.model, optim=job.optim, fsdp=job.fsdp, seed=job.seed, max_steps=job.trainer.max_steps
        )
    return _instantiate(job.module.to_mapping(), pl.LightningModule, "module")


def build_datamodule(job: JobConfig, batch_cache: str | None = None) -> pl.LightningDataModule:
    """The job's LightningDataModule (``datamodule``): the built-in TokenDataModule from ``data``
    (``batch_cache``: tier 2's node cache), or the user's class built by ``hydra.utils.instantiate``."""
    if not job.datamodule.builtin:
        return _instantiate(job.datamodule.to_mapping(), pl.LightningDataModule, "datamodule")
    return TokenDataModule(
        job.data,
        accumulate_grad_batches=job.accumulate_grad_batches,
        max_steps=job.trainer.max_steps,
        batch_cache=batch_cache,
        cache_timeout_s=job.agent.startup_timeout,
        elastic=job.elastic.enabled,
        dp_size=job.cluster.world_size,
    )


def _instantiate(config: dict[str, object], kind: type, key: str) -> Any:
    built = instantiate(config, _convert_="all")
    if not isinstance(built, kind):
        raise TypeError(
            f"{key}._target_={config['_target_']} built a {type(built).__name__}, not a {kind.__name__}"
        )
    return built


def build_elastic_policy(job: JobConfig) -> ElasticPolicy | None:
    """The elastic HSDP rules of ``job`` (``elastic.enabled``), or None."""
    if not job.elastic.enabled:
        return None
    replicate, shard = job.cluster.mesh_shape
    return ElasticPolicy(
        replicate=replicate,
        shard=shard,
        min_replicas=job.elastic.min_replicas,
        replace_timeout_s=job.agent.replace_timeout,
        max_steps=job.trainer.max_steps,
    )


@dataclass(frozen=True)
class _RankRun:
    """What both ways of training one rank need, built once by :func:`train_rank`."""

    job: JobConfig
    context: RankContext
    events: EventLog
    ckpt_path: Path | str | None  # where generation 0 starts (checkpoint.resume)
    datamodule: pl.LightningDataModule | None
    specs: list[FaultSpec]
    make_module: Callable[[], pl.LightningModule]  # one per generation
    trainer_kwargs: Mapping[str, Any] | None = None  # a script's (build_trainer's ``user``)

    def trainer(
        self, callbacks: list[pl.Callback], strategy: CheckpointlessStrategy, generation: int
    ) -> pl.Trainer:
        return build_trainer(
            self.job,
            callbacks=callbacks,
            strategy=strategy,
            rank=self.context.rank,
            generation=generation,
            user=self.trainer_kwargs,
        )

    def phase(self, name: str, **fields: object) -> None:
        """A ``rank_phase`` event of this rank in the generation it started in."""
        ctx = self.context
        self.events.emit("rank_phase", rank=ctx.rank, gen=ctx.generation, phase=name, **fields)

    def fault_callback(
        self, generation: Callable[[], int] | None = None, snapshots: SnapshotCopies | None = None
    ) -> FaultInjectionCallback:
        """A fresh fault injector for this rank (one per Trainer); its ``fault_injected`` events carry
        ``generation()`` at the time of the fault (default: the generation the process started in);
        ``snapshots``: tier 4's copies (a ``corrupt_copy`` fault's target)."""
        ctx = self.context
        current = generation or (lambda: ctx.generation)
        return FaultInjectionCallback(
            self.specs,
            rank=ctx.rank,
            marker_dir=Path(self.job.run_dir) / "faults",
            on_inject=lambda spec: self.events.emit(
                "fault_injected", **injected_event(spec, "inside"), gen=current()
            ),
            node_agent_pid=ctx.agent_pid,
            snapshots=snapshots,
        )


@dataclass(frozen=True)
class ScriptParts:
    """What a user's script hands :func:`train_rank` instead of the recipe's module and DataModule."""

    make_module: Callable[[], pl.LightningModule]  # a new module per generation
    datamodule: pl.LightningDataModule | None
    trainer_kwargs: Mapping[str, Any]  # pl.Trainer's keyword arguments but the reserved ones
    ckpt_path: str | Path | None = None  # where generation 0 starts; None: checkpoint.resume
    seed: bool = True  # seed as the job says (``seed``); False: the script seeded itself


def train_rank(job: JobConfig, context: RankContext, script: ScriptParts | None = None) -> pl.Trainer | None:
    """Train ``job`` on this rank, resuming per ``checkpoint.resume``; save the final step if asked.
    Returns the Trainer that finished (None: an elastic job's rank that stood by at the end).

    ``context`` is what the agent told this process (heartbeats, generation, job
    store); under torchrun (no store) the rank runs on Lightning's own init. ``script``: a user's
    script's module, data and Trainer settings (``python -m ckless_lightning.run``).
    """
    quiet_known_noise(job.checkpoint.dir)
    events = EventLog(Path(job.run_dir) / "events.jsonl", source=f"rank{context.rank}")
    if context.spawn_time:
        events.emit(
            "rank_phase",
            rank=context.rank,
            gen=context.generation,
            phase="process_start",
            step=None,
            t=context.spawn_time,
        )
    events.emit("rank_phase", rank=context.rank, gen=context.generation, phase="imports_done", step=None)
    # Tiers 3-4 run a full garbage collection after every fault to free the old generation (its
    # Trainer, module and groups sit in reference cycles): leave the imported modules' objects,
    # which live as long as the process, out of it (llama3_tiny: 0.5 s -> 0.02 s per recovery).
    gc.freeze()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.cluster.nproc_per_node))
    if script is None or script.seed:
        pl.seed_everything(job.seed, workers=True, verbose=False)
    resume = resolve_resume(job.checkpoint.resume, job.checkpoint.dir)
    if script is None:
        run = _RankRun(
            job,
            context,
            events,
            resume,
            build_datamodule(job, context.batch_cache),
            job.fault_specs(),
            make_module=lambda: build_module(job),
        )
    else:
        run = _RankRun(
            job,
            context,
            events,
            script.ckpt_path if script.ckpt_path is not None else resume,
            script.datamodule,
            job.fault_specs(),
            make_module=script.make_module,
            trainer_kwargs=script.trainer_kwargs,
        )
    if job.tier >= 3:  # the final save runs inside the recovery: a fault during it is recovered
        trainer = _train_in_process(run, after_fit=lambda trainer: _save_final(job, trainer))
    else:
        trainer = _train_once(run)
        _save_final(job, trainer)
    _finish_wandb_run()
    return trainer


def _finish_wandb_run() -> None:
    """Write out the W&B run of ``logger=wandb`` (rank 0). W&B does it at interpreter exit, which
    tiers 3-4's ranks skip (``os._exit`` after the final checkpoint); Lightning's ``finalize`` does not
    (the run outlives a Trainer: tiers 3-4's recoveries continue it). ``teardown`` waits until W&B's
    service process has written the run (after ``finish`` alone, 1 in 15 offline runs still lacked
    the last records in a test on the 2-core machine)."""
    wandb = sys.modules.get("wandb")  # imported by WandbLogger only
    if wandb is not None and wandb.run is not None:
        wandb.finish()
        wandb.teardown()


def _save_final(job: JobConfig, trainer: pl.Trainer) -> None:
    """The final step's checkpoint when ``checkpoint.save_final`` (unless it exists, complete)."""
    if job.checkpoint.save_final:
        final = Path(job.checkpoint.dir) / checkpoint_name(trainer.global_step)
        if not is_complete_checkpoint(final):
            trainer.save_checkpoint(final, weights_only=False)


def _generation(job: JobConfig, context: RankContext, store: JobStore) -> Generation:
    return Generation(
        store,
        number=context.generation,
        rank=context.rank,
        world_size=job.cluster.world_size,
        mesh=job.cluster.mesh_shape,
        pg_timeout_s=job.comm.pg_timeout_s,
        init_timeout_s=job.comm.init_timeout_s,
        join_timeout_s=job.comm.join_timeout_s,
        stuck_grace_s=job.comm.stuck_grace_s,
        stuck_exit_s=job.comm.stuck_exit_s,
        vote=job.comm.vote,
    )


def _train_once(run: _RankRun) -> pl.Trainer:
    """Tiers 0-2: one ``trainer.fit``; a fault ends the process and the agent restarts every rank."""
    job, context = run.job, run.context
    callbacks: list[pl.Callback] = [
        TimelineCallback(run.events, rank=context.rank, generation=context.generation),
        run.fault_callback(),
    ]
    store = None
    if context.has_store:
        store = JobStore.connect(context.store_addr, context.store_port, secret=context.store_secret)  # type: ignore[arg-type]
        beats = context.beats(store)
        callbacks.append(HeartbeatCallback(beats, rank=context.rank, generation=context.generation))
    strategy = CheckpointlessStrategy(
        replicate=job.cluster.replicate,
        shard=job.cluster.shard,
        timeout=timedelta(seconds=job.comm.pg_timeout_s),
        generation=_generation(job, context, store) if store is not None and job.comm.rootless else None,
        on_phase=lambda name, **fields: run.phase(name, step=None, **fields),
        weights_from_checkpoint=run.ckpt_path is not None,
    )
    trainer = run.trainer(callbacks, strategy, context.generation)
    trainer.fit(run.make_module(), datamodule=run.datamodule, ckpt_path=run.ckpt_path)
    return trainer


def _train_in_process(run: _RankRun, *, after_fit: Callable[[pl.Trainer], None]) -> pl.Trainer | None:
    """Tiers 3-4: ``fit`` and then ``after_fit`` inside :class:`InProcessRecovery`; faults are
    recovered in this process."""
    job, context, events = run.job, run.context, run.events
    if not context.has_store:
        raise ValueError(
            f"tier={job.tier} recovers through the node agent's job store; start the job with launch.py "
            "(or set CKLESS_STORE_ADDR / CKLESS_STORE_PORT to a running agent's store)"
        )
    store = JobStore.connect(context.store_addr, context.store_port, secret=context.store_secret)  # type: ignore[arg-type]
    cluster, replication = job.cluster, job.replication
    snapshots = None
    if job.tier == 4:
        snapshots = SnapshotCopies(
            rank=context.rank,
            world_size=cluster.world_size,
            source=replication.resolved_source(cluster.replicate),
            every_n_steps=replication.every_n_steps,
            buddy_offset=replication.resolved_offset(cluster.nnodes, cluster.nproc_per_node),
            loop_capacity=int(replication.loop_capacity_mb * (1 << 20)),
        )
    recovery = InProcessRecovery(
        _generation(job, context, store),
        checkpoint_dir=job.checkpoint.dir,
        events=events,
        faults=run.fault_callback(lambda: recovery.session.generation, snapshots),
        snapshots=snapshots,
        bucket_bytes=int(replication.bucket_mb * (1 << 20)),
        digest=StateDigest(replication.digest_every) if replication.digest_every else None,
        elastic=build_elastic_policy(job),
        device_busy=_device_busy(job),
        beats=context.beats(store),
        warm_first_step=job.trainer.warm_first_step,
    )
    trainer = recovery.fit(
        lambda strategy, callbacks: run.trainer(
            [*callbacks, run.fault_callback(lambda: recovery.session.generation, snapshots)],
            strategy,
            recovery.session.generation,  # the generation just joined
        ),
        run.make_module,
        datamodule=run.datamodule,
        ckpt_path=run.ckpt_path,
        after_fit=after_fit,
    )
    recovery.finish()
    if recovery.votes:
        events.emit(
            "commit_votes",
            rank=context.rank,
            votes=recovery.votes,
            vote_s=round(recovery.vote_s, 6),
            vote_cpu_s=round(recovery.vote_cpu_s, 6),
            recoveries=recovery.recoveries,
            snapshots=recovery.records,
            snapshot_s=round(recovery.record_s, 6),
            snapshot_cpu_s=round(recovery.record_cpu_s, 6),
            exchange_wait_s=round(recovery.settle_s, 6),
            host_copy_bytes=snapshots.host_bytes() if snapshots is not None else 0,
            digests=recovery.digest.count if recovery.digest is not None else 0,
            digest_s=round(recovery.digest.seconds, 6) if recovery.digest is not None else 0.0,
        )
    return trainer


def _device_busy(job: JobConfig) -> Callable[[], bool] | None:
    """On a GPU, whether this rank's device has unfinished work (the agent's hang blame); None on CPU."""
    if resolve_accelerator(job.cluster.accelerator) != "gpu":
        return None
    return cuda_busy(torch.cuda.current_device())
