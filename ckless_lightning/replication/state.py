"""A rank's training state as a flat list of local tensors, in an order every rank agrees on.

Parameters (each FSDP2 DTensor's local shard) in name order, each followed by
its optimizer state tensors in key order. Two ranks that hold the same shard
(HSDP replicas; a rank and its replacement) get lists of the same shapes and
dtypes, which is what the bucketed transfer needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ckless_lightning.replication._torch_compat import init_optimizer_state

__all__ = [
    "RNG_KEY",
    "LiveParam",
    "LiveStateListing",
    "allocate_optimizer_state",
    "copy_into",
    "flat_tensors",
    "live_params",
    "local_state_tensors",
    "param_groups_of",
    "params_are_optimized",
    "reshard_all",
    "rng_state",
    "set_param_groups",
    "set_rng_state",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def reshard_all(module: nn.Module) -> None:
    """Put every FSDP2 module back in its sharded state (a fault may have left some unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def params_are_optimized(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether ``module``'s registered parameters are exactly those its optimizers step, each with
    its state (after the first step): then :func:`local_state_tensors` describes the live state."""
    optimized = {
        id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]
    }
    registered = {id(p) for p in module.parameters()}
    with_state = {id(p) for optimizer in optimizers for p in optimizer.state}
    return registered == optimized and (not with_state or with_state == registered)


@dataclass(frozen=True)
class LiveParam:
    """One parameter's local shard and its optimizer state (local tensors; ``True`` where the
    optimizer held the value as a DTensor, like its parameter)."""

    name: str
    local: torch.Tensor
    state: dict[str, tuple[torch.Tensor, bool]]


def live_params(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, allocate: bool = False
) -> list[LiveParam]:
    """Every parameter's local shard and optimizer state, by name (the order of
    :func:`local_state_tensors`). Views of the live storage, not copies.

    With ``allocate``, optimizer state that does not exist yet is created first (a rank about to
    receive it).
    """
    if allocate:
        for optimizer in optimizers:
            allocate_optimizer_state(optimizer)
    state: dict[int, dict[str, Any]] = {}
    for optimizer in optimizers:
        for param, values in optimizer.state.items():
            state[id(param)] = values
    params = []
    for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        values = state.get(id(param), {})
        params.append(
            LiveParam(
                name,
                _local(param.data),
                {
                    key: (_local(values[key]), isinstance(values[key], DTensor))
                    for key in sorted(values)
                    if isinstance(values[key], torch.Tensor)
                },
            )
        )
    return params


def allocate_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s per-parameter state where it does not exist yet, for a transfer to fill.

    Adam and AdamW: the tensors their first step creates (``Adam._init_group``, torch 2.13),
    allocated directly. Any other optimizer: a step with zero gradients and lr 0, undone (DCP's
    helper). The step costs ~0.5 s in a fresh process over DTensors (cold sharding-propagation
    caches), on the recovery's critical path: every survivor waits for the replaced rank.
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        init_optimizer_state(optimizer)
        return
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            if on_device:
                dtype = torch.float32 if group.get("fused") else scalar
                state["step"] = torch.zeros((), dtype=dtype, device=param.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=scalar)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def flat_tensors(params: Sequence[LiveParam]) -> list[torch.Tensor]:
    """Each parameter's local shard followed by its optimizer state tensors in key order."""
    tensors: list[torch.Tensor] = []
    for param in params:
        tensors.append(param.local)
        tensors.extend(value for value, _ in param.state.values())
    for t in tensors:
        assert t.is_contiguous(), "local state tensors must be contiguous"
    return tensors


class LiveStateListing:
    """A module's and its optimizers' local state (:func:`live_params`, :func:`flat_tensors`),
    listed again only when the parameters or the optimizer state change.

    Listing goes through every DTensor's ``to_local`` (an autograd op each: milliseconds per
    step for a few hundred tensors); the views stay valid across steps, as FSDP2 keeps its sharded
    storage and the optimizer updates its state in place. Keyed by the module's and optimizers'
    identities and the optimizers' state counts (the first step creates the state).
    """

    def __init__(self) -> None:
        self.params: list[LiveParam] | None = None
        self._tensors: list[torch.Tensor] = []
        self._key: tuple[int, ...] = ()

    def tensors(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
        """:func:`local_state_tensors` of ``module`` and ``optimizers`` (the same list object while
        nothing changed)."""
        key = self.key(module, optimizers)
        if key != self._key:
            self.params = live_params(module, optimizers)
            self._tensors = flat_tensors(self.params)
            self._key = key
        return self._tensors

    def current(
        self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
    ) -> list[LiveParam] | None:
        """The params as last listed, if that listing still describes ``module`` and ``optimizers``."""
        return self.params if self.params is not None and self.key(module, optimizers) == self._key else None

    @staticmethod
    def key(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[int, ...]:
        return (id(module), *(len(o.state) for o in optimizers), *(id(o) for o in optimizers))


def local_state_tensors(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, allocate: bool = False
) -> list[torch.Tensor]:
    """Local parameter shards and their optimizer state, in a fixed order.

    With ``allocate``, optimizer state that does not exist yet is created first
    (a rank about to receive it). Tensors are returned as they are (views of the
    live storage), not copied; all must be contiguous.
    """
    return flat_tensors(live_params(module, optimizers, allocate=allocate))


def copy_into(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """Copy ``src`` into ``dst`` tensor by tensor (same shapes and dtypes), without autograd."""
    if len(dst) != len(src):
        raise ValueError(f"state has {len(src)} tensors, the model expects {len(dst)}")
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            if d.shape != s.shape or d.dtype != s.dtype:
                raise ValueError(f"state tensor {tuple(s.shape)}/{s.dtype} != {tuple(d.shape)}/{d.dtype}")
            same = d.device == s.device and d.data_ptr() == s.data_ptr() and d.stride() == s.stride()
            if d.numel() and same:
                continue  # the same storage (a survivor's adopted live state): nothing to move
            d.copy_(s)


def param_groups_of(optimizers: Sequence[torch.optim.Optimizer]) -> list[list[dict[str, Any]]]:
    """Each optimizer's hyper-parameters (lr, betas, ...) per group, without the parameters."""
    return [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in optimizers]


def set_param_groups(optimizers: Sequence[torch.optim.Optimizer], groups: list[list[dict[str, Any]]]) -> None:
    for optimizer, saved in zip(optimizers, groups, strict=True):
        for group, values in zip(optimizer.param_groups, saved, strict=True):
            group.update(values)


# The key of a loop snapshot (tier 4) that holds the rank's rng_state().
RNG_KEY = "ckless_rng"


def rng_state() -> dict[str, Any]:
    """This process's RNG state (CPU, and CUDA where present), stored with each loop snapshot.

    As bytes: pickling the state tensors costs ~50x more, on every step.
    """
    return {
        "cpu": _bytes(torch.get_rng_state()),
        "cuda": [_bytes(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None,
    }


def _bytes(state: torch.Tensor) -> bytes:
    return state.numpy().tobytes()


def _tensor(state: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any] | None) -> None:
    if state is None:
        return
    torch.set_rng_state(_tensor(state["cpu"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(s) for s in state["cuda"]])
