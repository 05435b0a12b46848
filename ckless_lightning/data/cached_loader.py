"""Tier 2: a rank's StepBatchLoader that reads its micro-batches from the node's batch cache.

Same steps, same position and state contract as :class:`StepBatchLoader` (so
Lightning's restore path and exactly-once accounting are unchanged); only
``batch(step)`` differs: it tells the node's cache reader which step it needs
and memory-maps the entry, so a restarted rank never touches the dataset.
A corrupt entry is deleted and rebuilt by the reader, never trained on.
"""

from __future__ import annotations

import logging
from typing import Any

from ckless_lightning.data.batch_cache import BatchCacheLayout, BatchCacheReader, CorruptEntryError
from ckless_lightning.data.loader import StepBatchLoader

__all__ = ["CachedStepBatchLoader"]

log = logging.getLogger(__name__)
_REPAIRS = 3


class CachedStepBatchLoader(StepBatchLoader):
    """``StepBatchLoader`` whose batches come from ``layout`` (entry ``local_index`` is this rank's)."""

    def __init__(
        self,
        layout: BatchCacheLayout,
        *,
        local_index: int,
        num_samples: int,
        timeout_s: float,
        seed: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        start_step: int = 0,
        max_steps: int | None = None,
        accumulate: int = 1,
        elastic: bool = False,
    ) -> None:
        super().__init__(
            None,
            seed=seed,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            start_step=start_step,
            max_steps=max_steps,
            num_samples=num_samples,
            accumulate=accumulate,
            elastic=elastic,
        )
        assert layout.dp_ranks[local_index] == dp_rank, (layout.dp_ranks, local_index, dp_rank)
        self.reader = BatchCacheReader(layout)
        self.local_index = local_index
        self.timeout_s = timeout_s

    def batch(self, step: int) -> dict[str, Any]:
        def waiting(elapsed: float) -> None:
            log.warning(
                "rank %d: waiting for step %d in the batch cache %s (%.1f s): the reader is filling it",
                self.dp_rank,
                step,
                self.reader.layout.root,
                elapsed,
            )

        for _ in range(_REPAIRS):
            self.reader.request(step, self.local_index)
            try:
                return self.reader.wait_read(
                    step, self.local_index, timeout_s=self.timeout_s, on_wait=waiting
                )
            except CorruptEntryError as err:
                log.warning("rank %d: %s; asking the reader to rebuild it", self.dp_rank, err)
                err.path.unlink(missing_ok=True)
        raise RuntimeError(
            f"batch cache entry for step {step} was corrupt {_REPAIRS} times in a row under "
            f"{self.reader.layout.root}; check the node's shared memory (data.mmap_cache_base)"
        )
