"""FSDP2 plans for the model families, kept beside (not inside) the models.

Both plans are the torchtitan one: ``fully_shard`` each transformer block
(one all-gather / reduce-scatter group per block), then the root, which picks
up the embeddings, final norm and output head. The mesh is always 2-D
``("replicate", "shard")``: ``replicate > 1`` is HSDP, ``replicate == 1`` is
plain FSDP over the ``"shard"`` dim.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from ckless_lightning.models.configs import FSDPConfig
from ckless_lightning.models.llama3 import Llama3
from ckless_lightning.models.mesh import MESH_DIM_NAMES
from ckless_lightning.models.mixtral import Mixtral
from ckless_lightning.models.shard_dims import fsdp_shard_dims

__all__ = ["FSDPConfig", "data_parallel_mesh", "fsdp_shard_dims", "parallelize_llama3", "parallelize_mixtral"]


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh to hand ``fully_shard``: the 2-D mesh for HSDP, its ``"shard"`` dim for FSDP.

    ``mesh``: ``CheckpointlessStrategy``'s ("replicate", "shard") mesh, which a LightningModule
    reads as ``self.device_mesh`` in ``configure_model``."""
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != MESH_DIM_NAMES:
        raise ValueError(
            f"mesh must be 2-D with mesh_dim_names={MESH_DIM_NAMES}, got ndim={mesh.ndim} "
            f"names={mesh.mesh_dim_names}; build it with init_device_mesh(device_type, (R, S), "
            f"mesh_dim_names={MESH_DIM_NAMES})."
        )
    return mesh if mesh.size(0) > 1 else mesh["shard"]


def _shard_blocks_then_root(
    model: nn.Module, blocks: nn.ModuleList, mesh: DeviceMesh, cfg: FSDPConfig
) -> None:
    dp_mesh = data_parallel_mesh(mesh)
    mp_policy = cfg.mp_policy()
    params = dict(model.named_parameters())
    dim_of = {id(params[name]): dim for name, dim in fsdp_shard_dims(model, mesh.size(1)).items()}

    def placement(param: nn.Parameter) -> Shard:
        return Shard(dim_of.get(id(param), 0))

    for block in blocks:
        fully_shard(
            block,
            mesh=dp_mesh,
            mp_policy=mp_policy,
            reshard_after_forward=cfg.reshard_after_forward,
            shard_placement_fn=placement,
        )
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


def parallelize_llama3(model: Llama3, mesh: DeviceMesh, *, cfg: FSDPConfig) -> Llama3:
    """Apply FSDP2 to a ``Llama3`` in place (meta or materialised) and return it.

    After this, ``model.to_empty(device=...)`` and ``init_weights`` for a meta build.
    """
    _shard_blocks_then_root(model, model.layers, mesh, cfg)
    return model


def parallelize_mixtral(model: Mixtral, mesh: DeviceMesh, *, cfg: FSDPConfig) -> Mixtral:
    """Apply FSDP2 to a ``Mixtral`` in place and return it.

    Expert weights ``[E, ...]`` are sharded on dim 1 (see :func:`fsdp_shard_dims`);
    there is no expert parallelism.
    """
    _shard_blocks_then_root(model, model.layers, mesh, cfg)
    return model
