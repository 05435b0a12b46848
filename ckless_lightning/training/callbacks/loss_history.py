"""Per-step training loss: logged to Lightning's loggers and appended to ``<run_dir>/losses.jsonl``.

The loss of a step is the data-parallel mean of its micro-batches' language-model
losses (same value on every rank, reduced in a fixed order, so two runs can be
compared bitwise), reduced before the optimizer update. ``losses.jsonl``
survives restarts: a resumed run appends, and the last record of a step wins
(:func:`ckless_lightning.record.loss_log.read_losses`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from ckless_lightning.training.steps import is_step_end

__all__ = ["LossHistoryCallback"]


class LossHistoryCallback(pl.Callback):
    """Collects each micro-batch's language-model loss, reduces the step's mean across ranks before the
    optimizer update, and logs/records it after the update.

    The micro-batch loss is the module's ``last_lm_loss`` (set by ``training_step``;
    :class:`~ckless_lightning.training.module.CausalLMModule` does), else the loss being
    backpropagated. The reduction runs in ``on_before_optimizer_step``, inside
    the step and before the commit vote, so that nothing communicates between a
    rank's update and the end of its step (tier 4's snapshot relies on it, and a
    peer lost during an update cannot leave a committed step without its loss). The
    record is written before tier 4's snapshot records the step (the job puts this
    callback ahead of it), so a rank 0 killed at a step's end cannot leave a step the
    job resumes after without its loss; killed between the two, the step is redone.
    Keeps only the current step's values, so it has no state to checkpoint.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._micro: list[torch.Tensor] = []
        self._step_loss: torch.Tensor | None = None

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        """Once per micro-batch, before its backward."""
        lm_loss = getattr(pl_module, "last_lm_loss", None)
        self._micro.append(lm_loss if lm_loss is not None else loss.detach())

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        """Once per optimizer step, after the last backward: the data-parallel mean (a collective)."""
        self._step_loss = trainer.strategy.reduce(torch.stack(self._micro).mean(), reduce_op="mean")
        self._micro.clear()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the update of a step (its last micro-batch): log and record; no communication."""
        if not is_step_end(trainer, batch_idx) or self._step_loss is None:
            return
        step_loss, self._step_loss = self._step_loss, None
        pl_module.log("train/loss", step_loss, on_step=True, prog_bar=True)
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                record = {"step": trainer.global_step, "loss": step_loss.item(), "t": time.time()}
                f.write(json.dumps(record) + "\n")
