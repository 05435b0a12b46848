"""The Lightning pieces: the strategy, the LightningModule, the DataModule, the callbacks, and
``job.train_rank`` (what a rank process runs)."""

from ckless_lightning.training.datamodule import TokenDataModule
from ckless_lightning.training.module import CausalLMModule
from ckless_lightning.training.strategy import MEMORY_CHECKPOINT, CheckpointlessStrategy

__all__ = ["MEMORY_CHECKPOINT", "CausalLMModule", "CheckpointlessStrategy", "TokenDataModule"]
