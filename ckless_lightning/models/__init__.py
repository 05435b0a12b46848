"""Llama 3 and Mixtral in plain torch, their FSDP2 plans, and sharding-independent init.

Typical use (every rank)::

    with torch.device("meta"):
        model = build_model(cfg)
    parallelize_model(model, mesh, cfg=FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32"))
    model.to_empty(device="cuda")
    init_weights(model, seed)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The configs import no torch (launch.py validates with them first); the rest loads on first use.
from ckless_lightning.models.configs import FSDPConfig, Llama3Config, MixtralConfig

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from ckless_lightning.models.init import init_draw_count, init_weights, reset_buffers
    from ckless_lightning.models.layers import CausalLMOutput
    from ckless_lightning.models.llama3 import Llama3
    from ckless_lightning.models.mesh import MESH_DIM_NAMES, build_mesh, resolve_mesh
    from ckless_lightning.models.mixtral import Mixtral
    from ckless_lightning.models.parallelize import (
        data_parallel_mesh,
        parallelize_llama3,
        parallelize_mixtral,
    )
    from ckless_lightning.models.shard_dims import fsdp_shard_dims

_LAZY = {
    "CausalLMOutput": "layers",
    "Llama3": "llama3",
    "Mixtral": "mixtral",
    "MESH_DIM_NAMES": "mesh",
    "build_mesh": "mesh",
    "resolve_mesh": "mesh",
    "data_parallel_mesh": "parallelize",
    "fsdp_shard_dims": "shard_dims",
    "parallelize_llama3": "parallelize",
    "parallelize_mixtral": "parallelize",
    "init_draw_count": "init",
    "init_weights": "init",
    "reset_buffers": "init",
}


def __getattr__(name: str) -> Any:  # PEP 562 (models import nothing else of ours: no runtime.lazy)
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MESH_DIM_NAMES",
    "CausalLMOutput",
    "FSDPConfig",
    "Llama3",
    "Llama3Config",
    "Mixtral",
    "MixtralConfig",
    "build_mesh",
    "build_model",
    "data_parallel_mesh",
    "fsdp_shard_dims",
    "init_draw_count",
    "init_weights",
    "parallelize_llama3",
    "parallelize_mixtral",
    "parallelize_model",
    "reset_buffers",
    "resolve_mesh",
]


def build_model(cfg: Llama3Config | MixtralConfig) -> nn.Module:
    """Construct the model ``cfg`` describes on the current default device (use ``torch.device("meta")``).

    Weights come from the constructors' default init; call ``init_weights``
    for the seed-determined, sharding-independent ones.
    """
    from ckless_lightning.models.llama3 import Llama3
    from ckless_lightning.models.mixtral import Mixtral

    if isinstance(cfg, MixtralConfig):
        return Mixtral(cfg)
    if isinstance(cfg, Llama3Config):
        return Llama3(cfg)
    raise TypeError(f"build_model: expected Llama3Config or MixtralConfig, got {type(cfg).__name__}.")


def parallelize_model(model: nn.Module, mesh: DeviceMesh, *, cfg: FSDPConfig) -> nn.Module:
    """Apply the FSDP2 plan matching ``model``'s family (in place) and return it."""
    from ckless_lightning.models.llama3 import Llama3
    from ckless_lightning.models.mixtral import Mixtral
    from ckless_lightning.models.parallelize import parallelize_llama3, parallelize_mixtral

    if isinstance(model, Mixtral):
        return parallelize_mixtral(model, mesh, cfg=cfg)
    if isinstance(model, Llama3):
        return parallelize_llama3(model, mesh, cfg=cfg)
    raise TypeError(f"parallelize_model: expected a Llama3 or Mixtral model, got {type(model).__name__}.")
