"""Per-rank step timing and peak memory, written to ``<run_dir>/step_stats/rank<N>.json``.

Read by ``bench/step_time.py`` and the run summary; costs two clock reads per step.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from ckless_lightning.training.steps import is_step_end

__all__ = ["StepStatsCallback", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StepStatsCallback(pl.Callback):
    """Records the wall time of every optimizer step (start of its first micro-batch to end of its
    last), and from one step's end to the next the wall time and this process's CPU time (all its
    threads: what per-step work outside the step, such as tier 4's snapshot, costs)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.step_seconds: list[float] = []
        self.interval_seconds: list[float] = []
        self.interval_cpu_seconds: list[float] = []
        self.interval_end_times: list[float] = []  # time.time() at each interval's end
        self.tokens_per_step = 0
        self._t0: float | None = None
        self._last_end: tuple[float, float] | None = None  # (wall, process CPU) at the last step end

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not is_step_end(trainer, batch_idx) or self._t0 is None:
            return
        now = (time.perf_counter(), time.process_time())
        self.step_seconds.append(now[0] - self._t0)
        if self._last_end is not None:
            self.interval_seconds.append(now[0] - self._last_end[0])
            self.interval_cpu_seconds.append(now[1] - self._last_end[1])
            self.interval_end_times.append(time.time())
        self._last_end = now
        if isinstance(batch, dict) and "input_ids" in batch:  # token batches; a user's: no token count
            ids = batch["input_ids"]
            self.tokens_per_step = (ids.shape[1] - 1) * ids.shape[0] * trainer.accumulate_grad_batches

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "step_seconds": self.step_seconds,
            "interval_seconds": self.interval_seconds,
            "interval_cpu_seconds": self.interval_cpu_seconds,
            "interval_end_times": self.interval_end_times,
            "tokens_per_step_per_rank": self.tokens_per_step,
            "peak_rss_bytes": peak_rss_bytes(),
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
