"""The one place that uses private torch APIs outside the gloo/NCCL fail-fast path (torch 2.13).

Why: an optimizer creates its state lazily in its first ``step``; a rank that
receives its optimizer state from a peer (tier 4) needs those tensors allocated
before the transfer writes into them. ``torch.distributed.checkpoint`` has a
helper that does exactly that (a step with zero gradients and lr 0, undone
afterwards) and uses it itself before loading optimizer state. Re-check it when
upgrading torch.
"""

from __future__ import annotations

import torch

__all__ = ["init_optimizer_state"]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate ``optimizer``'s per-parameter state (no-op where it exists already)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)
