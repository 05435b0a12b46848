"""Heartbeats to the node agent: before and after every training batch, into the node's heartbeat
board (``comm/beat_board.py``; with ``agent.local_beats=false``, to the job store).

The beat carries the last completed optimizer step, so the agent tells a rank
that is starting up (step -1: ``agent.startup_timeout``) from one that stopped
making progress (``agent.hang_timeout``); a checkpoint save is declared (phase
``save``: ``agent.save_timeout``) so a long one is not taken for a hang. No
thread: a rank blocked in a collective or stopped by a signal stops beating,
which is the point.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from ckless_lightning.comm import Heartbeat
from ckless_lightning.comm.beat_board import HeartbeatWriter
from ckless_lightning.training.steps import is_step_end

__all__ = ["HeartbeatCallback"]


class HeartbeatCallback(pl.Callback):
    """Writes this rank's beat (generation, last completed step, time, phase) to ``beats`` (its board
    slot or the job store's ``hb/<rank>``); no state to checkpoint."""

    def __init__(self, beats: HeartbeatWriter, *, rank: int, generation: int) -> None:
        self.beats = beats
        self.rank = rank
        self.generation = generation
        self._started = False

    def beat(self, completed_step: int, phase: str = "step") -> None:
        self.beats.set_rank_heartbeat(
            self.rank, Heartbeat(self.generation, completed_step, time.time(), phase)
        )

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """As the checkpoint is assembled, before it is written: the save's own silence limit applies
        until the next batch beats again."""
        self.beat(trainer.global_step if self._started else -1, phase="save")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Until the first step of this process completes, report -1 (still starting up).
        self.beat(trainer.global_step if self._started else -1)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if is_step_end(trainer, batch_idx):
            self._started = True
            self.beat(trainer.global_step)
