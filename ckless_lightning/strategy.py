"""CheckpointlessStrategy: FSDP2 / HSDP through Lightning's ModelParallelStrategy.

The strategy owns the (replicate, shard) DeviceMesh; the LightningModule's
``configure_model`` applies the model family's FSDP2 plan over it (Lightning's
convention for ModelParallelStrategy). Disk checkpoints are sharded DCP
checkpoints, saved and loaded by the parent class. The recovery tiers extend
this class: it is the seam where process groups are re-formed and where
in-memory state enters Lightning's restore path (``load_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed import Store
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim import Optimizer
from typing_extensions import override

from ckless_lightning._lightning_compat import init_distributed, install_device_mesh
from ckless_lightning.comm import init_generation_process_group
from ckless_lightning.comm.commit import StepCommit
from ckless_lightning.comm.sever import fail_fast
from ckless_lightning.recovery.memory import MEMORY_CHECKPOINT, MemoryRestore
from ckless_lightning.replication.state import param_groups_of

__all__ = ["MESH_DIM_NAMES", "CheckpointlessStrategy"]

MESH_DIM_NAMES = ("replicate", "shard")


class CheckpointlessStrategy(ModelParallelStrategy):
    """FSDP2 (``replicate=1``) or HSDP (``replicate>1``) over a ("replicate", "shard") mesh.

    Args:
        replicate: number of model replicas (HSDP outer dimension).
        shard: ranks each replica is sharded over; ``-1`` derives it from the world size.
        process_group_backend: ``None`` picks NCCL on CUDA and gloo on CPU.
        timeout: collective timeout of the default process group.
        job_store: the agent's store (tier 1): the process group is formed on it under
            the ``generation``'s prefix instead of through rank 0's rendezvous.
        generation: the job's generation this process belongs to.
        on_comm_phase: called with "comm_init_start" / "comm_init_done" (the timeline).
        commit: tier 3+: the generation's step-commit vote, taken after the gradients are
            complete and clipped, before the update (see :meth:`optimizer_step`).
        keep_ports: tier 3+: on an exception, every TCP connection of this process except
            those to these ports (the job store's) is cut, so peers fail fast.
        memory: tier 4: serves ``fit(ckpt_path=MEMORY_CHECKPOINT)`` from memory
            (:class:`~ckless_lightning.recovery.memory.MemoryRestore`).
    """

    def __init__(
        self,
        replicate: int = 1,
        shard: int = -1,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        *,
        job_store: Store | None = None,
        generation: int = 0,
        on_comm_phase: Callable[[str], None] | None = None,
        commit: StepCommit | None = None,
        keep_ports: frozenset[int] | None = None,
        memory: MemoryRestore | None = None,
    ) -> None:
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
        self._job_store = job_store
        self._generation = generation
        self._on_comm_phase = on_comm_phase or (lambda phase: None)
        self._commit = commit
        self._keep_ports = keep_ports
        self._memory = memory
        self._light = False

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(replicate, shard) as resolved against the world size."""
        shard = self.world_size // self._replicate if self._shard == -1 else self._shard
        return (self._replicate, shard)

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
        self._on_comm_phase("comm_init_start")
        if self._job_store is not None:
            assert self.cluster_environment is not None
            init_generation_process_group(
                self._job_store,
                backend=self._process_group_backend
                or ("nccl" if self.root_device.type == "cuda" else "gloo"),
                rank=self.cluster_environment.global_rank(),
                world_size=self.cluster_environment.world_size(),
                generation=self._generation,
                timeout_s=self._timeout.total_seconds() if self._timeout else 600.0,
            )
        init_distributed(self)  # Lightning's own init is skipped when the group exists already
        self._on_comm_phase("comm_init_done")
        replicate, shard = self.mesh_shape
        if replicate * shard != self.world_size:
            raise ValueError(
                f"mesh replicate={replicate} x shard={shard} does not match "
                f"the world size {self.world_size}; "
                "set cluster.replicate / cluster.shard so that their product is the world size"
            )
        install_device_mesh(self, build_mesh(self.root_device, (replicate, shard)))
        if self._memory is not None and self._memory.snapshots.mode == "buddy":
            # Buddy copies travel in host memory on their own gloo group, beside the step's collectives.
            self._memory.snapshots.group = torch.distributed.new_group(backend="gloo")

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
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Tier 4's ``MEMORY_CHECKPOINT`` is served from memory; anything else is a DCP checkpoint."""
        if checkpoint_path == MEMORY_CHECKPOINT:
            if self._memory is None:
                raise ValueError(f"{MEMORY_CHECKPOINT} needs tier 4 (a MemoryRestore)")
            assert self.lightning_module is not None
            restored = self._memory.restore(self.lightning_module, list(self.optimizers))
            if isinstance(restored, dict):
                return restored
            checkpoint_path = restored  # no live copy of some state: the disk fallback
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Forward, backward and clipping (the closure), then the commit vote, then the update.

        Lightning runs the closure inside ``optimizer.step(closure)``, and the
        precision plugin clips inside that closure; there is no hook between
        clipping and the update. The precision plugin is therefore handed a
        stand-in whose ``step`` runs the closure, votes, and only then calls the
        real ``optimizer.step()`` (its step hooks fire after the vote). Needs an
        optimizer that evaluates the closure once (every first-order optimizer).
        """
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        step = (trainer.global_step + 1) if trainer is not None else 0
        commit = self._commit
        vote = (lambda: commit.vote(step)) if commit is not None else (lambda: None)
        return super().optimizer_step(_CommitThenStep(optimizer, vote), closure, model, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tier 3+: cut this rank's connections so that every peer's pending collective fails now.

        Tier 4 first lets a buddy exchange in flight finish (peers' gloo threads
        progress it even while they wait in a collective), so its copies stay usable.
        """
        if self._memory is not None:
            self._memory.snapshots.settle(timeout_s=5.0)
        if self._keep_ports is not None:
            fail_fast(set(self._keep_ports))


class _CommitThenStep:
    """Stands in for an optimizer in the precision plugin: closure, vote, then the real update."""

    def __init__(self, optimizer: Optimizer, vote: Callable[[], None]) -> None:
        self._optimizer = optimizer
        self._vote = vote

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self._vote()
        self._optimizer.step(**kwargs)
        return result

    def __getattr__(self, name: str) -> Any:  # param_groups, state, zero_grad... of the real one
        return getattr(self._optimizer, name)


def build_mesh(device: torch.device, shape: tuple[int, int]) -> DeviceMesh:
    """The job's 2-D ("replicate", "shard") mesh over the default process group."""
    return init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIM_NAMES)
