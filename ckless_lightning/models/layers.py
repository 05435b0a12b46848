"""Building blocks shared by the Llama 3 and Mixtral families.

Plain ``torch.nn`` modules in the torchtitan style: no biases, no fused kernels,
no parallelism inside the modules (the FSDP2 plan lives in ``parallelize.py``).
Every module can be built on the meta device; RoPE tables are non-persistent
buffers that ``init_weights`` recomputes after ``to_empty``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Attention",
    "CausalLMOutput",
    "FeedForward",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary_emb",
    "check_tokens",
]


class CausalLMOutput(NamedTuple):
    """What every model's ``forward`` returns.

    ``logits`` is ``[B, T, vocab]`` in the compute dtype; ``aux_loss`` is the
    unscaled router load-balancing loss of MoE models (a scalar) and ``None``
    for dense models. The caller multiplies it by ``router_aux_loss_coef``.
    """

    logits: torch.Tensor
    aux_loss: torch.Tensor | None


def check_tokens(tokens: torch.Tensor, max_seq_len: int) -> None:
    """Raise ``ValueError`` unless ``tokens`` is an integer ``[B, T]`` batch with ``T <= max_seq_len``."""
    if tokens.ndim != 2 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
        raise ValueError(
            f"tokens must be an integer tensor of shape [batch, seq_len], got {tuple(tokens.shape)} "
            f"{tokens.dtype}."
        )
    if tokens.shape[1] > max_seq_len:
        raise ValueError(
            f"seq_len={tokens.shape[1]} exceeds the config's max_seq_len={max_seq_len}; "
            "raise max_seq_len or shorten the batch."
        )


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no bias, no mean subtraction), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE ``cos``/``sin`` tables of shape ``[max_seq_len, head_dim // 2]``.

    The tables are non-persistent float32 buffers: they are not in the state
    dict, hold garbage after ``to_empty``, and ``reset_buffers()`` (called by
    ``init_weights``) recomputes them on whatever device they live on.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        assert head_dim % 2 == 0, "head_dim must be even (checked by the config)"
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the tables in float64 on CPU, then copy into the buffers (a no-op on meta)."""
        if self.cos.is_meta:
            return
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device="cpu") / self.head_dim
        positions = torch.arange(self.max_seq_len, dtype=torch.float64, device="cpu")
        angles = torch.outer(positions, 1.0 / self.theta**exponents)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` for positions ``0 .. seq_len - 1``."""
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x: [B, T, H, head_dim]`` (Meta's interleaved layout), in float32.

    ``cos``/``sin`` are ``[T, head_dim // 2]``; they may arrive in the FSDP
    compute dtype (FSDP2 casts floating forward inputs), as in HF's bf16 path.
    """
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c = cos.float()[None, :, None, :]
    s = sin.float()[None, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE on queries and keys.

    ``n_kv_heads`` key/value heads are shared by ``n_heads // n_kv_heads``
    query heads each; attention runs through
    ``F.scaled_dot_product_attention(..., is_causal=True)``.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        assert dim % n_heads == 0 and n_heads % n_kv_heads == 0, "checked by the config"
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        q = apply_rotary_emb(q, cos, sin)
        k = apply_rotary_emb(k, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        # SDPA wants [B, H, T, head_dim].
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
