"""Sharding-independent weight initialisation whose cost per rank scales with the rank's shard.

A replacement rank that rebuilds its shard must get bit-identical weights to
what a fresh run would have had, whatever the world size or mesh, without
drawing the whole model. So the random values are cut into blocks that do not
depend on the sharding:

* every parameter is viewed as rows, the vectors along its last dim
  (``prod(shape[:-1])`` rows of ``shape[-1]`` elements), and its rows are split
  into fixed blocks of ``max(1, BLOCK_ELEMENTS // shape[-1])`` rows;
* the blocks of the whole model are numbered in sorted-parameter-name order,
  and block ``g`` is drawn (float32 normal, on CPU) from its own generator
  seeded with ``_mix32(_mix32(seed) + g)``, a bijection of ``g``: no two blocks
  of one model share a random stream;
* a rank computes which rows its local shard covers (FSDP2's ``torch.chunk``
  split of the sharded dims, :func:`shard_slices`), draws only the blocks that
  overlap them, and copies its rows into ``param.to_local()``.

Cost per rank: its own shard's elements plus at most two partial blocks per
contiguous run of rows (one run per parameter when it is sharded on dim 0; one
per expert for Mixtral expert weights sharded on dim 1), at about 6 ns per
element on one CPU core, drawing and copying included (``INIT_NS_PER_ELEMENT``,
measured on the 2-core dev machine): ~50 s for all of 8B on one rank, ~7 min
/ N for 70B over N ranks (~7 s at 64). A parameter sharded on its last dim (a
1-D one: FSDP2 shards dim 0) draws all its rows. CPU memory: the rank's
largest local shard plus two blocks; nothing full-size is made on the device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ckless_lightning.models.layers import RMSNorm, RotaryEmbedding
from ckless_lightning.models.llama3 import TransformerBlock
from ckless_lightning.models.mixtral import MixtralBlock

if TYPE_CHECKING:  # DTensor is imported where a DTensor is met: the launcher's memory plan counts
    # the draws (init_draw_count) without it (its import is ~1 s of CPU)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Placement

__all__ = [
    "BLOCK_ELEMENTS",
    "INIT_NS_PER_ELEMENT",
    "INIT_STD",
    "init_draw_count",
    "init_weights",
    "reset_buffers",
    "shard_slices",
    "stable_param_name",
]

INIT_STD = 0.02
"""Std of every linear/embedding/expert weight, except residual output projections (see ``init_weights``)."""

BLOCK_ELEMENTS = 16384
"""Target elements per random block (64 KiB of float32): big enough that creating and seeding a
generator (~3 us) costs under 5% of the draw (~70 us), small enough that the partial blocks at a
shard's edges add little."""

INIT_NS_PER_ELEMENT = 6.3
"""Measured cost per element of ``init_weights`` on one CPU core, end to end (float32 normal draw
in blocks, ~4.5 ns, plus assembling and copying into the parameter), on the 2-core dev machine
with torch 2.13: an estimate elsewhere, and the copy to a GPU is not included."""

# Names wrappers insert into parameter FQNs (FSDP1, torch.compile, activation checkpointing).
# FSDP2 (``fully_shard``) keeps FQNs unchanged.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
# Projections that write into the residual stream: attention.wo, feed_forward.w2, experts.w2.
_RESIDUAL_PROJECTIONS = frozenset({"wo", "w2"})
_MASK32 = 0xFFFFFFFF

Slices = list[tuple[int, int]]  # one (start, stop) per tensor dim


def stable_param_name(name: str) -> str:
    """Strip wrapper prefixes so the same parameter gets the same blocks sharded or not."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _mix32(x: int) -> int:
    """MurmurHash3's 32-bit finaliser: a bijection on 32-bit ints that scrambles neighbours."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK32
    x ^= x >> 16
    return x


