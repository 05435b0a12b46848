"""Warm a fresh process's DTensor caches for its first step (a replaced rank, tiers 3-4): the
gradient clipping's norm and the optimizer step (:func:`warm_first_step`).

DTensor computes an operator's sharding (which placements its outputs get, whether inputs must be
redistributed) the first time a thread runs it on inputs of given shapes, strides, dtypes and
placements, and caches it per thread (torch 2.13: ``ShardingPropagator.propagate_op_sharding`` is a
``threading.local`` LRU cache, and the C++ dispatch fast path keeps its own per thread). A survivor
has the cache from its earlier steps; a replaced rank's process does not, and its first
``optimizer.step`` over a few hundred DTensors costs ~0.3 s instead of ~0.01 s while every survivor
waits for it in the step's next exchange (docs/benchmarks.md, "The first step after a recovery");
its first gradient clipping likewise (0.3 s against 0.01 s on an HSDP 2x2 mesh, where the
survivors wait for it in the norm's all-reduce).

:func:`warm_optimizer_step` runs that first step's sharding work ahead of time: a throwaway
optimizer of the same class, with the same per-group options, over throwaway DTensors whose local
tensors are on the meta device (no memory, no arithmetic) but which carry the real parameters'
mesh *object*, placements, global shapes and strides, each with a gradient of the same spec, is
stepped once and dropped. The entries it leaves in the cache are those the real step looks up.

Contract:

- Call it on the thread that runs the training step (the cache is per thread: a warm-up on another
  thread warms nothing the step uses), after the generation's mesh and the optimizers exist.
- It changes no bit of the computation: it never reads or writes the real parameters, gradients,
  optimizer state, hyper-parameters or RNG; the real step computes exactly what it would have.
- The cached output specs carry the mesh the throwaway tensors were built on, which is the real
  parameters' own ``device_mesh`` (never a copy or another world's mesh that only compares equal).
- It makes no collective call: only optimizers whose step is elementwise on each parameter
  (:data:`WARMABLE`), and only parameters placed ``Shard``/``Replicate`` (an elementwise operator
  on alike placements needs no redistribution).
- The gradient clipping's norm (:func:`warm_clip_grad_norm`, what Lightning's
  ``gradient_clip_algorithm="norm"`` runs: ``torch.nn.utils.clip_grad_norm_`` over each optimizer's
  parameters) is warmed the same way, on throwaway meta gradients: its per-tensor norms (one
  ``_foreach_norm`` over DTensors), their stack, the total, the coefficient and the scaling of
  every gradient, the foreach path pinned as the real gradients get it. The total's reduction across ranks
  (the per-tensor norms of sharded gradients are ``Partial``) is a functional collective, which on
  meta tensors runs torch's meta kernel (``_c10d_functional``'s ``Meta`` registrations): nothing
  reaches a process group, so a warm-up on one rank alone leaves the ranks' collectives in step.
- It is best effort: what it cannot warm (another optimizer class, ``fused`` or ``capturable``
  groups, whose kernels refuse meta tensors, a ``Partial`` placement) it skips and says why in the
  result; an error in the throwaway step is reported the same way, never raised.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ckless_lightning.replication._torch_compat import clip_grad_norm_as_torch, resolved_foreach

__all__ = [
    "WARMABLE",
    "WarmUp",
    "clip_norm_of",
    "mark_process_warm",
    "process_is_warm",
    "warm_clip_grad_norm",
    "warm_first_step",
    "warm_optimizer_step",
]

# Optimizers whose step is elementwise per parameter (torch 2.13): no reduction across a tensor,
# so no collective over DTensors placed alike.
WARMABLE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

_process_warm = False  # this process ran an optimizer step over its DTensors, or a warm-up


def process_is_warm() -> bool:
    """Whether this process already stepped an optimizer (a survivor) or warmed up."""
    return _process_warm


def mark_process_warm() -> None:
    """Record that this process stepped an optimizer: its caches hold the step's entries."""
    global _process_warm
    _process_warm = True


@dataclass(frozen=True)
class WarmUp:
    """What :func:`warm_optimizer_step` did: ``params`` throwaway parameters stepped in ``seconds``;
    ``skipped``: why some or all were not (empty: every optimizer was warmed); ``clipped``: throwaway
    gradients whose norm was clipped (:func:`warm_clip_grad_norm`)."""

    params: int
    seconds: float
    skipped: tuple[str, ...] = ()
    clipped: int = 0


