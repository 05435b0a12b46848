"""Which tensor dim FSDP2 shards each parameter on: the FSDP2 plan's part the memory plan shares.

Apart from :mod:`.parallelize` so that the launcher's memory plan reads it without importing
FSDP2 and DTensor (about a second of CPU in every launch).
"""

from __future__ import annotations

from torch import nn

from ckless_lightning.models.mixtral import Experts

__all__ = ["fsdp_shard_dims"]


def fsdp_shard_dims(model: nn.Module, shard_size: int) -> dict[str, int]:
    """The tensor dim FSDP2 shards each parameter on, by parameter name: 0, except expert weights.

    Expert weights ``[E, ...]`` are sharded on dim 1 when ``shard_size`` (ranks in
    the shard dim) divides it: with 8 experts over 32 or more ranks, dim 0 would
    leave most ranks empty and a few holding whole experts (torchtitan does the
    same without expert parallelism). FSDP2 shards only dim 0 unevenly, so an
    expert weight whose dim 1 does not divide stays on dim 0. The memory plan
    (``ckless_lightning.runtime.memory_plan``) uses the same map.
    """
    dims = {name: 0 for name, _ in model.named_parameters()}
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):
            for param_name, param in module.named_parameters(recurse=False):
                if param.ndim > 1 and param.shape[1] % shard_size == 0:
                    dims[f"{module_name}.{param_name}" if module_name else param_name] = 1
    return dims
