"""Tier 4 without a second copy: a survivor's live shards become the next generation's parameters.

Every generation builds a new LightningModule (new process groups, new DeviceMesh,
new FSDP2 state), but a survivor's state is already in memory: the old module's
local shards and its optimizer's state. Initializing the new module and copying
the old state into it would cost the initialization (minutes per rank at 70B)
and hold the state twice at peak. Instead the new module, still on the meta
device after ``configure_model``, gets DTensors over the old local tensors on
the new mesh as its parameters (``load_state_dict(assign=True)``, which FSDP2
supports: its post-load hook re-derives its sharded storage from them), and the
new optimizer's state is the old state tensors, re-wrapped the same way.
Nothing is copied, except where FSDP2 pads an uneven shard (it copies that one
tensor into a padded buffer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ckless_lightning.replication.state import LiveParam

__all__ = ["adopt_optimizer_state", "adopt_parameters", "allocate_buffers"]


def _like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``template``'s kind: a DTensor on its mesh with its placements, or as is."""
    if not isinstance(template, DTensor):
        return local
    return DTensor.from_local(
        local,
        template.device_mesh,
        template.placements,
        run_check=False,
        shape=template.shape,
        stride=template.stride(),
    )


def _fits(template: torch.Tensor, local: torch.Tensor) -> bool:
    expected = template.to_local() if isinstance(template, DTensor) else template
    device_type = template.device_mesh.device_type if isinstance(template, DTensor) else None
    return (
        tuple(expected.shape) == tuple(local.shape)
        and expected.dtype == local.dtype
        and local.is_contiguous()
        and (device_type is None or local.device.type == device_type)
    )


def adopt_parameters(module: nn.Module, live: Sequence[LiveParam]) -> bool:
    """Make ``module``'s parameters (on meta, sharded like ``live``) use ``live``'s local tensors.

    Returns False, changing nothing, when the live state does not describe this module
    (other names, local shapes or dtypes); the caller then allocates instead.
    """
    by_name = {p.name: p for p in live}
    params = dict(module.named_parameters())
    if set(params) != set(by_name) or not all(_fits(params[n], by_name[n].local) for n in params):
        return False
    adopted = {name: _like(param, by_name[name].local) for name, param in params.items()}
    result = module.load_state_dict(adopted, strict=False, assign=True)
    assert not result.unexpected_keys, result.unexpected_keys
    missing_params = set(result.missing_keys) & set(params)
    assert not missing_params, f"parameters not adopted: {sorted(missing_params)}"
    return True


def adopt_optimizer_state(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], live: Sequence[LiveParam]
) -> None:
    """Give each optimizer the live state of the parameters it steps (after :func:`adopt_parameters`
    and after the optimizers were created)."""
    by_name = {p.name: p for p in live}
    names = {id(param): name for name, param in module.named_parameters()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = by_name[names[id(param)]].state
                if state:
                    optimizer.state[param] = {
                        key: _like(param, value) if was_dtensor else value
                        for key, (value, was_dtensor) in state.items()
                    }


def allocate_buffers(module: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialized) every buffer still on meta; parameters are left as they are."""
    for sub in module.modules():
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(sub, name, torch.empty_like(buffer, device=device))
