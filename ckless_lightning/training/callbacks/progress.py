"""Lightning's TQDM progress bar with the right total after a resume and with gradient accumulation.

Lightning's bar counts the micro-batches of the epoch (``batch_idx + 1``) but sets its total in
``on_train_epoch_start``, which Lightning skips when a Trainer resumes in the middle of an epoch:
after a restart or an in-process recovery (a new Trainer restored at step N) the bar read
``Training: 35/?``. Its total, ``min(num_training_batches, max_steps - global_step)``, also
counts optimizer steps against micro-batches, so with gradient accumulation the count ran past it
(and showed ``?`` too). This bar sets the total when training starts as well, and counts it in
micro-batches from the epoch's first: with the step-addressed loader (one epoch of ``max_steps x
accumulate`` micro-batches) the total is ``max_steps x accumulate`` whatever step training resumed
at, e.g. ``35/40``.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from typing_extensions import override

__all__ = ["StepProgressBar"]


class StepProgressBar(TQDMProgressBar):
    """A ``TQDMProgressBar`` whose training total holds across resumes; use it in its place.

    Call contract: as ``TQDMProgressBar`` (Lightning disables it on ranks other than 0); no state.
    """

    @property
    @override
    def total_train_batches(self) -> int | float:
        """Micro-batches of an epoch that starts now (``on_train_epoch_start``); ``inf`` if unknown."""
        return self._epoch_total(done=0)

    @override
    def init_train_tqdm(self) -> Tqdm:
        """The training bar, created when training starts: its total counts the micro-batches of the
        current epoch done before this Trainer (restored from a checkpoint or a peer), which the
        bar's count includes."""
        bar = super().init_train_tqdm()
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        total = self._epoch_total(done=done)
        bar.total = None if math.isinf(total) else int(total)
        return bar

    def _epoch_total(self, *, done: int) -> int | float:
        """``num_training_batches``, or fewer when ``max_steps`` ends training inside this epoch:
        ``done`` micro-batches plus those of the optimizer steps left."""
        trainer: pl.Trainer = self.trainer
        total = trainer.num_training_batches
        if trainer.max_steps is not None and trainer.max_steps >= 0:
            left = max(0, trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            total = min(total, done + left)
        return total
