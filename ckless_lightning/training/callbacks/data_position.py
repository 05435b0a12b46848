"""Keep the data loader's saved position equal to the committed step.

Lightning fetches one batch ahead, so a loader's own yield counter runs past
the step that was trained. After each batch is trained (and its optimizer step
applied) this callback tells the loader the next step to read; the loader's
``state_dict`` reports that, and Lightning stores it in every checkpoint. A user's
loader, wrapped by the strategy in a
:class:`~ckless_lightning.data.positioned_loader.CommittedPositionLoader`, is told
that a batch was trained.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from ckless_lightning.data.positioned_loader import CommittedPositionLoader

__all__ = ["DataPositionCallback"]


class DataPositionCallback(pl.Callback):
    """After each training batch, once per batch: ``loader.set_position(batch["step"] + 1)`` (the
    built-in loaders) or ``loader.commit_batch()`` (a user's, wrapped by the strategy)."""

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loader = trainer.train_dataloader
        if isinstance(loader, CommittedPositionLoader):
            loader.commit_batch()
        elif hasattr(loader, "set_position") and isinstance(batch, dict) and "step" in batch:
            loader.set_position(int(batch["step"]) + 1)
