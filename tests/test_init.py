"""Shard-scaled init: each rank draws about its own shard; the full weights never depend on the mesh.

Most checks run every rank of every mesh one after another in this process,
on torch's fake process group (collectives are no-ops; a rank's local shard
and ``distribute_tensor``'s local slicing are real). ``test_models_sharded``
checks the same on real gloo ranks for 2, 3 and 4 ranks and HSDP.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from test_models_sharded import CONFIGS  # the tiny recipes' shapes and an uneven Mixtral
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from ckless_lightning.models import (
    FSDPConfig,
    Llama3Config,
    build_model,
    fsdp_shard_dims,
    init_draw_count,
    init_weights,
    parallelize_model,
    reset_buffers,
)
from ckless_lightning.models import init as init_module
from ckless_lightning.models.init import INIT_NS_PER_ELEMENT, shard_slices
from ckless_lightning.models.layers import RotaryEmbedding
from ckless_lightning.runtime.config import job_config_from_dict
from ckless_lightning.runtime.memory_plan import plan_job

SEED = 99
# (replicate, shard): world sizes 1 to 5 and HSDP.
MESHES = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 2), (1, 5)]


@contextmanager
def _fake_rank(rank: int, world_size: int) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _DrawCounter:
    """Counts the random elements ``init_weights`` draws, per parameter (by its first block index)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.drawn: dict[int, int] = {}
        self._current = -1
        draw_local, draw_block = init_module._draw_local, init_module._draw_block

        def counting_draw_local(shape, slices, seed_key, first_block, std):  # type: ignore[no-untyped-def]
            self._current = first_block
            return draw_local(shape, slices, seed_key, first_block, std)

        def counting_draw_block(out, block_seed, std):  # type: ignore[no-untyped-def]
            self.drawn[self._current] = self.drawn.get(self._current, 0) + out.numel()
            draw_block(out, block_seed, std)

        monkeypatch.setattr(init_module, "_draw_local", counting_draw_local)
        monkeypatch.setattr(init_module, "_draw_block", counting_draw_block)

    def by_name(self, model: torch.nn.Module) -> dict[str, int]:
        first_blocks, _ = init_module._plan(model)
        return {name: self.drawn.get(first, 0) for name, first in first_blocks.items()}


