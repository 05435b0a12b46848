"""The model families' configs and FSDP2's settings, as data: no torch here.

``launch.py`` validates a whole job config before it imports torch (a bad value is
reported in about a second, before the fork server starts), so the dataclasses a
recipe's ``model._target_`` and the ``fsdp`` section name live here, apart from
the models (``llama3.py``, ``mixtral.py``) and their FSDP2 plans
(``parallelize.py``), which re-export them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "DTYPE_NAMES",
    "FSDPConfig",
    "Llama3Config",
    "MixtralConfig",
    "attention_num_params",
    "check_transformer_dims",
]

# Dtype names the ``fsdp`` section takes (torch.<name>).
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def check_transformer_dims(cfg: object) -> None:
    """Validate the fields both config families share; raise ``ValueError`` naming the field and the fix.

    ``cfg`` is a ``Llama3Config`` or ``MixtralConfig`` (anything with the same
    attention/FFN field names); its class name prefixes the messages.
    """
    owner = type(cfg).__name__
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}.{name}={value!r} must be a positive int.")
    for name in ("rope_theta", "norm_eps"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{owner}.{name}={value!r} must be a positive number.")
    dim, n_heads, n_kv_heads = cfg.dim, cfg.n_heads, cfg.n_kv_heads  # type: ignore[attr-defined]
    if dim % n_heads != 0:
        raise ValueError(
            f"{owner}.dim={dim} must be divisible by n_heads={n_heads}; pick dim as a multiple of n_heads."
        )
    if n_heads % n_kv_heads != 0:
        divisors = [d for d in range(1, n_heads + 1) if n_heads % d == 0]
        raise ValueError(
            f"{owner}.n_kv_heads={n_kv_heads} must divide n_heads={n_heads}; choose one of {divisors}."
        )
    if (dim // n_heads) % 2 != 0:
        raise ValueError(
            f"{owner}.dim={dim} gives an odd head dim {dim // n_heads}; rotary embeddings need an even "
            "head dim, so pick dim / n_heads even."
        )


def attention_num_params(dim: int, n_heads: int, n_kv_heads: int) -> int:
    """Exact parameter count of one ``Attention`` module (wq, wk, wv, wo; no biases)."""
    head_dim = dim // n_heads
    return 2 * dim * n_heads * head_dim + 2 * dim * n_kv_heads * head_dim


@dataclass
class _TransformerShape:
    """The fields and checks Llama 3 and Mixtral share (their configs' positional fields)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int

    def __post_init__(self) -> None:
        check_transformer_dims(self)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class Llama3Config(_TransformerShape):
    """Architecture of a Llama 3 model; the published sizes are e.g. 8B = (4096, 32, 32, 8, 128256, 14336)."""

    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192

    def num_params(self) -> int:
        """Exact parameter count, computed analytically (no model is built)."""
        block = attention_num_params(self.dim, self.n_heads, self.n_kv_heads) + 3 * self.dim * self.ffn_dim
        block += 2 * self.dim  # attention_norm, ffn_norm
        embeddings_and_head = 2 * self.vocab_size * self.dim  # untied
        return embeddings_and_head + self.n_layers * block + self.dim  # final norm


@dataclass
class MixtralConfig(_TransformerShape):
    """Architecture of a Mixtral model; 8x7B = (4096, 32, 32, 8, 32000, 14336) with 8 experts, top-2.

    ``router_aux_loss_coef`` is not used by the model; it is the weight the
    training loop gives ``CausalLMOutput.aux_loss``.
    """

    rope_theta: float = 1000000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 32768
    n_experts: int = 8
    top_k: int = 2
    router_aux_loss_coef: float = 0.02

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MixtralConfig.{name}={value!r} must be a positive int.")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"MixtralConfig.top_k={self.top_k} exceeds n_experts={self.n_experts}; "
                "set top_k <= n_experts."
            )
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
            raise ValueError(
                f"MixtralConfig.router_aux_loss_coef={coef!r} must be a number >= 0 (0 disables it)."
            )

    def num_params(self) -> int:
        """Exact parameter count (all experts, not just the active ones), computed analytically."""
        moe = self.dim * self.n_experts + self.n_experts * 3 * self.dim * self.ffn_dim  # gate + experts
        block = attention_num_params(self.dim, self.n_heads, self.n_kv_heads) + moe + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * block + self.dim


@dataclass
class FSDPConfig:
    """FSDP2 settings: compute (``param_dtype``) and gradient-reduction dtypes by name, and resharding.

    ``None`` dtypes keep the parameters' own dtype. ``reshard_after_forward``
    applies to the transformer blocks; the root keeps FSDP's root default (not
    resharded), since its parameters are needed first in backward.
    """

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPE_NAMES:
                raise ValueError(
                    f"FSDPConfig.{name}={value!r} is not a supported dtype name; use one of "
                    f"{sorted(DTYPE_NAMES)} or None."
                )
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"FSDPConfig.reshard_after_forward={self.reshard_after_forward!r} must be true or false."
            )

    def mp_policy(self) -> MixedPrecisionPolicy:
        """The ``MixedPrecisionPolicy`` these names describe."""
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        def dtype(name: str | None) -> torch.dtype | None:
            return getattr(torch, name) if name else None

        return MixedPrecisionPolicy(
            param_dtype=dtype(self.param_dtype), reduce_dtype=dtype(self.reduce_dtype)
        )
