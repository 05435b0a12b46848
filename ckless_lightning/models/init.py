"""Sharding-independent weight initialisation.

A replacement rank that rebuilds its shard must get bit-identical weights to
what a fresh run would have had, whatever the world size or mesh. So every
parameter is drawn in full, on CPU, from its own generator seeded by
``(seed, crc32(parameter name))``; each rank then keeps only its slice.

Cost: every rank draws every full tensor on CPU, one float32 normal sample per
model weight (about 4 ns each on one core: ~40 s per rank for 8B, ~5 min for
70B, ~30 min for 405B), holds the largest full tensor in CPU memory (the 405B
embedding is 8.4 GB in float32), and makes one transient full-size copy of it
on the mesh's device while slicing.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ckless_lightning.models.layers import RMSNorm, RotaryEmbedding
from ckless_lightning.models.llama3 import TransformerBlock
from ckless_lightning.models.mixtral import MixtralBlock

__all__ = ["INIT_STD", "init_weights", "stable_param_name"]

INIT_STD = 0.02
"""Std of every linear/embedding/expert weight, except residual output projections (see ``init_weights``)."""

# Names wrappers insert into parameter FQNs (FSDP1, torch.compile, activation checkpointing).
# FSDP2 (``fully_shard``) keeps FQNs unchanged.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
# Projections that write into the residual stream: attention.wo, feed_forward.w2, experts.w2.
_RESIDUAL_PROJECTIONS = frozenset({"wo", "w2"})


def stable_param_name(name: str) -> str:
    """Strip wrapper prefixes so the same parameter hashes the same sharded or not."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _param_seeds(seed: int, names: list[str]) -> dict[str, int]:
    """A distinct 32-bit generator seed per parameter name, from ``seed`` and the name alone.

    The CPU generator (mt19937) keeps only the low 32 bits of ``manual_seed``,
    so ``seed`` and the name are hashed together into 32 bits; the rare crc32
    collision is resolved by re-hashing with a counter, in sorted-name order.
    """
    seeds: dict[str, int] = {}
    used: set[int] = set()
    for name in sorted(names):
        value, salt = zlib.crc32(f"{seed}/{name}".encode()), 0
        while value in used:
            salt += 1
            value = zlib.crc32(f"{seed}/{name}/{salt}".encode())
        used.add(value)
        seeds[name] = value
    return seeds


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full CPU tensor into ``param`` (plain tensor, or this rank's slice of a DTensor)."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank slices its own chunk locally, no communication.
        # distribute_tensor first moves ``full`` to the mesh's device type.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def init_weights(model: nn.Module, seed: int) -> None:
    """Initialise ``model`` in place from ``seed`` alone, identically for any sharding.

    Works on plain parameters and on FSDP2-sharded DTensors (call after
    ``fully_shard`` and ``model.to_empty(device=...)``); the resulting full
    weights are the same for 1, 2, 4... ranks and any (replicate, shard) mesh.
    Norm weights are ones; other weights ``N(0, 0.02)``, with residual output
    projections (``wo``, ``w2``) scaled by ``1/sqrt(2 * n_layers)`` as in
    GPT-2. RoPE buffers are recomputed. Parameter names are taken relative to
    ``model``, so always pass the same module (e.g. the bare ``Llama3``).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"init_weights: seed={seed!r} must be an int in [0, 2**32).")
    n_layers = sum(isinstance(m, TransformerBlock | MixtralBlock) for m in model.modules())
    residual_std = INIT_STD / math.sqrt(2 * max(n_layers, 1))
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}

    param_seeds = _param_seeds(seed, [stable_param_name(n) for n, _ in model.named_parameters()])

    with torch.no_grad():
        for raw_name, param in model.named_parameters():
            if param.is_meta:
                raise ValueError(
                    f"init_weights: parameter {raw_name!r} is on the meta device; "
                    "call model.to_empty(device=...) first."
                )
            name = stable_param_name(raw_name)
            if id(param) in norm_weights:
                full = torch.ones(param.shape, dtype=torch.float32)
            else:
                parts = name.split(".")
                is_residual = bool(_RESIDUAL_PROJECTIONS.intersection(parts[-2:]))
                generator = torch.Generator(device="cpu").manual_seed(param_seeds[name])
                full = torch.empty(param.shape, dtype=torch.float32)
                full.normal_(0.0, residual_std if is_residual else INIT_STD, generator=generator)
            _copy_full_into(param, full)
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_buffers()