def _rows_cols(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of a shape viewed as vectors along its last dim (a scalar is one 1-element row)."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def _block_rows(shape: Sequence[int]) -> int:
    """Rows per random block; depends on the shape alone."""
    return max(1, BLOCK_ELEMENTS // max(_rows_cols(shape)[1], 1))


def _num_blocks(shape: Sequence[int]) -> int:
    rows, cols = _rows_cols(shape)
    return 0 if rows * cols == 0 else math.ceil(rows / _block_rows(shape))


def shard_slices(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> Slices | None:
    """The ``(start, stop)`` per tensor dim of the local shard at ``coordinate`` of a mesh.

    Follows DTensor's (and FSDP2's) ``torch.chunk`` split: a dim of size ``n``
    over ``k`` mesh ranks gives ranks chunks of ``ceil(n / k)`` in order, the
    last ones shorter or empty; several mesh dims sharding one tensor dim
    split it in mesh-dim order. ``None`` for placements other than
    ``Shard``/``Replicate`` (e.g. ``Partial``), whose local tensor is no slice.
    """
    from torch.distributed.tensor import Replicate, Shard

    slices = [(0, size) for size in shape]
    for placement, ranks, coord in zip(placements, mesh_shape, coordinate, strict=True):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard or len(shape) == 0:  # _StridedShard, Partial, ...
            return None
        _chunk(slices, placement.dim % len(shape), ranks, coord)
    return slices


def _chunk(slices: Slices, dim: int, ranks: int, coord: int) -> None:
    """Narrow ``slices[dim]`` to chunk ``coord`` of ``ranks`` (``torch.chunk``'s split), in place."""
    start, stop = slices[dim]
    size = stop - start
    chunk = math.ceil(size / ranks)
    slices[dim] = (start + min(coord * chunk, size), start + min((coord + 1) * chunk, size))


def _row_runs(shape: Sequence[int], slices: Slices) -> list[tuple[int, int]]:
    """Contiguous ranges ``[a, b)`` of full-tensor rows that ``slices`` covers, in ascending order.

    Rows are indexed row-major over ``shape[:-1]``; the last dim's slice does
    not matter here (every covered row is drawn whole).
    """
    if len(shape) == 0:
        return [(0, 1)]
    lead, lead_slices = list(shape[:-1]), slices[:-1]
    if any(stop <= start for start, stop in slices):
        return []
    # The innermost leading dim whose slice is partial: the dims after it are whole,
    # so each index of the dims before it gives one contiguous run.
    partial = [d for d, (start, stop) in enumerate(lead_slices) if (start, stop) != (0, lead[d])]
    if not partial:
        return [(0, math.prod(lead))]
    j = partial[-1]
    strides = [math.prod(lead[d + 1 :]) for d in range(len(lead))]
    start_j, stop_j = lead_slices[j]
    runs = []
    for index in itertools.product(*(range(start, stop) for start, stop in lead_slices[:j])):
        base = sum(i * s for i, s in zip(index, strides, strict=False)) + start_j * strides[j]
        runs.append((base, base + (stop_j - start_j) * strides[j]))
    return runs


def _block_ranges(runs: list[tuple[int, int]], block_rows: int) -> list[tuple[int, int]]:
    """Blocks ``[k0, k1)`` overlapping ``runs`` (ascending), merged where they touch or overlap."""
    ranges: list[tuple[int, int]] = []
    for a, b in runs:
        k0, k1 = a // block_rows, (b - 1) // block_rows + 1
        if ranges and k0 <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], k1))
        else:
            ranges.append((k0, k1))
    return ranges


def _drawn_elements(shape: Sequence[int], slices: Slices) -> int:
    """How many random elements drawing the local shard ``slices`` of ``shape`` takes."""
    rows, cols = _rows_cols(shape)
    block_rows = _block_rows(shape)
    ranges = _block_ranges(_row_runs(shape, slices), block_rows)
    return sum((min(k1 * block_rows, rows) - k0 * block_rows) * cols for k0, k1 in ranges)


def _draw_block(out: torch.Tensor, block_seed: int, std: float) -> None:
    """Fill the contiguous CPU float32 ``out`` (one whole block) from the block's own generator."""
    out.normal_(0.0, std, generator=torch.Generator(device="cpu").manual_seed(block_seed))


def _draw_local(
    shape: Sequence[int], slices: Slices, seed_key: int, first_block: int, std: float
) -> torch.Tensor:
    """The float32 CPU values of the shard ``slices`` of a parameter of ``shape``.

    Draws only the blocks overlapping the shard's rows; block ``k`` of this
    parameter uses the seed ``_mix32(seed_key + first_block + k)``.
    """
    local_shape = [stop - start for start, stop in slices]
    if math.prod(local_shape) == 0:
        return torch.empty(local_shape, dtype=torch.float32)
    rows, cols = _rows_cols(shape)
    block_rows = _block_rows(shape)
    runs = _row_runs(shape, slices)
    pieces = []
    for k0, k1 in _block_ranges(runs, block_rows):
        r0, r1 = k0 * block_rows, min(k1 * block_rows, rows)
        span = torch.empty(r1 - r0, cols, dtype=torch.float32)
        for k in range(k0, k1):
            # A contiguous row range of ``span``: the same values as a fresh block of that size.
            block = span[k * block_rows - r0 : min((k + 1) * block_rows, rows) - r0]
            _draw_block(block, _mix32(seed_key + first_block + k), std)
        pieces.extend(span[max(a, r0) - r0 : min(b, r1) - r0] for a, b in runs if a < r1 and b > r0)
    local_rows = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if len(shape) == 0:
        return local_rows.reshape(())
    col_start, col_stop = slices[-1]
    return local_rows.view(*local_shape[:-1], cols)[..., col_start:col_stop]


def _first_blocks(names_shapes: list[tuple[str, Sequence[int]]]) -> dict[str, int]:
    """Global index of each parameter's first block, numbering blocks in sorted-name order."""
    first: dict[str, int] = {}
    offset = 0
    for name, shape in sorted(names_shapes, key=lambda item: item[0]):
        first[name] = offset
        offset += _num_blocks(shape)
    if offset > 2**32:
        raise ValueError(f"init_weights: {offset} random blocks exceed the 2**32 distinct block seeds.")
    return first


