"""Inject planned faults from inside a rank, at an exact optimizer step and phase.

A fault of optimizer step N (1-based) fires while the rank runs step N, that is
while ``trainer.global_step == N - 1``; with gradient accumulation, on the
step's last micro-batch (``(batch_idx + 1) % accumulate_grad_batches == 0``, or
the epoch's last batch). Phases map to Lightning 2.6 automatic optimization as
follows (order checked in ``loops/optimization/automatic.py`` and
``plugins/precision/precision.py``; the closure that runs forward and backward
is called by ``optimizer.step`` itself):

==============  ===============================================  ====================================
phase           where it fires                                   what has run on this rank
==============  ===============================================  ====================================
data            ``on_train_batch_start``                         batch fetched; no forward yet
forward         a global forward pre-hook, put on in             ``training_step`` entered; no
                ``on_train_batch_start`` (the first forward)     module's forward yet
backward        ``loss.register_hook``, put on in                backward started; no parameter
                ``on_before_backward``                           gradient yet
grad_reduction  ``on_after_backward``                            backward done (FSDP2 reduce-scatter);
                                                                 clipping's all-reduce, update not yet
commit          ``Optimizer.register_step_pre_hook``, put on     clipping and (tier 3+) the commit
                in ``on_train_start``                            vote done; update not yet
optimizer       ``Optimizer.register_step_post_hook``, put on    this rank's parameters updated;
                in ``on_train_start``                            scheduler, ``global_step``,
                                                                 checkpoint not yet
recovery        :meth:`FaultInjectionCallback.on_recovery`,      left the failed generation, not yet
                called by the in-process recovery loop           joined the next
comm_init       :meth:`FaultInjectionCallback.on_comm_init`,     joined the next generation; its
                called as the strategy starts forming groups     process groups not formed yet
transfer        :meth:`FaultInjectionCallback.on_transfer`,      tier 4: joined; the state transfer
                called as tier 4's transfer starts               (a collective) is starting
==============  ===============================================  ====================================

The real optimizer's step hooks fire after the vote because
:class:`~ckless_lightning.training.strategy.CheckpointlessStrategy` runs the closure
(forward, backward, clipping), then the vote, then ``optimizer.step()``.

Injection, after :func:`~ckless_lightning.runtime.faults.claim_fault` won and
``on_inject(spec)`` returned: ``kill`` SIGKILLs the process; ``hang`` SIGSTOPs
it (the agent kills a stopped process at once); ``stall`` sleeps forever in
this callback (the process runs: the agent's hang detection kills it); ``exception`` raises
:class:`InjectedFault`; ``node_loss`` SIGKILLs the node's agent (its other
ranks die with it through PR_SET_PDEATHSIG), then this process; ``bitflip`` flips one bit of
a parameter's local shard (:func:`flip_bit`) and training goes on; ``corrupt_copy`` flips a byte of
the loop state in the newest copy the rank holds of its ward (:func:`corrupt_held_loop`, tier 4).

The callback keeps no training state: whether a fault has fired lives in the
marker files of ``marker_dir``, so a restarted rank skips it and the callback
needs no ``state_dict``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from ckless_lightning.replication import SnapshotCopies
from ckless_lightning.runtime.faults import FaultSpec, claim_fault
from ckless_lightning.training.steps import is_step_end

__all__ = ["FaultInjectionCallback", "InjectedFault", "corrupt_held_loop", "flip_bit"]

# A bitflip flips this bit of the first byte of the parameter's local shard: a low mantissa bit of
# float32, the top mantissa bit of bfloat16; never an exponent bit (no inf or NaN that would
# announce itself).
_FLIP_MASK = 0x40


def flip_bit(module: torch.nn.Module, name: str | None) -> str:
    """Flip one bit of ``module``'s parameter ``name`` (None: the first by name), in this rank's
    local shard, in place; returns the parameter's name. ValueError names the parameters."""
    params = dict(module.named_parameters())
    name = name if name is not None else min(params)
    if name not in params:
        some = ", ".join(sorted(params)[:8])
        raise ValueError(f"fault.tensor={name!r} is not a parameter of the model; some are: {some}, ...")
    data = params[name].data
    local = data.to_local() if hasattr(data, "to_local") else data
    with torch.no_grad():
        local.reshape(-1).view(torch.uint8)[:1].bitwise_xor_(_FLIP_MASK)
    return name


