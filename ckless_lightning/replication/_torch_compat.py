"""The one place that uses private torch APIs outside the gloo/NCCL fail-fast path (torch 2.13).

Why (:func:`init_optimizer_state`): an optimizer creates its state lazily in its first ``step``; a rank that
receives its optimizer state from a peer (tier 4) needs those tensors allocated
before the transfer writes into them. ``torch.distributed.checkpoint`` has a
helper that does exactly that (a step with zero gradients and lr 0, undone
afterwards) and uses it itself before loading optimizer state. Re-check it when
upgrading torch. Why :func:`resolved_foreach` and :func:`clip_grad_norm_as_torch`: see their
docstrings.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clip_grad_norm_as_torch", "init_optimizer_state", "resolved_foreach"]


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


def clip_grad_norm_as_torch(params: list[torch.Tensor], grads: list[torch.Tensor], max_norm: float) -> None:
    """Run on ``grads`` the operators ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` runs on
    ``params``' gradients (the 2-norm; torch 2.13's ``_get_total_norm`` and ``_clip_grads_with_norm_``,
    in their order), taking the foreach path exactly where the call on ``params`` would.

    Why private: ``clip_grad_norm_`` decides foreach from the tensors' types and device
    (``torch.utils._foreach_utils._has_foreach_support``: DTensor is a foreach type on cpu and
    cuda); the first-step warm-up (:mod:`~ckless_lightning.replication.warmup`) clips throwaway meta
    gradients, for which it would decide otherwise (and ``foreach=True`` refuses meta), so it pins
    the decision the real gradients get. Re-check against ``torch/nn/utils/clip_grad.py`` when
    upgrading torch (tests/test_warmup.py's first clipping after a warm-up tells).
    """
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

    if not grads:
        return
    foreach = _has_foreach_support(params, params[0].device)
    groups = _group_tensors_by_device_and_dtype([grads])  # type: ignore[list-item]
    first_device = grads[0].device
    with torch.no_grad():
        norms: list[torch.Tensor] = []
        for _, ([group], _) in groups.items():  # type: ignore[misc]
            if foreach:
                norms.extend(torch._foreach_norm(group, 2.0))
            else:
                norms.extend(torch.linalg.vector_norm(g, 2.0) for g in group)
        total = torch.linalg.vector_norm(torch.stack([norm.to(first_device) for norm in norms]), 2.0)
        clamped = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for (device, _), ([group], _) in groups.items():  # type: ignore[misc]
            if foreach:
                torch._foreach_mul_(group, clamped.to(device))
            else:
                on_device = clamped.to(device)
                for g in group:
                    g.mul_(on_device)
