"""Lightning callbacks of ckless_lightning."""

from ckless_lightning.callbacks.data_position import DataPositionCallback
from ckless_lightning.callbacks.fault_injection import FaultInjectionCallback, InjectedFault
from ckless_lightning.callbacks.heartbeat import HeartbeatCallback
from ckless_lightning.callbacks.loss_history import LossHistoryCallback
from ckless_lightning.callbacks.sample_log import SampleLogCallback
from ckless_lightning.callbacks.step_stats import StepStatsCallback
from ckless_lightning.callbacks.timeline import TimelineCallback

__all__ = [
    "DataPositionCallback",
    "FaultInjectionCallback",
    "HeartbeatCallback",
    "InjectedFault",
    "LossHistoryCallback",
    "SampleLogCallback",
    "StepStatsCallback",
    "TimelineCallback",
]
