"""Llama 3 decoder (dense SwiGLU, grouped-query attention, RoPE), torchtitan style.

Build on the meta device, shard with ``parallelize_llama3``, ``to_empty`` and
then ``init_weights`` -- the constructor's own initialisation is only there so
that a model built on a real device is usable without that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ckless_lightning.models.layers import (
    Attention,
    CausalLMOutput,
    FeedForward,
    RMSNorm,
    RotaryEmbedding,
    attention_num_params,
    check_tokens,
    check_transformer_dims,
)

__all__ = ["Llama3", "Llama3Config", "TransformerBlock"]


@dataclass
class Llama3Config:
    """Architecture of a Llama 3 model; the published sizes are e.g. 8B = (4096, 32, 32, 8, 128256, 14336)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192

    def __post_init__(self) -> None:
        check_transformer_dims(self)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Exact parameter count, computed analytically (no model is built)."""
        block = attention_num_params(self.dim, self.n_heads, self.n_kv_heads) + 3 * self.dim * self.ffn_dim
        block += 2 * self.dim  # attention_norm, ffn_norm
        embeddings_and_head = 2 * self.vocab_size * self.dim  # untied
        return embeddings_and_head + self.n_layers * block + self.dim  # final norm


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``. The FSDP2 unit."""

    def __init__(self, cfg: Llama3Config) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama3(nn.Module):
    """Llama 3 causal LM: ``forward(tokens[B, T]) -> CausalLMOutput(logits[B, T, vocab], None)``."""

    def __init__(self, cfg: Llama3Config) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> CausalLMOutput:
        check_tokens(tokens, self.config.max_seq_len)
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(tokens.shape[1])
        for layer in self.layers:
            h = layer(h, cos, sin)
        return CausalLMOutput(logits=self.output(self.norm(h)), aux_loss=None)
