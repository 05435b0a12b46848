"""Per-step training loss: logged to Lightning's loggers and appended to ``<run_dir>/losses.jsonl``.

The loss of a step is the data-parallel mean of its micro-batches' language-model
losses (same value on every rank, reduced in a fixed order, so two runs can be
compared bitwise). ``losses.jsonl`` survives restarts: a resumed run appends,
and the last record of a step wins (:func:`ckless_lightning.loss_log.read_losses`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

__all__ = ["LossHistoryCallback"]


class LossHistoryCallback(pl.Callback):
    """After each micro-batch: collect ``outputs["lm_loss"]``; after each optimizer step: reduce, log, record.

    Needs the training step to return a dict with ``lm_loss`` (detached). Keeps
    only the current step's micro-batch losses, so it has no state to checkpoint.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._micro: list[torch.Tensor] = []

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._micro.append(outputs["lm_loss"])
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        step_loss = trainer.strategy.reduce(torch.stack(self._micro).mean(), reduce_op="mean")
        self._micro.clear()
        pl_module.log("train/loss", step_loss, on_step=True, prog_bar=True)
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                record = {"step": trainer.global_step, "loss": step_loss.item(), "t": time.time()}
                f.write(json.dumps(record) + "\n")
