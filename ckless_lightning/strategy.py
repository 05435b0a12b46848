"""CheckpointlessStrategy: FSDP2 / HSDP through Lightning's ModelParallelStrategy.

The strategy owns the (replicate, shard) DeviceMesh; the LightningModule's
``configure_model`` applies the model family's FSDP2 plan over it (Lightning's
convention for ModelParallelStrategy). Disk checkpoints are sharded DCP
checkpoints, saved and loaded by the parent class. The recovery tiers extend
this class: it is the seam where process groups are re-formed and where
in-memory state enters Lightning's restore path (``load_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed import Store
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from typing_extensions import override

from ckless_lightning._lightning_compat import init_distributed, install_device_mesh
from ckless_lightning.comm import init_generation_process_group

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


def build_mesh(device: torch.device, shape: tuple[int, int]) -> DeviceMesh:
    """The job's 2-D ("replicate", "shard") mesh over the default process group."""
    return init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIM_NAMES)
