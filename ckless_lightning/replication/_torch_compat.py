"""The one place that uses private torch APIs outside the gloo/NCCL fail-fast path (torch 2.13).

Why (:func:`init_optimizer_state`): an optimizer creates its state lazily in its first ``step``; a rank that
receives its optimizer state from a peer (tier 4) needs those tensors allocated
before the transfer writes into them. ``torch.distributed.checkpoint`` has a
helper that does exactly that (a step with zero gradients and lr 0, undone
afterwards) and uses it itself before loading optimizer state. Re-check it when
upgrading torch. Why :func:`resolved_foreach`: see its docstring.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["init_optimizer_state", "resolved_foreach"]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate ``optimizer``'s per-parameter state (no-op where it exists already)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def resolved_foreach(params: list[torch.Tensor], options: dict[str, Any]) -> bool:
    """Whether Adam/AdamW/SGD's step takes its foreach path for a group with ``foreach=None``.

    Why private: the optimizers decide it in each step from the parameters' types and devices
    (``torch.optim.optimizer._default_to_fused_or_foreach``, torch 2.13); the first-step warm-up
    (:mod:`~ckless_lightning.replication.warmup`) steps meta tensors, which would decide otherwise,
    so it pins the decision the real parameters get. Adam also refuses foreach with a tensor lr
    unless capturable (``adam.py``'s ``adam``), as here.
    """
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if options.get("fused") is not None:
        return False
    _, foreach = _default_to_fused_or_foreach(params, bool(options.get("differentiable")), use_fused=False)
    if foreach and isinstance(options.get("lr"), torch.Tensor) and not options.get("capturable"):
        return False
    return foreach
