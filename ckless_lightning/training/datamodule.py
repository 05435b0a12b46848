"""TokenDataModule: the packed token dataset and each rank's StepBatchLoader.

``train_dataloader`` runs after Lightning restored a checkpoint, so the loader
starts at the restored optimizer step; Lightning then also feeds it the saved
loader state (``load_state_dict``), which names the same step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from ckless_lightning.data import DataConfig, StepBatchLoader, load_prepared, prepare_dataset
from ckless_lightning.data.batch_cache import BatchCacheLayout, source_tag
from ckless_lightning.data.cached_loader import CachedStepBatchLoader

__all__ = ["TokenDataModule"]


class TokenDataModule(pl.LightningDataModule):
    """One micro-batch per rank per loader step; ``accumulate`` loader steps make an optimizer step.

    With ``batch_cache`` (tier 2: the node's cache directory, from the agent)
    the loader reads memory-mapped batches that the node's reader wrote, and
    the dataset is never opened in this process.
    """

    def __init__(
        self,
        data: DataConfig,
        *,
        accumulate_grad_batches: int,
        max_steps: int,
        batch_cache: str | None = None,
        cache_timeout_s: float = 600.0,
    ) -> None:
        super().__init__()
        self.cfg = data
        self.accumulate = accumulate_grad_batches
        self.max_steps = max_steps
        self.batch_cache = batch_cache
        self.cache_timeout_s = cache_timeout_s
        self.dataset: Any = None
        self.prepared: Any = None

    @override
    def setup(self, stage: str) -> None:
        if self.prepared is None:
            # In a launched job the launcher prepared the cache already: this is a cache hit.
            self.prepared = prepare_dataset(self.cfg)
        if self.dataset is None and self.batch_cache is None:
            self.dataset = load_prepared(self.prepared.path)

    @override
    def train_dataloader(self) -> StepBatchLoader:
        sampler_kwargs = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        if self.batch_cache is not None:
            return self._cached_loader(sampler_kwargs["rank"], sampler_kwargs["num_replicas"])
        return StepBatchLoader(
            self.dataset,
            seed=self.cfg.seed,
            micro_batch_size=self.cfg.micro_batch_size,
            dp_rank=sampler_kwargs["rank"],
            dp_size=sampler_kwargs["num_replicas"],
            start_step=self.trainer.global_step * self.accumulate,
            max_steps=self.max_steps * self.accumulate,
        )

    def _cached_loader(self, dp_rank: int, dp_size: int) -> CachedStepBatchLoader:
        local_index = self.trainer.local_rank
        first = dp_rank - local_index  # the node's ranks are consecutive (rank = node * per_node + local)
        layout = BatchCacheLayout(
            root=Path(self.batch_cache),
            dp_ranks=tuple(range(first, first + self.trainer.num_devices)),
            micro_batch_size=self.cfg.micro_batch_size,
            row_len=self.cfg.seq_len + 1,
            source_tag=source_tag(self.prepared.path, self.cfg.seed, dp_size, self.cfg.micro_batch_size),
        )
        return CachedStepBatchLoader(
            layout,
            local_index=local_index,
            num_samples=self.prepared.num_samples,
            timeout_s=self.cache_timeout_s,
            seed=self.cfg.seed,
            micro_batch_size=self.cfg.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            start_step=self.trainer.global_step * self.accumulate,
            max_steps=self.max_steps * self.accumulate,
        )