def corrupt_held_loop(snapshots: SnapshotCopies) -> int:
    """Flip every bit of one byte in the middle of the loop state of the newest complete copy that
    ``snapshots`` holds of its ward, in host memory (the copy has arrived: no transfer checksum
    sees it); returns that copy's step. RuntimeError when no complete copy is held."""
    held = [s for s in snapshots.held if s.complete]
    if not held:
        raise RuntimeError(f"rank {snapshots.rank} holds no complete copy of its ward to corrupt")
    copy = max(held, key=lambda s: s.step)
    length = len(copy.loop_bytes())
    copy.loop[8 + length // 2] ^= 0xFF  # after the 8-byte length header
    return copy.step


class InjectedFault(RuntimeError):
    """The exception of an ``exception`` fault; ``spec`` is the fault that raised it."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        super().__init__(
            f"injected fault #{spec.index}: exception on rank {spec.rank} "
            f"at optimizer step {spec.step}, phase {spec.phase}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.spec,))


class FaultInjectionCallback(pl.Callback):
    """Fires this rank's ``injected_by=inside`` faults of ``specs``, each at most once per ``marker_dir``.

    Args:
        specs: the job's faults (``JobConfig.fault_specs()``); other ranks' faults are ignored.
        rank: the global rank this process plays.
        marker_dir: where fired faults are recorded; shared by every rank and restart of the job.
        on_inject: called with the spec just before injecting; it must make its record durable
            (write and flush) before returning, because a ``kill`` follows at once.
        node_agent_pid: pid of this node's agent; required when a ``node_loss`` targets this rank.
        snapshots: tier 4: this rank's copies; required when a ``corrupt_copy`` targets this rank.
    """

    def __init__(
        self,
        specs: list[FaultSpec],
        *,
        rank: int,
        marker_dir: str | Path,
        on_inject: Callable[[FaultSpec], None] | None = None,
        node_agent_pid: int | None = None,
        snapshots: SnapshotCopies | None = None,
    ) -> None:
        self.rank = rank
        self.snapshots = snapshots
        self.marker_dir = Path(marker_dir)
        self.on_inject = on_inject
        self.node_agent_pid = node_agent_pid
        self.specs = [s for s in specs if s.injected_by == "inside" and s.rank == rank]
        if node_agent_pid is None and any(s.fault_type == "node_loss" for s in self.specs):
            raise ValueError(
                f"a node_loss fault targets rank {rank} but node_agent_pid is None; "
                "pass the pid of this node's agent, or inject the node loss from outside "
                "(fault.injected_by=outside)"
            )
        if snapshots is None and any(s.fault_type == "corrupt_copy" for s in self.specs):
            raise ValueError(f"a corrupt_copy fault targets rank {rank}, which keeps no tier-4 copies")
        self._module: torch.nn.Module | None = None  # the fit's module (a bitflip's target)
        self._due: list[FaultSpec] = []  # faults of the micro-batch in flight
        self._forward_handle: RemovableHandle | None = None
        self._optimizer_handles: list[RemovableHandle] = []

    # -- hooks -------------------------------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once per fit, after optimizers exist: hook ``optimizer`` faults onto each optimizer's step."""
        self._remove_hooks()
        self._module = pl_module
        phases = {s.phase for s in self.specs}
        for optimizer in trainer.optimizers:
            if isinstance(optimizer, LightningOptimizer):
                optimizer = optimizer.optimizer
            if "commit" in phases:
                self._optimizer_handles.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
            if "optimizer" in phases:
                self._optimizer_handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    def on_recovery(self, completed_step: int) -> None:
        """Called by the in-process recovery loop between generations: fire ``recovery`` faults.

        A ``recovery`` fault of step N fires in the first recovery once the rank
        started step N (``completed_step >= N - 1``); so do ``comm_init`` and ``transfer`` ones.
        """
        self._fire_between_steps("recovery", completed_step)

    def on_comm_init(self, completed_step: int) -> None:
        """Called by the in-process recovery loop as this rank starts forming a generation's process
        groups: fire ``comm_init`` faults (its peers then wait for its address)."""
        self._fire_between_steps("comm_init", completed_step)

    def on_transfer(self, completed_step: int) -> None:
        """Tier 4: called on every rank as the state transfer of a recovery starts: ``transfer`` faults."""
        self._fire_between_steps("transfer", completed_step)

    def _fire_between_steps(self, phase: str, completed_step: int) -> None:
        self._due = [
            s
            for s in self.specs
            if s.phase == phase and s.fault_type != "corrupt" and completed_step >= s.step - 1
        ]
        self._fire(phase)

    def corrupt_transfer(self, pair: Any, bucket: int, buffer: torch.Tensor) -> None:
        """Tier 4 transfer hook on a source: a due ``corrupt`` fault flips the first byte of bucket 0."""
        if bucket != 0:
            return
        for spec in [s for s in self.specs if s.fault_type == "corrupt"]:
            if claim_fault(self.marker_dir, spec):
                if self.on_inject is not None:
                    self.on_inject(spec)
                buffer[0] ^= 0xFF

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Before each micro-batch's forward: arm the faults of this micro-batch; fire ``data`` faults."""
        self._disarm()
        if not is_step_end(trainer, batch_idx):
            return
        self._due = [s for s in self.specs if s.step == trainer.global_step + 1]
        if not self._due:
            return
        self._fire("data")
        if any(s.phase == "forward" for s in self._due):
            # Any module's forward: a LightningModule may call its model directly (self.net(x)).
            self._forward_handle = register_module_forward_pre_hook(self._before_forward)

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        """Before each micro-batch's backward: hook ``backward`` faults onto the loss's gradient."""
        if any(s.phase == "backward" for s in self._due):
            assert loss.requires_grad, "on_before_backward got a loss that does not require grad"
            loss.register_hook(self._on_loss_grad)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After each micro-batch's backward (grads reduced, not clipped or applied): ``grad_reduction``."""
        self._fire("grad_reduction")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After each micro-batch: drop its armed faults."""
        self._disarm()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._remove_hooks()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

    # -- torch hooks -------------------------------------------------------------------------------------

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._remove_forward_hook()
        self._fire("forward")

    def _on_loss_grad(self, grad: torch.Tensor) -> None:
        self._fire("backward")

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._fire("commit")

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._fire("optimizer")

    # -- internals ---------------------------------------------------------------------------------------

    def _fire(self, phase: str) -> None:
        for spec in [s for s in self._due if s.phase == phase]:
            self._due.remove(spec)
            if claim_fault(self.marker_dir, spec):
                self._inject(spec)

    def _inject(self, spec: FaultSpec) -> None:
        if self.on_inject is not None:
            self.on_inject(spec)
        sys.stdout.flush()
        sys.stderr.flush()
        if spec.fault_type == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.fault_type == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif spec.fault_type == "stall":
            while True:  # running, not stopped: only hang detection ends it
                time.sleep(3600)
        elif spec.fault_type == "exception":
            raise InjectedFault(spec)
        elif spec.fault_type == "device_error":
            raise torch.AcceleratorError(
                f"CUDA error: an illegal memory access was encountered (injected fault #{spec.index}: "
                f"device_error on rank {spec.rank} at optimizer step {spec.step}, phase {spec.phase})"
            )
        elif spec.fault_type == "node_loss":
            assert self.node_agent_pid is not None
            os.kill(self.node_agent_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.fault_type == "bitflip":
            assert self._module is not None, "a bitflip fires during a step, after on_train_start"
            flip_bit(self._module, spec.tensor)
        elif spec.fault_type == "corrupt_copy":
            assert self.snapshots is not None
            corrupt_held_loop(self.snapshots)
        else:
            raise AssertionError(f"unknown fault type {spec.fault_type!r}")

    def _disarm(self) -> None:
        self._due = []
        self._remove_forward_hook()

    def _remove_forward_hook(self) -> None:
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None

    def _remove_hooks(self) -> None:
        self._disarm()
        for handle in self._optimizer_handles:
            handle.remove()
        self._optimizer_handles = []
