"""Rank-side recovery timeline: the phases of a (re)started rank, as ``rank_phase`` events.

``state_load`` spans building the model and restoring its state (from
``setup`` to ``on_train_start``); ``data_ready`` is the first batch this
process fetched; ``first_step_done`` its first completed optimizer step.
``process_start``, ``imports_done`` and ``comm_init_*`` are emitted by the rank
entry and the strategy. Once per process, so no state to checkpoint.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from ckless_lightning.record.events import EventLog
from ckless_lightning.training.steps import is_step_end

__all__ = ["TimelineCallback"]


class TimelineCallback(pl.Callback):
    def __init__(self, events: EventLog, *, rank: int, generation: int) -> None:
        self.events = events
        self.rank = rank
        self.generation = generation
        self._seen: set[str] = set()

    def _phase(self, phase: str, step: int | None = None) -> None:
        if phase in self._seen:
            return
        self._seen.add(phase)
        self.events.emit("rank_phase", rank=self.rank, gen=self.generation, phase=phase, step=step)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._phase("state_load_start")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase("state_load_done", step=trainer.global_step)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._phase("data_ready", step=trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if is_step_end(trainer, batch_idx):
            self._phase("first_step_done", step=trainer.global_step)
