"""Mixtral decoder: Llama-style attention plus a sparse top-k mixture-of-experts MLP.

Routing follows HF's ``MixtralSparseMoeBlock``: softmax over all experts,
keep the top ``top_k``, renormalise those weights to sum to one. The experts'
SwiGLU weights are stacked into three ``[n_experts, ...]`` parameters on one
``Experts`` module, so FSDP2 shards them like any other parameter. The expert
loop is deterministic (no atomics): every token is added once per expert, in
expert order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ckless_lightning.models.configs import MixtralConfig
from ckless_lightning.models.layers import (
    Attention,
    CausalLMOutput,
    RMSNorm,
    RotaryEmbedding,
    check_tokens,
)

__all__ = ["Experts", "Mixtral", "MixtralBlock", "MixtralConfig", "MoE"]


class Experts(nn.Module):
    """``n_experts`` SwiGLU MLPs as batched weights: ``w1, w3: [E, ffn, dim]``, ``w2: [E, dim, ffn]``."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default distribution per expert, so a model built on a real device is usable."""
        for w in (self.w1, self.w3, self.w2):
            bound = 1.0 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Mix expert outputs: ``x: [N, dim]``, ``top_idx``/``top_w: [N, k]`` -> ``[N, dim]``."""
        out = torch.zeros_like(x)
        # unbind once: its backward is a single stack, where indexing per expert
        # would materialise a full-size zero gradient for every expert.
        w1s, w3s, w2s = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        for e in range(self.n_experts):
            token_idx, slot = torch.where(top_idx == e)
            if token_idx.numel() == 0:
                continue
            xe = x.index_select(0, token_idx)
            ye = F.linear(F.silu(F.linear(xe, w1s[e])) * F.linear(xe, w3s[e]), w2s[e])
            out.index_add_(0, token_idx, ye * top_w[token_idx, slot, None].to(ye.dtype))
        return out


class MoE(nn.Module):
    """Top-k routed SwiGLU experts; ``forward`` returns ``(out, load_balancing_loss)``."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        assert 0 < top_k <= n_experts, "checked by the config"
        self.n_experts = n_experts
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(flat).float(), dim=-1)  # [N, E], float32 routing
        top_w, top_idx = probs.topk(self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = self.experts(flat, top_idx, top_w)
        return out.view_as(x), self.load_balancing_loss(probs, top_idx)

    def load_balancing_loss(self, probs: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
        """Switch/Mixtral loss ``E * sum_e f_e * P_e`` (HF convention: ``f`` sums to ``top_k``).

        ``f_e`` is the fraction of tokens whose top-k includes expert ``e`` (no
        gradient), ``P_e`` the mean router probability of ``e``. Perfectly
        balanced routing gives ``top_k``.
        """
        routed = F.one_hot(top_idx, self.n_experts).to(probs.dtype)  # [N, k, E]
        fraction = routed.mean(dim=0).sum(dim=0)  # [E]
        return self.n_experts * (fraction * probs.mean(dim=0)).sum()


class MixtralBlock(nn.Module):
    """Pre-norm block with a sparse MoE MLP; returns ``(out, aux_loss)``. The FSDP2 unit."""

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg.dim, cfg.ffn_dim, cfg.n_experts, cfg.top_k)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        moe_out, aux_loss = self.feed_forward(self.ffn_norm(h))
        return h + moe_out, aux_loss


class Mixtral(nn.Module):
    """Mixtral causal LM: ``forward(tokens[B, T]) -> CausalLMOutput(logits, aux_loss)``.

    ``aux_loss`` is the per-layer load-balancing loss averaged over layers,
    unscaled (multiply by ``config.router_aux_loss_coef``).
    """

    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(MixtralBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> CausalLMOutput:
        check_tokens(tokens, self.config.max_seq_len)
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(tokens.shape[1])
        aux_losses = []
        for layer in self.layers:
            h, aux_loss = layer(h, cos, sin)
            aux_losses.append(aux_loss)
        logits = self.output(self.norm(h))
        return CausalLMOutput(logits=logits, aux_loss=torch.stack(aux_losses).mean())
