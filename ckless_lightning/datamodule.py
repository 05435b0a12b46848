"""TokenDataModule: the packed token dataset and each rank's StepBatchLoader.

``train_dataloader`` runs after Lightning restored a checkpoint, so the loader
starts at the restored optimizer step; Lightning then also feeds it the saved
loader state (``load_state_dict``), which names the same step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from ckless_lightning.data import DataConfig, StepBatchLoader, load_prepared, prepare_dataset

__all__ = ["TokenDataModule"]


class TokenDataModule(pl.LightningDataModule):
    """One micro-batch per rank per loader step; ``accumulate`` loader steps make an optimizer step."""

    def __init__(self, data: DataConfig, *, accumulate_grad_batches: int, max_steps: int) -> None:
        super().__init__()
        self.cfg = data
        self.accumulate = accumulate_grad_batches
        self.max_steps = max_steps
        self.dataset: Any = None

    @override
    def setup(self, stage: str) -> None:
        if self.dataset is None:
            # In a launched job the launcher prepared the cache already: this is a cache hit.
            self.dataset = load_prepared(prepare_dataset(self.cfg).path)

    @override
    def train_dataloader(self) -> StepBatchLoader:
        sampler_kwargs = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        return StepBatchLoader(
            self.dataset,
            seed=self.cfg.seed,
            micro_batch_size=self.cfg.micro_batch_size,
            dp_rank=sampler_kwargs["rank"],
            dp_size=sampler_kwargs["num_replicas"],
            start_step=self.trainer.global_step * self.accumulate,
            max_steps=self.max_steps * self.accumulate,
        )
