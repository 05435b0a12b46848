"""The job's 2-D ("replicate", "shard") DeviceMesh: its dim names, its shape, and building it.

Owned here, beside the FSDP2 plans that shard over it: the config, the memory
plan, the strategy and the recovery loop all resolve the shape through
:func:`resolve_mesh`, so ``shard = -1`` means the same everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads in build_mesh: resolve_mesh validates configs before torch is imported
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_DIM_NAMES", "build_mesh", "resolve_mesh"]

MESH_DIM_NAMES = ("replicate", "shard")


def resolve_mesh(
    world_size: int, replicate: int, shard: int, *, key: str = "", world: str = ""
) -> tuple[int, int]:
    """``(replicate, shard)`` over ``world_size`` ranks; ``shard = -1`` derives it.

    Raises ValueError naming the degrees (``key`` prefixes their names, e.g.
    ``"cluster."``; ``world`` says where the world size comes from) when they do
    not multiply to the world size.
    """
    if replicate < 1 or (shard != -1 and shard < 1):
        raise ValueError(f"{key}replicate must be >= 1 and {key}shard >= 1 or -1, got ({replicate}, {shard})")
    detail = f" ({world})" if world else ""
    if shard == -1:
        if world_size % replicate:
            raise ValueError(
                f"{key}replicate={replicate} does not divide the world size {world_size}{detail}; "
                "choose a replicate degree that divides it"
            )
        shard = world_size // replicate
    if replicate * shard != world_size:
        raise ValueError(
            f"mesh {key}replicate={replicate} x {key}shard={shard} = {replicate * shard} does not match "
            f"the world size {world_size}{detail}; set {key}shard=-1 to derive it, or change the degrees "
            "so their product is the world size"
        )
    return replicate, shard


def build_mesh(device: torch.device, shape: tuple[int, int]) -> DeviceMesh:
    """The job's ("replicate", "shard") mesh over the default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIM_NAMES)
