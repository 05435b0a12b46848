"""TokenDataModule: the packed token dataset and each rank's StepBatchLoader.

``train_dataloader`` runs after Lightning restored a checkpoint, so the loader
starts at the restored optimizer step; Lightning then also feeds it the saved
loader state (``load_state_dict``), which names the same step. The accumulation is
the Trainer's (``trainer.accumulate_grad_batches``): an elastic job builds a Trainer per
generation, with more micro-batches per step when it trains on fewer replicas.
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
    the dataset is never opened in this process, except by an elastic job
    (``elastic``) in a generation of another data-parallel width than ``dp_size``
    (the job's): the node's reader builds the full width's batches, so the ranks
    read the memory-mapped dataset themselves until the job is whole again.
    """

    def __init__(
        self,
        data: DataConfig,
        *,
        accumulate_grad_batches: int,
        max_steps: int,
        batch_cache: str | None = None,
        cache_timeout_s: float = 600.0,
        elastic: bool = False,
        dp_size: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg = data
        self.accumulate = accumulate_grad_batches
        self.max_steps = max_steps
        self.batch_cache = batch_cache
        self.cache_timeout_s = cache_timeout_s
        self.elastic = elastic
        self.dp_size = dp_size
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
        dp_rank, dp_size = sampler_kwargs["rank"], sampler_kwargs["num_replicas"]
        if self.batch_cache is not None and (self.dp_size is None or dp_size == self.dp_size):
            return self._cached_loader(dp_rank, dp_size)
        if self.dataset is None:  # an elastic generation of another width: read the dataset here
            self.dataset = load_prepared(self.prepared.path)
        accumulate = self.trainer.accumulate_grad_batches
        return StepBatchLoader(
            self.dataset,
            seed=self.cfg.seed,
            micro_batch_size=self.cfg.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            start_step=self.trainer.global_step * accumulate,
            max_steps=self.max_steps * accumulate,
            accumulate=accumulate,
            elastic=self.elastic,
        )

    def _cached_loader(self, dp_rank: int, dp_size: int) -> CachedStepBatchLoader:
        local_index = self.trainer.local_rank
        first = dp_rank - local_index  # the node's ranks are consecutive (rank = node * per_node + local)
        layout = BatchCacheLayout(
            root=Path(self.batch_cache),
            dp_ranks=tuple(range(first, first + self.trainer.num_devices)),
            micro_batch_size=self.cfg.micro_batch_size,
            row_len=self.cfg.seq_len + 1,
            source_tag=source_tag(
                self.prepared.path, self.cfg.seed, dp_size, self.cfg.micro_batch_size, self.accumulate
            ),
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
            accumulate=self.accumulate,
            elastic=self.elastic,
        )
