"""The job store outside the ranks, and generation-prefixed process groups (a leaf: torch only)."""

from ckless_lightning.comm.commit import GenerationChanged, StepCommit
from ckless_lightning.comm.process_group import init_generation_process_group
from ckless_lightning.comm.store import Heartbeat, JobStore, connect_store

__all__ = [
    "GenerationChanged",
    "Heartbeat",
    "JobStore",
    "StepCommit",
    "connect_store",
    "init_generation_process_group",
]
