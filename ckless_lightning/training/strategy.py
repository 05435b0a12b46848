"""CheckpointlessStrategy: FSDP2 / HSDP through Lightning's ModelParallelStrategy.

The strategy owns the (replicate, shard) DeviceMesh; the LightningModule's
``configure_model`` applies the model family's FSDP2 plan over it (Lightning's
convention for ModelParallelStrategy). Disk checkpoints are sharded DCP
checkpoints, saved and loaded by the parent class.

Materialization: a LightningModule that leaves its model on the meta device in
``configure_model`` and defines ``reset_parameters()`` (initialize every weight)
is materialized here, in ``setup``: allocated on the device (derived buffers
recomputed by each submodule's ``reset_buffers()``), and initialized only when
the fit starts from scratch. A fit that restores (``weights_from_checkpoint``)
skips the initialization, whose result the restore would overwrite; tier 4's
survivors go further and adopt their live shards as the new parameters
(:mod:`~ckless_lightning.replication.adopt`). Other modules are materialized by
Lightning as usual.

The recovery tiers do not extend this class: the in-process recovery loop
(``ckless_lightning.recovery``) sits above it and builds one strategy per
generation, handing it what that generation needs: the
:class:`~ckless_lightning.comm.Generation` (process groups on the job store),
a step vote, what to do when this rank leaves the generation, and tier 4's
:class:`InMemoryState` (the seam where state from memory enters Lightning's
restore path, ``load_checkpoint``). The strategy imports none of recovery.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from ckless_lightning.comm import Generation, init_generation_process_group
from ckless_lightning.models import build_mesh, resolve_mesh
from ckless_lightning.replication.adopt import allocate_buffers
from ckless_lightning.replication.state import (
    RNG_KEY,
    LiveStateListing,
    param_groups_of,
    rng_state,
    set_rng_state,
)
from ckless_lightning.replication.warmup import (
    clip_norm_of,
    mark_process_warm,
    process_is_warm,
    warm_first_step,
)
from ckless_lightning.runtime.checkpointing import commit_checkpoint, staging_path
from ckless_lightning.runtime.contract import UsageError
from ckless_lightning.training._lightning_compat import init_distributed, install_device_mesh

__all__ = ["MEMORY_CHECKPOINT", "CheckpointlessStrategy", "InMemoryState"]

# ``fit(ckpt_path=MEMORY_CHECKPOINT)``: restore the committed step from memory (tier 4), not from a file.
MEMORY_CHECKPOINT = "ckless-memory://committed-step"
RNG_BY_RANK = "ckless_rng_by_rank"  # a disk checkpoint's key: every rank's RNG state, by rank


class InMemoryState(Protocol):
    """Tier 4's state in memory, as the strategy uses it (``recovery.MemoryRestore`` implements it)."""

    def attach(self) -> None:
        """Once per generation, after the default process group and the mesh exist."""

    def adopt(self, module: torch.nn.Module) -> bool:
        """On the model still on meta, before the optimizers exist: make this rank's live state its
        parameters; False if there is none (the model is then allocated)."""
        ...

    def restore(self, module: torch.nn.Module, optimizers: list[Optimizer]) -> dict[str, Any] | Path:
        """Collectively: the committed step's checkpoint dict (tensors already in place), or the disk
        checkpoint to load instead."""
        ...


