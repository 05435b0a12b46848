"""An elastic job's checkpoints resume at another gradient accumulation.

An elastic HSDP generation that trains on fewer replicas accumulates more micro-batches per
optimizer step (the global batch stays). Lightning's fit loop counts micro-batches, so a
checkpoint (tier 4's snapshot in memory, or a file) saved at one accumulation would end the
first optimizer step after the resume at the wrong micro-batch under another. This callback
keeps the accumulation in the checkpoint and, when it differs on load, rewrites the fit loop's
counters to the same optimizer step at the new accumulation (the loader converts its own
position: :class:`~ckless_lightning.data.StepBatchLoader`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from ckless_lightning.training._lightning_compat import rescale_micro_batches

__all__ = ["ElasticAccumulationCallback"]


class ElasticAccumulationCallback(pl.Callback):
    """Saves ``accumulate_grad_batches``; on load (before Lightning restores its loops) rescales the
    fit loop's micro-batch counters from the saved accumulation to the Trainer's."""

    def __init__(self) -> None:
        self.accumulate: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Once per fit, before any checkpoint is loaded or saved."""
        self.accumulate = trainer.accumulate_grad_batches

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"accumulate": self.accumulate}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to take: the accumulation is the Trainer's, not the checkpoint's."""

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        saved = checkpoint.get("callbacks", {}).get(self.state_key, {}).get("accumulate")
        now = trainer.accumulate_grad_batches
        if saved is not None and saved != now:
            rescale_micro_batches(checkpoint, saved, now)