def _throwaway(param: torch.Tensor) -> nn.Parameter | None:
    """A parameter of ``param``'s spec on meta, with a gradient of the same spec; None if not a DTensor
    placed Shard/Replicate."""
    if not isinstance(param, DTensor) or not all(isinstance(p, (Shard, Replicate)) for p in param.placements):
        return None

    def like() -> DTensor:
        local = torch.empty_like(param.to_local(), device="meta")
        mesh, placements = param.device_mesh, param.placements
        return DTensor.from_local(  # no collective: run_check=False, shape and stride given
            local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    throwaway = nn.Parameter(like(), requires_grad=param.requires_grad)
    if param.requires_grad:
        throwaway.grad = like()
    return throwaway


def _groups(optimizer: torch.optim.Optimizer) -> tuple[list[dict[str, Any]], str | None]:
    """The throwaway's param groups (the real ones' options, foreach resolved as the real step
    resolves it), or why the optimizer cannot be warmed."""
    if type(optimizer) not in WARMABLE:
        return [], f"{type(optimizer).__name__} is not known to step without collectives"
    groups = []
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            return [], f"{type(optimizer).__name__} group with fused/capturable (kernels refuse meta)"
        params = [_throwaway(p) for p in group["params"]]
        if any(p is None for p in params):
            return [], f"{type(optimizer).__name__} has a parameter that is not a Shard/Replicate DTensor"
        options = {k: v for k, v in group.items() if k != "params"}
        if options.get("foreach") is None:  # decided per step from the real params' devices
            options["foreach"] = resolved_foreach(group["params"], options)
        groups.append({**options, "params": params})
    return groups, None


def warm_optimizer_step(optimizers: Sequence[torch.optim.Optimizer]) -> WarmUp:
    """Step a throwaway copy of each of ``optimizers`` once (see the module's contract)."""
    start = time.perf_counter()
    skipped: list[str] = []
    count = 0
    for optimizer in optimizers:
        groups, why = _groups(optimizer)
        if why is not None:
            skipped.append(why)
            continue
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        try:
            throwaway = cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
            throwaway.step()
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
            skipped.append(f"{cls.__name__}: the throwaway step failed ({type(err).__name__}: {err})")
            continue
        count += sum(len(g["params"]) for g in groups)
    if count:
        mark_process_warm()
    return WarmUp(params=count, seconds=time.perf_counter() - start, skipped=tuple(skipped))


def clip_norm_of(module: Any) -> float | None:
    """The norm Lightning clips ``module``'s gradients to before each step (its Trainer's
    ``gradient_clip_val`` with ``gradient_clip_algorithm="norm"``), None when it clips none or by value,
    or is not attached to a Trainer."""
    try:
        trainer = module.trainer
    except RuntimeError:  # Lightning: "... is not attached to a `Trainer`"
        return None
    value = getattr(trainer, "gradient_clip_val", None)
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    if (
        not value or str(getattr(algorithm, "value", algorithm) or "norm") != "norm"
    ):  # None: Lightning's "norm"
        return None
    return float(value)


def warm_clip_grad_norm(optimizers: Sequence[torch.optim.Optimizer], max_norm: float) -> WarmUp:
    """Clip throwaway gradients of each optimizer's parameters to ``max_norm`` (the 2-norm), as
    Lightning clips the real ones (see the module's contract); ``clipped`` counts them."""
    start = time.perf_counter()
    skipped: list[str] = []
    count = 0
    for optimizer in optimizers:
        # Lightning's Precision.main_params: every group's parameters, in order; those with a gradient.
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        throwaways = [_throwaway(p) for p in params]
        if not params or any(t is None for t in throwaways):
            skipped.append(
                f"clipping {type(optimizer).__name__}: a parameter is not a Shard/Replicate DTensor"
            )
            continue
        try:
            grads = [t.grad for t in throwaways if t is not None and t.grad is not None]
            clip_grad_norm_as_torch(params, grads, max_norm)
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
            skipped.append(f"clipping {type(optimizer).__name__}: failed ({type(err).__name__}: {err})")
            continue
        count += len(throwaways)
    return WarmUp(params=0, seconds=time.perf_counter() - start, skipped=tuple(skipped), clipped=count)


def warm_first_step(optimizers: Sequence[torch.optim.Optimizer], clip_norm: float | None) -> WarmUp:
    """Warm the first step's gradient clipping (``clip_norm``: its max norm, None: no clipping) and
    its optimizer step; one :class:`WarmUp` for both."""
    start = time.perf_counter()
    clip = warm_clip_grad_norm(optimizers, clip_norm) if clip_norm is not None else WarmUp(0, 0.0)
    step = warm_optimizer_step(optimizers)
    return WarmUp(
        params=step.params,
        seconds=time.perf_counter() - start,
        skipped=clip.skipped + step.skipped,
        clipped=clip.clipped,
    )
