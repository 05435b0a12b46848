"""Single-process model tests: published parameter counts, config validation, forward, init."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ckless_lightning.models import (
    CausalLMOutput,
    FSDPConfig,
    Llama3,
    Llama3Config,
    Mixtral,
    MixtralConfig,
    build_model,
    init_weights,
    parallelize_model,
)
from ckless_lightning.models.layers import RotaryEmbedding, apply_rotary_emb

LLAMA_TINY = Llama3Config(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=384)
MIXTRAL_TINY = MixtralConfig(
    dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, n_experts=8, top_k=2
)

# (config, count rounded to 0.01B as published, exact count)
PUBLISHED = {
    "llama3-8b": (Llama3Config(4096, 32, 32, 8, 128256, 14336, rope_theta=500000.0), 8.03, 8_030_261_248),
    "llama3-70b": (Llama3Config(8192, 80, 64, 8, 128256, 28672), 70.55, 70_553_706_496),
    "llama3-405b": (Llama3Config(16384, 126, 128, 8, 128256, 53248), 405.85, 405_853_388_800),
    "mixtral-8x7b": (
        MixtralConfig(4096, 32, 32, 8, 32000, 14336, n_experts=8, top_k=2, rope_theta=1e6),
        46.70,
        46_702_792_704,
    ),
    "mixtral-8x22b": (
        MixtralConfig(6144, 56, 48, 8, 32768, 16384, n_experts=8, top_k=2, rope_theta=1e6),
        140.63,
        140_630_071_296,
    ),
}


def _tokens(batch: int = 2, seq_len: int = 16, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_parameter_counts(name: str) -> None:
    cfg, billions, exact = PUBLISHED[name]
    with torch.device("meta"):
        model = build_model(cfg)
    built = sum(p.numel() for p in model.parameters())
    assert built == cfg.num_params() == exact
    assert round(exact / 1e9, 2) == billions
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (Llama3Config, {"n_kv_heads": 3}, "n_kv_heads"),
        (Llama3Config, {"n_heads": 5}, "dim"),
        (Llama3Config, {"dim": 0}, "dim"),
        (Llama3Config, {"dim": 12, "n_heads": 4, "n_kv_heads": 2}, "dim"),  # odd head dim
        (Llama3Config, {"rope_theta": -1.0}, "rope_theta"),
        (Llama3Config, {"max_seq_len": 0}, "max_seq_len"),
        (MixtralConfig, {"top_k": 9}, "top_k"),
        (MixtralConfig, {"n_experts": 0}, "n_experts"),
        (MixtralConfig, {"n_kv_heads": 3}, "n_kv_heads"),
        (MixtralConfig, {"router_aux_loss_coef": -0.1}, "router_aux_loss_coef"),
    ],
)
def test_config_validation_names_the_field(cls: type, kwargs: dict, field: str) -> None:
    base = {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "ffn_dim": 128}
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}="):
        cls(**{**base, **kwargs})


def test_fsdp_config_validation() -> None:
    with pytest.raises(ValueError, match=r"FSDPConfig\.param_dtype="):
        FSDPConfig(param_dtype="bf16")
    with pytest.raises(ValueError, match=r"FSDPConfig\.reduce_dtype="):
        FSDPConfig(reduce_dtype="int8")
    policy = FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32").mp_policy()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32


def test_dispatchers_reject_unknown_types() -> None:
    with pytest.raises(TypeError, match="build_model"):
        build_model(FSDPConfig())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="parallelize_model"):
        parallelize_model(torch.nn.Linear(2, 2), None, cfg=FSDPConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize("cfg", [LLAMA_TINY, MIXTRAL_TINY], ids=["llama3", "mixtral"])
def test_forward_shapes_and_causality(cfg: Llama3Config | MixtralConfig) -> None:
    torch.manual_seed(0)
    model = build_model(cfg)
    init_weights(model, seed=1)
    tokens = _tokens()
    with torch.no_grad():
        out = model(tokens)
        assert isinstance(out, CausalLMOutput)
        assert out.logits.shape == (2, 16, cfg.vocab_size)
        if isinstance(model, Mixtral):
            assert out.aux_loss is not None and out.aux_loss.shape == ()
            assert torch.isfinite(out.aux_loss)
        else:
            assert out.aux_loss is None
        changed = tokens.clone()
        changed[:, 10] = (changed[:, 10] + 1) % cfg.vocab_size
        out2 = model(changed)
    torch.testing.assert_close(out2.logits[:, :10], out.logits[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(out2.logits[:, 10:], out.logits[:, 10:])


def test_forward_rejects_bad_tokens() -> None:
    model = Llama3(
        Llama3Config(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=16, ffn_dim=64, max_seq_len=8)
    )
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(1, 4))


def test_rope_is_relative() -> None:
    """q.k after RoPE depends only on the position offset."""
    rope = RotaryEmbedding(head_dim=16, max_seq_len=64, theta=10000.0)
    cos, sin = rope(64)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    qs = apply_rotary_emb(q.expand(1, 64, 1, 16), cos, sin)[0, :, 0]
    ks = apply_rotary_emb(k.expand(1, 64, 1, 16), cos, sin)[0, :, 0]
    torch.testing.assert_close(qs[5] @ ks[2], qs[40] @ ks[37])
    torch.testing.assert_close(qs.norm(dim=-1), q.norm().expand(64))


def test_moe_matches_per_token_reference() -> None:
    torch.manual_seed(0)
    model = Mixtral(MIXTRAL_TINY)
    init_weights(model, seed=3)
    moe = model.layers[0].feed_forward
    x = torch.randn(2, 5, MIXTRAL_TINY.dim)
    with torch.no_grad():
        out, _ = moe(x)
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(moe.gate(flat), dim=-1)
        expected = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            weights, experts = probs[t].topk(2)
            for w, e in zip(weights / weights.sum(), experts.tolist(), strict=True):
                ex = moe.experts
                hidden = F.silu(ex.w1[e] @ flat[t]) * (ex.w3[e] @ flat[t])
                expected[t] += w * (ex.w2[e] @ hidden)
    torch.testing.assert_close(out.reshape(-1, x.shape[-1]), expected, rtol=1e-5, atol=1e-6)


def test_aux_loss_is_top_k_for_uniform_router() -> None:
    model = Mixtral(MIXTRAL_TINY)
    init_weights(model, seed=0)
    with torch.no_grad():
        for layer in model.layers:
            layer.feed_forward.gate.weight.zero_()
        out = model(_tokens())
    torch.testing.assert_close(out.aux_loss, torch.tensor(float(MIXTRAL_TINY.top_k)))


@pytest.mark.parametrize("cfg", [LLAMA_TINY, MIXTRAL_TINY], ids=["llama3", "mixtral"])
def test_init_weights_depends_only_on_seed(cfg: Llama3Config | MixtralConfig) -> None:
    torch.manual_seed(123)
    a = build_model(cfg)
    init_weights(a, seed=7)
    torch.manual_seed(456)  # the global RNG must not matter
    with torch.device("meta"):
        b = build_model(cfg)
    b.to_empty(device="cpu")  # garbage weights and RoPE buffers until init
    init_weights(b, seed=7)
    c = build_model(cfg)
    init_weights(c, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa)), name
        else:
            assert not torch.equal(pa, pc), name
    for (name, ba), bb in zip(a.named_buffers(), b.buffers(), strict=True):
        assert torch.equal(ba, bb), name
    # Residual projections get std 0.02 / sqrt(2 * n_layers); the rest 0.02.
    assert a.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    expected = 0.02 / (2 * cfg.n_layers) ** 0.5
    assert a.layers[0].attention.wo.weight.std().item() == pytest.approx(expected, rel=0.1)


def test_init_weights_rejects_meta_and_bad_seed() -> None:
    with torch.device("meta"):
        model = build_model(LLAMA_TINY)
    with pytest.raises(ValueError, match="to_empty"):
        init_weights(model, seed=0)
    with pytest.raises(ValueError, match="seed"):
        init_weights(build_model(LLAMA_TINY), seed=-1)