class CheckpointlessStrategy(ModelParallelStrategy):
    """FSDP2 (``replicate=1``) or HSDP (``replicate>1``) over a ("replicate", "shard") mesh.

    Args:
        replicate: number of model replicas (HSDP outer dimension).
        shard: ranks each replica is sharded over; ``-1`` derives it from the world size.
        process_group_backend: ``None`` picks NCCL on CUDA and gloo on CPU.
        timeout: collective timeout of the default process group.
        generation: tier 1+: the job generation this rank is in; the process group is formed on
            the job store under the generation's prefix instead of through rank 0's rendezvous,
            and the mesh and timeout come from it (``replicate``/``shard``/``timeout`` are ignored).
        on_phase: called with "comm_init_start" / "comm_init_done", and "model_ready" with
            ``weights`` ("initialized", "allocated" or "adopted") and ``seconds`` (the timeline).
        weights_from_checkpoint: ``fit`` is given a ``ckpt_path``: the weights and optimizer state
            come from it, so the model is allocated, not initialized (a fit that then loads no
            checkpoint raises before training).
        step_vote: tier 3+: called with the step in progress and a getter of this rank's local
            state tensors (for the state digest) after its gradients are complete and clipped,
            before the update (see :meth:`optimizer_step`); raises to abandon the step.
        on_leave: tier 3+: called from :meth:`on_exception` while the process group still exists,
            so that this rank's peers notice it leaving at once.
        memory: tier 4: serves ``fit(ckpt_path=MEMORY_CHECKPOINT)`` from memory.
        data_seed: orders a user's shuffled train loader (:meth:`process_dataloader`), with the epoch;
            None: the seed of ``lightning.seed_everything``, as Lightning's own DistributedSampler.
        warm_first_step: tiers 3-4: a process that never stepped its optimizer (a replaced rank) warms
            DTensor's caches for its first step (the gradient clipping's norm and the optimizer step)
            once the checkpoint is loaded (:func:`~ckless_lightning.replication.warmup.warm_first_step`;
            no bit changes), unless
            tier 4's restore already did while the state moved. A ``first_step_warmed`` phase says so.
    """

    def __init__(
        self,
        replicate: int = 1,
        shard: int = -1,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        *,
        generation: Generation | None = None,
        on_phase: Callable[..., None] | None = None,
        weights_from_checkpoint: bool = False,
        step_vote: Callable[[int, Callable[[], Sequence[torch.Tensor]]], None] | None = None,
        on_leave: Callable[[], None] | None = None,
        memory: InMemoryState | None = None,
        data_seed: int | None = None,
        warm_first_step: bool = False,
    ) -> None:
        if generation is not None:
            (replicate, shard), timeout = generation.mesh, timedelta(seconds=generation.pg_timeout_s)
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if replicate < 1 or (shard != -1 and shard < 1):
            raise ValueError(f"replicate must be >= 1 and shard >= 1 or -1, got ({replicate}, {shard})")
        self._replicate = replicate
        self._shard = shard
        self._generation = generation
        self._on_phase = on_phase or (lambda phase, **fields: None)
        self._weights_from_checkpoint = weights_from_checkpoint
        self._checkpoint_loaded = False
        self._rng_to_restore: dict[str, Any] | None = None  # from the checkpoint, until training starts
        self._step_vote = step_vote
        self._vote_state = LiveStateListing()  # what the vote's state digest reads, listed once
        self._on_leave = on_leave
        self._memory = memory
        self._light = False
        self._data_seed = data_seed
        self._warm_first_step = warm_first_step

    @property
    def generation(self) -> Generation | None:
        """The job generation this strategy trains in (tier 1+), or None (Lightning's own init)."""
        return self._generation

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(replicate, shard) as resolved against the world size."""
        return resolve_mesh(self.world_size, self._replicate, self._shard)

    @property
    def data_parallel_rank(self) -> int:
        """Every rank is a data-parallel rank in FSDP and HSDP: rank r*S + s reads its own batches."""
        return self.global_rank

    @property
    def data_parallel_size(self) -> int:
        return self.world_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @override
    def setup_environment(self) -> None:
        self._on_phase("comm_init_start")
        if self._generation is not None:
            gen = self._generation
            init_generation_process_group(
                gen.store,
                backend=self._process_group_backend
                or ("nccl" if self.root_device.type == "cuda" else "gloo"),
                rank=gen.rank,
                world_size=gen.world_size,
                generation=gen.number,
                timeout_s=gen.pg_timeout_s,
                init_timeout_s=gen.init_timeout_s,
                device=self.root_device,
            )
        init_distributed(self)  # Lightning's own init is skipped when the group exists already
        self._on_phase("comm_init_done")
        install_device_mesh(self, build_mesh(self.root_device, self.mesh_shape))
        if self._memory is not None:
            self._memory.attach()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        _check_sharded(module, self.world_size)
        if callable(getattr(module, "reset_parameters", None)) and _has_meta_parameters(module):
            self._materialize(module)
        super().setup(trainer)  # Lightning's own materialization finds nothing left on meta

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The train loader, able to save and restore the position of the last trained batch and
        reading this rank's part of the data
        (:func:`~ckless_lightning.data.positioned_loader.positioned_loader`: a ``DataLoader`` or
        torchdata's ``StatefulDataLoader``); other loaders as they are."""
        module = self.lightning_module
        if module is None or not module.trainer.training:
            return dataloader
        from ckless_lightning.data.positioned_loader import positioned_loader

        seed = self._data_seed
        if seed is None:  # Lightning's convention (trainer/connectors/data_connector.py, 2.6)
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return positioned_loader(
            dataloader, rank=self.data_parallel_rank, world_size=self.data_parallel_size, seed=seed
        )

    def _materialize(self, module: pl.LightningModule) -> None:
        """Allocate the model on the device; initialize it only if no checkpoint will overwrite it."""
        start = time.perf_counter()
        if self._weights_from_checkpoint and self._memory is not None and self._memory.adopt(module):
            weights = "adopted"
            allocate_buffers(module, self.root_device)
        else:
            weights = "allocated" if self._weights_from_checkpoint else "initialized"
            module.to_empty(device=self.root_device)
        for sub in module.modules():
            if sub is not module and callable(reset_buffers := getattr(sub, "reset_buffers", None)):
                reset_buffers()
        if not self._weights_from_checkpoint:
            module.reset_parameters()  # type: ignore[operator]
        self._on_phase("model_ready", weights=weights, seconds=round(time.perf_counter() - start, 6))

    @override
    def on_train_start(self) -> None:
        if self._weights_from_checkpoint and not self._checkpoint_loaded:
            raise RuntimeError(
                "CheckpointlessStrategy(weights_from_checkpoint=True) but fit() loaded no checkpoint: the "
                "weights were allocated, never initialized; pass ckpt_path to fit() or drop the flag"
            )
        # The checkpoint's RNG state, now that the train loader is built: a loader's sampler may draw
        # its seed from torch's RNG when built (torchdata's RandomSampler does), which in a run
        # without the fault happened before the first step, not after the restore.
        set_rng_state(self._rng_to_restore)
        self._rng_to_restore = None
        super().on_train_start()

    @contextmanager
    def light_state(self) -> Iterator[None]:
        """Within it, Lightning's checkpoint dict leaves out weights and optimizer tensors (tier 4's
        per-step snapshot: the tensors stay live in memory)."""
        self._light = True
        try:
            yield
        finally:
            self._light = False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self._light else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._light:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return {"param_groups": param_groups_of([optimizer])[0]}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Lightning's DCP checkpoint, holding every rank's RNG state (``ckless_rng_by_rank``, in the
        metadata rank 0 writes): a module that draws random numbers while training (dropout)
        resumes each rank's stream where it was. Collective: every rank calls it (as Lightning does)."""
        checkpoint[RNG_BY_RANK] = self._rng_by_rank()
        gen = self._generation
        if gen is None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        # Tier 1+: written under a staging name, committed by rank 0 only while the job is still in this
        # generation (runtime/checkpointing.py); Lightning's Trainer.save_checkpoint barriers after this.
        final = Path(self.broadcast(str(filepath)))
        staging = staging_path(final, gen.number)
        super().save_checkpoint(checkpoint, staging, storage_options=storage_options)
        if self.global_rank == 0:
            commit_checkpoint(staging, final, current=gen.store.generation() == gen.number)

    def _rng_by_rank(self) -> list[dict[str, Any]]:
        state = rng_state()
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return [state]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, state)
        return gathered

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Tier 4's ``MEMORY_CHECKPOINT`` is served from memory; anything else is a DCP checkpoint.
        This rank's RNG state from either (see :meth:`save_checkpoint`) is set when training starts."""
        self._checkpoint_loaded = True
        if checkpoint_path == MEMORY_CHECKPOINT:
            if self._memory is None:
                raise ValueError(f"{MEMORY_CHECKPOINT} needs tier 4: build the strategy with memory=...")
            assert self.lightning_module is not None
            restored = self._memory.restore(self.lightning_module, list(self.optimizers))
            if isinstance(restored, dict):
                self._rng_to_restore = restored.pop(RNG_KEY, None)
                self._warm_up()
                return restored
            checkpoint_path = restored  # no live copy of some state: the disk fallback
        loaded = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        states = loaded.pop(RNG_BY_RANK, None)
        if states is not None and len(states) == self.world_size:
            self._rng_to_restore = states[self.global_rank]
        elif states is not None:
            print(
                f"rank {self.global_rank}: {checkpoint_path} holds the RNG state of {len(states)} ranks, "
                f"this generation trains {self.world_size}: random draws (dropout) go on from this "
                "process's own RNG, not as in a run without the fault",
                file=sys.stderr,
            )
        self._warm_up()
        return loaded

    def _warm_up(self) -> None:
        """After a restore, in a process that never stepped (see ``warm_first_step``)."""
        if not self._warm_first_step or process_is_warm() or not self.optimizers:
            return
        done = warm_first_step(list(self.optimizers), clip_norm_of(self.lightning_module))
        self._on_phase(
            "first_step_warmed", seconds=round(done.seconds, 6), params=done.params, clipped=done.clipped
        )
        for why in done.skipped:
            print(f"rank {self.global_rank}: first-step warm-up skipped: {why}", file=sys.stderr)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Forward, backward and clipping (the closure), then the commit vote, then the update.

        On an accelerator the vote waits for the device to finish the step's work (every stream:
        NCCL's reduce-scatter included), so that a committed vote means reduced gradients.

        Lightning runs the closure inside ``optimizer.step(closure)``, and the
        precision plugin clips inside that closure; there is no hook between
        clipping and the update. The precision plugin is therefore handed a
        stand-in whose ``step`` runs the closure, votes, and only then calls the
        real ``optimizer.step()`` (its step hooks fire after the vote). Needs an
        optimizer that evaluates the closure once (every first-order optimizer).
        """
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        step_in_progress = (trainer.global_step + 1) if trainer is not None else 0
        step_vote, module, listing = self._step_vote, self.lightning_module, self._vote_state

        def vote() -> None:
            if step_vote is not None and module is not None:
                step_vote(step_in_progress, lambda: listing.tensors(module, [optimizer]))

        device = self.root_device
        wait_for_device = None
        if step_vote is not None and device.type not in ("cpu", "meta"):
            wait_for_device = lambda: torch.accelerator.synchronize(device)  # every stream of the device
        stand_in = _CommitThenStep(optimizer, vote, wait_for_device=wait_for_device)
        result = super().optimizer_step(stand_in, closure, model, **kwargs)
        mark_process_warm()  # its caches now hold the step's entries (warm_first_step)
        return result

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tier 3+: this rank leaves the generation (``on_leave``: peers' pending collectives fail now)."""
        if self._on_leave is not None:
            self._on_leave()


