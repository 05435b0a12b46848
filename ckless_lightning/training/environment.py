"""GenerationEnvironment: Lightning's cluster environment for a generation of an elastic job.

The agent starts every rank with torchelastic's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ...) for the whole job, and Lightning's ``TorchElasticEnvironment`` reads them.
A generation of an elastic HSDP job trains only some of the job's ranks
(:mod:`~ckless_lightning.recovery.elastic`): its process groups number them 0..n-1, and
Lightning's global rank and world size (rank-zero logging, ``trainer.world_size``, the
data-parallel rank of each loader) must be those, not the job's. The local rank (the device) and
the node stay the job's.
"""

from __future__ import annotations

from lightning.fabric.plugins.environments import TorchElasticEnvironment
from typing_extensions import override

from ckless_lightning.comm import Generation

__all__ = ["GenerationEnvironment"]


class GenerationEnvironment(TorchElasticEnvironment):
    """torchelastic's environment with ``generation``'s rank and world size."""

    def __init__(self, generation: Generation) -> None:
        super().__init__()
        self.generation = generation

    @override
    def world_size(self) -> int:
        return self.generation.world_size

    @override
    def global_rank(self) -> int:
        return self.generation.rank

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """The Trainer's ``devices x num_nodes`` is the job's shape, of which this generation trains part."""
        job_world = TorchElasticEnvironment.world_size(self)  # the job's WORLD_SIZE, as torchelastic reads it
        if num_devices * num_nodes != job_world:
            raise ValueError(
                f"devices={num_devices} x num_nodes={num_nodes} is not the job's world size ({job_world})"
            )
