"""Lightning callbacks of ckless_lightning."""

from ckless_lightning.callbacks.data_position import DataPositionCallback
from ckless_lightning.callbacks.loss_history import LossHistoryCallback
from ckless_lightning.callbacks.step_stats import StepStatsCallback

__all__ = ["DataPositionCallback", "LossHistoryCallback", "StepStatsCallback"]
