"""The job store outside the ranks, and generation-prefixed process groups (a leaf: torch only)."""

from ckless_lightning.comm.generation import Generation
from ckless_lightning.comm.process_group import init_generation_process_group
from ckless_lightning.comm.store import GenerationChanged, Heartbeat, JobStore, StoreRefused, connect_store

__all__ = [
    "Generation",
    "GenerationChanged",
    "Heartbeat",
    "JobStore",
    "StoreRefused",
    "connect_store",
    "init_generation_process_group",
]
