"""Tier 1: the default process group of a generation, over the agent's store under a prefix.

Each generation's keys live under ``gen<g>/pg/`` of the job store, so a new
generation never reads the old one's keys and needs no re-rendezvous: the
store is already up (in node 0's agent) and ranks just connect. No init
barrier is added (torch adds none unless TORCH_DIST_INIT_BARRIER=1).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import PrefixStore, Store

__all__ = ["generation_prefix", "init_generation_process_group"]


def generation_prefix(generation: int) -> str:
    return f"gen{generation}/pg/"


def init_generation_process_group(
    store: Store, *, backend: str, rank: int, world_size: int, generation: int, timeout_s: float
) -> None:
    """``init_process_group`` on ``PrefixStore(gen<g>/pg/, store)``; once per process."""
    assert not dist.is_initialized(), "the default process group already exists in this process"
    dist.init_process_group(
        backend,
        store=PrefixStore(generation_prefix(generation), store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
