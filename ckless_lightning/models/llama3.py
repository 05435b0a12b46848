"""Llama 3 decoder (dense SwiGLU, grouped-query attention, RoPE), torchtitan style.

Build on the meta device, shard with ``parallelize_llama3``, ``to_empty`` and
then ``init_weights`` -- the constructor's own initialisation is only there so
that a model built on a real device is usable without that step.
"""

from __future__ import annotations

import torch
from torch import nn

from ckless_lightning.models.configs import Llama3Config
from ckless_lightning.models.layers import (
    Attention,
    CausalLMOutput,
    FeedForward,
    RMSNorm,
    RotaryEmbedding,
    check_tokens,
)

__all__ = ["Llama3", "Llama3Config", "TransformerBlock"]


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
