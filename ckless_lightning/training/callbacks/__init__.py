"""Lightning callbacks of ckless_lightning."""

from ckless_lightning.training.callbacks.data_position import DataPositionCallback
from ckless_lightning.training.callbacks.elastic_accumulation import ElasticAccumulationCallback
from ckless_lightning.training.callbacks.fault_injection import FaultInjectionCallback, InjectedFault
from ckless_lightning.training.callbacks.heartbeat import HeartbeatCallback
from ckless_lightning.training.callbacks.loss_history import LossHistoryCallback
from ckless_lightning.training.callbacks.progress import StepProgressBar
from ckless_lightning.training.callbacks.recovery_metrics import RecoveryMetricsCallback
from ckless_lightning.training.callbacks.sample_log import SampleLogCallback
from ckless_lightning.training.callbacks.snapshot import SnapshotCallback
from ckless_lightning.training.callbacks.step_checkpoint import ResumedCheckpoints, StepCheckpoint
from ckless_lightning.training.callbacks.step_stats import StepStatsCallback
from ckless_lightning.training.callbacks.timeline import TimelineCallback

__all__ = [
    "DataPositionCallback",
    "ElasticAccumulationCallback",
    "FaultInjectionCallback",
    "HeartbeatCallback",
    "InjectedFault",
    "LossHistoryCallback",
    "RecoveryMetricsCallback",
    "ResumedCheckpoints",
    "SampleLogCallback",
    "SnapshotCallback",
    "StepCheckpoint",
    "StepProgressBar",
    "StepStatsCallback",
    "TimelineCallback",
]
