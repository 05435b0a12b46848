"""Tier 1: the default process group of a generation, over the agent's store under its own prefix.

Each generation's keys live in their own namespace of the job store
(:meth:`JobStore.process_group_store`), so a new generation never reads the old
one's keys and needs no re-rendezvous: the store is already up (in node 0's
agent) and ranks just connect. No init barrier is added (torch adds none
unless TORCH_DIST_INIT_BARRIER=1).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ckless_lightning.comm._torch_compat import forget_failed_default_group
from ckless_lightning.comm.store import JobStore

__all__ = ["init_generation_process_group"]


def init_generation_process_group(
    store: JobStore,
    *,
    backend: str,
    rank: int,
    world_size: int,
    generation: int,
    timeout_s: float,
    init_timeout_s: float = 60.0,
    device: torch.device | None = None,
) -> None:
    """``init_process_group`` on generation ``generation``'s namespace of ``store``; once per process.

    Every group formed later on the default one's store (sub-groups, DeviceMesh) shares its
    bound: a store read waits at most ``init_timeout_s`` and ends when the generation does.
    On NCCL with ``device`` (this rank's GPU), the device is made current first and the group is
    bound to it (``device_id``): its communicators form now, on that device, not lazily at the
    first collective on whichever device is current then (device 0 by default for every rank).
    """
    assert not dist.is_initialized(), "the default process group already exists in this process"
    bound: dict[str, torch.device] = {}
    if backend == "nccl" and device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
        bound["device_id"] = device
    try:
        dist.init_process_group(
            backend,
            store=store.process_group_store(generation, init_timeout_s=init_timeout_s),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            **bound,
        )
    except BaseException:
        forget_failed_default_group()  # the next generation's groups must be named as a new process's
        raise
