"""Which micro-batch ends an optimizer step: the one test every callback uses.

Words used across the project (events, summary, store, code): a **step** is an
optimizer step, counted from 1. The **completed step** is the last one whose
update was applied (``trainer.global_step``; 0 before the first); the **step in
progress** is ``completed step + 1`` (what a fault of ``step N`` and the commit
vote refer to).
"""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["is_step_end"]


def is_step_end(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether micro-batch ``batch_idx`` is the last of its optimizer step (the update follows it).

    With gradient accumulation Lightning steps after every ``accumulate_grad_batches``-th
    micro-batch, and after the epoch's last one.
    """
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or bool(
        trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    )
