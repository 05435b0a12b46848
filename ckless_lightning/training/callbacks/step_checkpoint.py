"""The job's disk checkpoints: Lightning's ``ModelCheckpoint``, minus one redundant save at a resume.

Lightning 2.6's ``ModelCheckpoint`` does not keep which step it saved last in its checkpoint state;
a resumed fit starts with "nothing saved". With gradient accumulation the first micro-batch after a
resume from step S ends with ``global_step`` still S, a multiple of ``every_n_train_steps`` (a
checkpoint's step always is), so it writes step S's checkpoint again: the one the fit just read,
on the critical path of the first step after a recovery (measured: 0.09-0.13 s of a 0.23 s step,
every rank, at tier 3 on 2 ranks; docs/benchmarks.md, "The first step after a recovery").
:class:`StepCheckpoint` counts a complete checkpoint of the resumed step on disk as saved.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from ckless_lightning.runtime.checkpointing import checkpoint_name, is_complete_checkpoint
from ckless_lightning.training._lightning_compat import mark_checkpoint_saved

__all__ = ["StepCheckpoint"]


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` named ``step<N>.ckpt`` in ``dirpath`` every ``every_n_train_steps`` optimizer
    steps, keeping the last ``keep_last``; at the start of a fit that resumed at a step whose
    complete checkpoint is already on disk, that step counts as saved (it is not written again).
    A resume from memory (tier 4) at a step with no checkpoint on disk still saves it."""

    def __init__(self, dirpath: str | Path, *, every_n_train_steps: int, keep_last: int) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="step{step:08d}",
            auto_insert_metric_name=False,
            every_n_train_steps=every_n_train_steps,
            save_top_k=keep_last,
            monitor="step",
            mode="max",
            save_last=False,
            save_on_train_epoch_end=False,
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        step = trainer.global_step
        if step > 0 and self.dirpath is not None:
            resumed = Path(self.dirpath) / checkpoint_name(step)  # a DCP folder, or one file
            if is_complete_checkpoint(resumed) or resumed.is_file():
                mark_checkpoint_saved(self, step)