def _plan(model: nn.Module) -> tuple[dict[str, int], dict[str, float | None]]:
    """Per stable parameter name: its first block index, and its std (``None``: a norm weight, ones)."""
    n_layers = sum(isinstance(m, TransformerBlock | MixtralBlock) for m in model.modules())
    residual_std = INIT_STD / math.sqrt(2 * max(n_layers, 1))
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    stds: dict[str, float | None] = {}
    shapes = []
    for raw_name, param in model.named_parameters():
        name = stable_param_name(raw_name)
        shapes.append((name, tuple(param.shape)))
        if id(param) in norm_weights:
            stds[name] = None
        else:
            is_residual = bool(_RESIDUAL_PROJECTIONS.intersection(name.split(".")[-2:]))
            stds[name] = residual_std if is_residual else INIT_STD
    return _first_blocks(shapes), stds


def _mesh_coordinate(mesh: DeviceMesh) -> tuple[int, ...] | None:
    """This rank's coordinate in ``mesh``, from the live global rank.

    Not ``mesh.get_coordinate()``: that is fixed when the mesh object is made,
    and DTensor's sharding-propagation cache can hand a parameter an equal mesh
    object made under another rank (seen with several process groups, one
    after another, in one process).
    """
    hits = (mesh.mesh == torch.distributed.get_rank()).nonzero()
    return tuple(hits[0].tolist()) if len(hits) else None


def reset_buffers(model: nn.Module) -> None:
    """Recompute the derived (non-persistent) buffers, RoPE's tables, on whatever device they live on.

    ``init_weights`` calls it; call it alone when the weights come from a
    restore instead (the tables are not in the state dict).
    """
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()


def init_weights(model: nn.Module, seed: int) -> None:
    """Initialise ``model`` in place from ``seed`` alone, identically for any sharding.

    Works on plain parameters and on FSDP2-sharded DTensors (call after
    ``fully_shard`` and ``model.to_empty(device=...)``); the resulting full
    weights are the same for 1, 2, 3, 4... ranks and any (replicate, shard)
    mesh, and each rank draws only about its own shard (module docstring).
    Norm weights are ones; other weights ``N(0, 0.02)``, with residual output
    projections (``wo``, ``w2``) scaled by ``1/sqrt(2 * n_layers)`` as in
    GPT-2. RoPE buffers are recomputed (:func:`reset_buffers`). Parameter
    names are taken relative to ``model``, so always pass the same module
    (e.g. the bare ``Llama3``).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"init_weights: seed={seed!r} must be an int in [0, 2**32).")
    from torch.distributed.tensor import DTensor, distribute_tensor

    first_blocks, stds = _plan(model)
    seed_key = _mix32(seed)

    with torch.no_grad():
        for raw_name, param in model.named_parameters():
            if param.is_meta:
                raise ValueError(
                    f"init_weights: parameter {raw_name!r} is on the meta device; "
                    "call model.to_empty(device=...) first."
                )
            name = stable_param_name(raw_name)
            shape = tuple(param.shape)
            local = param.to_local() if isinstance(param, DTensor) else param
            if stds[name] is None:
                local.fill_(1.0)
                continue
            if isinstance(param, DTensor):
                coordinate = _mesh_coordinate(param.device_mesh)
                if coordinate is None:  # this rank is not in the parameter's mesh: nothing to hold
                    continue
                slices = shard_slices(shape, param.device_mesh.shape, coordinate, param.placements)
            else:
                slices = [(0, size) for size in shape]
            if slices is None:  # a placement that is no slice: draw it all and let DTensor split it
                full = _draw_local(shape, [(0, s) for s in shape], seed_key, first_blocks[name], stds[name])
                local_values = distribute_tensor(
                    full, param.device_mesh, param.placements, src_data_rank=None
                ).to_local()
            else:
                local_values = _draw_local(shape, slices, seed_key, first_blocks[name], stds[name])
            if local_values.shape != local.shape:
                raise RuntimeError(
                    f"init_weights: {raw_name!r} holds a local shard of shape {tuple(local.shape)}, "
                    f"but its placements {param.placements} give {tuple(local_values.shape)} here."
                )
            local.copy_(local_values)
    reset_buffers(model)


def init_draw_count(
    model: nn.Module, shard_dims: dict[str, int], shard_size: int, shard_rank: int = 0
) -> int:
    """Random elements ``init_weights`` draws on shard rank ``shard_rank`` of ``shard_size``.

    ``model`` may be on the meta device; ``shard_dims`` maps each parameter
    name to the dim FSDP2 shards (``fsdp_shard_dims``). Replicas of an HSDP
    mesh draw the same as their shard rank. Rank 0 holds the largest shards.
    """
    _, stds = _plan(model)
    total = 0
    for raw_name, param in model.named_parameters():
        if stds[stable_param_name(raw_name)] is None or param.numel() == 0:
            continue
        shape = tuple(param.shape)
        slices = [(0, size) for size in shape]
        if shape:  # FSDP2's Shard(dim) over the shard ranks (shard_slices' arithmetic, no DTensor)
            _chunk(slices, shard_dims.get(raw_name, 0) % len(shape), shard_size, shard_rank)
        total += _drawn_elements(shape, slices)
    return total