@pytest.mark.parametrize(
    ("block_elements", "meshes"),
    [(1000, MESHES), (init_module.BLOCK_ELEMENTS, [(1, 4), (2, 2)])],
    ids=["1000", "default"],
)
def test_every_rank_holds_its_slice_of_the_unsharded_init(
    monkeypatch: pytest.MonkeyPatch, block_elements: int, meshes: list[tuple[int, int]]
) -> None:
    """Any mesh: local shard == slice of the unsharded init; draws <= shard + 2 blocks per row run.

    With 1000-element blocks (not a divisor of any row count) the tiny models'
    tensors span many blocks and shards start and end inside blocks; the
    default blocks hold whole tiny tensors.
    """
    monkeypatch.setattr(init_module, "BLOCK_ELEMENTS", block_elements)
    counter = _DrawCounter(monkeypatch)
    saw_empty = saw_mid_block = False
    for family, cfg in CONFIGS.items():
        ref = build_model(cfg)
        init_weights(ref, SEED)
        ref_params = {name: p.detach() for name, p in ref.named_parameters()}
        for replicate, shard in meshes:
            world = replicate * shard
            for rank in range(world):
                where = f"{family} mesh=({replicate}, {shard}) rank={rank}"
                with _fake_rank(rank, world):
                    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
                    dp_mesh = mesh if replicate > 1 else mesh["shard"]
                    with torch.device("meta"):
                        model = build_model(cfg)
                    parallelize_model(model, mesh, cfg=FSDPConfig())
                    model.to_empty(device="cpu")
                    counter.drawn.clear()
                    init_weights(model, SEED)
                    drawn = counter.by_name(model)
                    for name, p in model.named_parameters():
                        local = p.to_local()
                        expected = distribute_tensor(
                            ref_params[name], dp_mesh, p.placements, src_data_rank=None
                        ).to_local()
                        assert torch.equal(local, expected), f"{where} {name}"
                        if name.endswith("norm.weight"):
                            assert drawn[name] == 0, f"{where} {name}"
                            continue
                        # Sharded on dim d: one contiguous run of rows per index of dims < d.
                        dim = p.placements[-1].dim
                        runs = 1 if dim == 0 else p.shape[:dim].numel()
                        cols = p.shape[-1]
                        block = max(1, block_elements // cols) * cols
                        assert drawn[name] <= local.numel() + 2 * runs * block, f"{where} {name}"
                        saw_empty |= local.numel() == 0
                        saw_mid_block |= 0 < drawn[name] - local.numel() < block
                    # The dry run's count is this count.
                    count = init_draw_count(model, fsdp_shard_dims(model, shard), shard, rank % shard)
                    assert count == sum(drawn.values()), where
    assert saw_empty and (saw_mid_block or block_elements != 1000)


def test_draws_scale_with_the_shard() -> None:
    """A Llama 3-shaped model with real-size blocks: 4 ranks each draw ~1/4 of the weights."""
    cfg = Llama3Config(dim=512, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1000, ffn_dim=1536)
    with torch.device("meta"):
        model = build_model(cfg)
    full = init_draw_count(model, fsdp_shard_dims(model, 1), 1)
    assert full == sum(p.numel() for n, p in model.named_parameters() if not n.endswith("norm.weight"))
    for rank in range(4):
        count = init_draw_count(model, fsdp_shard_dims(model, 4), 4, rank)
        assert full / 4 * 0.95 <= count <= full / 4 * 1.05, (rank, count / full)


SLICE_CASES = [
    ((6,), (7, 5), [Shard(0)]),
    ((6,), (2, 3), [Shard(0)]),  # ranks 2-5 empty
    ((6,), (4, 13, 5), [Shard(1)]),
    ((6,), (4, 13), [Shard(-1)]),
    ((6,), (0, 3), [Shard(0)]),
    ((6,), (9,), [Replicate()]),
    ((2, 3), (11, 4), [Replicate(), Shard(0)]),
    ((2, 3), (11, 4), [Shard(0), Shard(0)]),  # nested split of one dim, in mesh-dim order
    ((3, 2), (5, 7, 3), [Shard(1), Shard(0)]),
    ((3, 2), (5, 7, 3), [Shard(2), Replicate()]),
]


def test_shard_slices_match_distribute_tensor() -> None:
    for mesh_shape, shape, placements in SLICE_CASES:
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        world = torch.Size(mesh_shape).numel()
        for rank in range(world):
            with _fake_rank(rank, world):
                mesh = init_device_mesh("cpu", mesh_shape)
                coordinate = mesh.get_coordinate()
                assert coordinate is not None
                slices = shard_slices(shape, mesh_shape, coordinate, placements)
                assert slices is not None
                mine = full[tuple(slice(start, stop) for start, stop in slices)]
                theirs = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
                assert torch.equal(mine, theirs), (mesh_shape, shape, placements, rank)


def test_reset_buffers_recomputes_only_derived_buffers() -> None:
    cfg = CONFIGS["llama3"]
    fresh = build_model(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
    reset_buffers(model)
    for (name, buf), ref in zip(model.named_buffers(), fresh.buffers(), strict=True):
        assert torch.equal(buf, ref), name
    assert any(isinstance(m, RotaryEmbedding) for m in model.modules())
    for name, p in model.named_parameters():  # weights untouched
        assert torch.equal(p, torch.full_like(p, 3.0)), name


def test_different_parameters_never_share_a_block_seed() -> None:
    with torch.device("meta"):
        model = build_model(CONFIGS["mixtral"])
    first_blocks, _ = init_module._plan(model)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    spans = sorted((first, first + init_module._num_blocks(shapes[n])) for n, first in first_blocks.items())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    seeds = [init_module._mix32(init_module._mix32(SEED) + g) for g in range(spans[-1][1])]
    assert len(set(seeds)) == len(seeds)


def test_dry_run_plan_estimates_init_per_rank(compose) -> None:  # type: ignore[no-untyped-def]
    plan = plan_job(job_config_from_dict(compose("recipe=llama3_70b")))
    _, shard = plan.mesh
    assert plan.init_draw_elements == pytest.approx(plan.num_params / shard, rel=0.01)
    assert plan.init_seconds == pytest.approx(plan.init_draw_elements * INIT_NS_PER_ELEMENT * 1e-9)
    assert "weight init:  ~" in plan.format() and "per rank (estimate" in plan.format()
