"""CheckpointlessStrategy: FSDP2 / HSDP through Lightning's ModelParallelStrategy.

The strategy owns the (replicate, shard) DeviceMesh; the LightningModule's
``configure_model`` applies the model family's FSDP2 plan over it (Lightning's
convention for ModelParallelStrategy). Disk checkpoints are sharded DCP
checkpoints, saved and loaded by the parent class. The recovery tiers extend
this class: it is the seam where process groups are re-formed and where
in-memory state enters Lightning's restore path (``load_checkpoint``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from typing_extensions import override

from ckless_lightning._lightning_compat import init_distributed, install_device_mesh

__all__ = ["MESH_DIM_NAMES", "CheckpointlessStrategy"]

MESH_DIM_NAMES = ("replicate", "shard")


class CheckpointlessStrategy(ModelParallelStrategy):
    """FSDP2 (``replicate=1``) or HSDP (``replicate>1``) over a ("replicate", "shard") mesh.

    Args:
        replicate: number of model replicas (HSDP outer dimension).
        shard: ranks each replica is sharded over; ``-1`` derives it from the world size.
        process_group_backend: ``None`` picks NCCL on CUDA and gloo on CPU.
        timeout: collective timeout of the default process group.
    """

    def __init__(
        self,
        replicate: int = 1,
        shard: int = -1,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
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
        init_distributed(self)
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