def _check_sharded(module: pl.LightningModule, world_size: int) -> None:
    """On more than one rank every parameter must be a DTensor (sharded or replicated over the
    mesh by ``fully_shard`` in ``configure_model``): a plain one would be trained as a separate
    copy on each rank, with no gradient reduction and no error."""
    if world_size < 2:
        return
    plain = [name for name, p in module.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        more = f" and {len(plain) - 1} more" if len(plain) > 1 else ""
        raise UsageError(
            f"{type(module).__name__}'s parameter {plain[0]!r}{more} is not sharded: on {world_size} "
            "ranks each would train its own copy. In configure_model, apply FSDP2 over the "
            "strategy's mesh: mesh = ckless_lightning.models.data_parallel_mesh(self.device_mesh), "
            "then torch.distributed.fsdp.fully_shard(block, mesh=mesh) for each block and "
            "fully_shard(self.<model>, mesh=mesh)"
        )


def _has_meta_parameters(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


class _CommitThenStep:
    """Stands in for an optimizer in the precision plugin: closure, the device's work done, vote,
    then the real update.

    ``wait_for_device`` runs between the closure and the vote: on an accelerator the closure only
    queues the backward and the gradients' reduce-scatter, so without it "every rank voted" would
    mean every rank queued them, and a fault (an NCCL abort) after the vote could leave partial
    gradients for the update to apply.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        vote: Callable[[], None],
        *,
        wait_for_device: Callable[[], None] | None = None,
    ) -> None:
        self._optimizer = optimizer
        self._vote = vote
        self._wait_for_device = wait_for_device

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        if self._wait_for_device is not None:
            self._wait_for_device()
        self._vote()
        self._optimizer.step(**kwargs)
        return result

    def __getattr__(self, name: str) -> Any:  # param_groups, state, zero_grad... of the real one
        return getattr(self._optimizer, name)
