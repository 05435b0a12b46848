"""FSDP2 / HSDP on gloo CPU ranks: sharded weights, loss and gradients equal the unsharded model's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ckless_lightning.models import (
    FSDPConfig,
    Llama3Config,
    MixtralConfig,
    build_model,
    init_weights,
    parallelize_model,
)

SEED = 1234
CONFIGS: dict[str, Llama3Config | MixtralConfig] = {
    "llama3": Llama3Config(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=384),
    "mixtral": MixtralConfig(
        dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, n_experts=8, top_k=2
    ),
    # Uneven shards: 250 vocab rows over 4 ranks; 6 experts (expert weights are split on dim 1).
    "mixtral_uneven": MixtralConfig(
        dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=250, ffn_dim=96, n_experts=6, top_k=2
    ),
}


def _loss(model: torch.nn.Module, cfg: Llama3Config | MixtralConfig, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens[:, :-1])
    loss = F.cross_entropy(out.logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    if out.aux_loss is not None:
        loss = loss + cfg.router_aux_loss_coef * out.aux_loss
    return loss


def _compare(rank: int, world_size: int, mesh_shapes: list[tuple[int, int]], families: list[str]) -> dict:
    """Per (family, mesh): sharded vs unsharded loss and the largest weight / gradient differences."""
    meshes = {
        shape: init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")) for shape in mesh_shapes
    }
    tokens = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(0))
    report: dict[tuple[str, tuple[int, int]], dict[str, Any]] = {}
    for family in families:
        cfg = CONFIGS[family]
        ref = build_model(cfg)
        init_weights(ref, SEED)
        ref_loss = _loss(ref, cfg, tokens)
        ref_loss.backward()
        ref_params = dict(ref.named_parameters())
        for shape, mesh in meshes.items():
            with torch.device("meta"):
                model = build_model(cfg)
            parallelize_model(model, mesh, cfg=FSDPConfig())
            model.to_empty(device="cpu")
            init_weights(model, SEED)
            params = dict(model.named_parameters())
            assert params.keys() == ref_params.keys()
            assert all(isinstance(p, DTensor) for p in params.values())
            weights_equal = all(torch.equal(p.full_tensor(), ref_params[n]) for n, p in params.items())
            loss = _loss(model, cfg, tokens)
            loss.backward()
            grad_err = max(
                ((p.grad.full_tensor() - ref_params[n].grad).abs().max().item() for n, p in params.items()),
                default=0.0,
            )
            report[(family, shape)] = {
                "loss": loss.item(),
                "ref_loss": ref_loss.item(),
                "weights_equal": weights_equal,
                "grad_err": grad_err,
                "placements": {str(p.placements) for p in params.values()},
                "local_rows": params["tok_embeddings.weight"].to_local().shape[0],
            }
    return report


def _bf16_loss(rank: int, world_size: int) -> float:
    """Loss of one bf16-compute / fp32-reduce FSDP step on the tiny Mixtral."""
    cfg = CONFIGS["mixtral"]
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    with torch.device("meta"):
        model = build_model(cfg)
    parallelize_model(model, mesh, cfg=FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32"))
    model.to_empty(device="cpu")
    init_weights(model, SEED)
    tokens = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = _loss(model, cfg, tokens)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    return loss.item()


def _materialized_loss_err(rank: int, world_size: int) -> float:
    """Shard an already initialised Llama (no resharding after forward); |loss - unsharded loss|."""
    cfg = CONFIGS["llama3"]
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    tokens = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(0))
    ref = build_model(cfg)
    init_weights(ref, SEED)
    model = build_model(cfg)
    init_weights(model, SEED)
    parallelize_model(model, mesh, cfg=FSDPConfig(reshard_after_forward=False))
    with torch.no_grad():
        return abs(_loss(model, cfg, tokens).item() - _loss(ref, cfg, tokens).item())


def _two_rank_checks(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "compare": _compare(rank, world_size, [(1, 2)], ["llama3", "mixtral"]),
        "bf16_loss": _bf16_loss(rank, world_size),
        "materialized_loss_err": _materialized_loss_err(rank, world_size),
    }


def _check(results: list[dict], world_size: int) -> None:
    for rank_report in results:
        for (family, shape), r in rank_report.items():
            where = f"{family} mesh={shape}"
            assert r["weights_equal"], f"{where}: full weights differ from the unsharded init"
            assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5, abs=1e-5), where
            assert r["grad_err"] <= 1e-5, f"{where}: max |grad - ref grad| = {r['grad_err']}"
            # Every parameter on dim 0, except Mixtral's expert weights on dim 1 (fsdp_shard_dims).
            dims = {0, 1} if family.startswith("mixtral") else {0}
            expected = {
                f"(Replicate(), Shard(dim={d}))" if shape[0] > 1 else f"(Shard(dim={d}),)" for d in dims
            }
            assert r["placements"] == expected, where
    # Every rank really holds a different slice of the embedding (rows split over the shard dim).
    rows = [rank_report[("llama3", (1, world_size))]["local_rows"] for rank_report in results]
    assert sum(rows) == CONFIGS["llama3"].vocab_size


@pytest.mark.timeout(180)
def test_fsdp_two_ranks_matches_unsharded_and_runs_bf16() -> None:
    results = run_ranks(_two_rank_checks, 2, timeout=150)
    _check([r["compare"] for r in results], 2)
    # bf16 compute with fp32 reduction: same loss on both ranks, close to the fp32 unsharded one.
    assert results[0]["bf16_loss"] == results[1]["bf16_loss"]
    ref_loss = results[0]["compare"][("mixtral", (1, 2))]["ref_loss"]
    assert results[0]["bf16_loss"] == pytest.approx(ref_loss, rel=2e-2)
    assert all(r["materialized_loss_err"] <= 1e-5 for r in results)


@pytest.mark.timeout(240)
def test_hsdp_and_fsdp_four_ranks_match_unsharded() -> None:
    results = run_ranks(_compare, 4, [(2, 2), (1, 4)], ["llama3", "mixtral", "mixtral_uneven"], timeout=210)
    _check(results, 4)


@pytest.mark.timeout(180)
def test_fsdp_three_ranks_uneven_shards_match_unsharded() -> None:
    # 256 vocab rows -> 86, 86, 84; Mixtral's 64-row expert w2 on dim 0 (6 experts -> 2 each), w1/w3 on dim 1.
    results = run_ranks(_compare, 3, [(1, 3)], ["llama3", "mixtral_uneven"], timeout=150)
    _check(results, 3)


@pytest.mark.timeout(60)
def test_run_ranks_reports_the_failing_rank() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 raised[^\n]*:\n[\s\S]*boom on rank 1"):
        run_ranks(_fail_on_rank_one, 2, timeout=50)


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    torch.distributed.barrier()  # rank 0 blocks here until run_ranks kills it
