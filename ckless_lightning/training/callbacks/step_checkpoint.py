"""Disk checkpoints at a resume: Lightning's ``ModelCheckpoint``, minus one redundant save.

Lightning 2.6's ``ModelCheckpoint`` does not keep which step it saved last in its checkpoint state;
a resumed fit starts with "nothing saved". With gradient accumulation the first micro-batch after a
resume from step S ends with ``global_step`` still S, a multiple of ``every_n_train_steps`` (a
checkpoint's step always is), so it writes step S's checkpoint again: the one the fit just read,
on the critical path of the first step after a recovery (measured: 0.09-0.13 s of a 0.23 s step,
every rank, at tier 3 on 2 ranks; docs/benchmarks.md, "The first step after a recovery").
:class:`StepCheckpoint` (the job's checkpoint callback) counts a complete checkpoint of the resumed
step on disk as saved; :class:`ResumedCheckpoints` (which :class:`~ckless_lightning.recovery.
InProcessRecovery` adds to every generation's Trainer) does the same for a user's own
``ModelCheckpoint`` callbacks, for the checkpoint the fit resumed from.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from ckless_lightning.runtime.checkpointing import checkpoint_name, is_complete_checkpoint
from ckless_lightning.training._lightning_compat import mark_checkpoint_saved

__all__ = ["ResumedCheckpoints", "StepCheckpoint"]


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


class ResumedCheckpoints(pl.Callback):
    """At the start of a fit resumed from a checkpoint on disk (``trainer.ckpt_path``), every
    ``ModelCheckpoint`` of the Trainer whose ``dirpath`` holds that checkpoint counts the resumed step
    as saved: it does not write it again (the state it would write is the state just read). Other
    callbacks, and a resume from memory, are left as they are. No state of its own."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step, path = trainer.global_step, trainer.ckpt_path
        if step <= 0 or not path or not Path(path).exists():  # a fresh fit, or tier 4's memory
            return
        resumed_in = Path(path).resolve().parent
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if isinstance(callback, ModelCheckpoint) and dirpath and Path(dirpath).resolve() == resumed_in:
                mark_checkpoint_saved(callback, step)
