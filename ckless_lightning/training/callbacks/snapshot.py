"""SnapshotCallback (tier 4): after every committed step, snapshot the state a peer could restore.

Called at the end of each optimizer step (``on_train_batch_end`` of its last
micro-batch), before any callback that communicates: the in-process recovery
loop puts it right after ``DataPositionCallback`` (which it needs: the loader
position in the snapshot must be the committed step) and ``LossHistoryCallback``
(which does not communicate there: a step's loss is on disk before the step is
recorded, so a step the job resumes after always has its loss). No collective runs
between the optimizer update and this point, so a survivor's live tensors and
its last snapshot always describe the same step.

The snapshot is Lightning's own checkpoint dict without the tensors (loops,
callbacks, LR schedulers, optimizer hyper-parameters, data position) plus the
RNG state, pickled; the tensors stay live, or (``buddy`` source) are copied to
host memory and to the buddy rank by the :class:`SnapshotCopies`; that exchange
runs in the background and is waited for before the next step's first batch.
Each step's :class:`~ckless_lightning.replication.fingerprint.StateFingerprint` is kept by the
rank and carried by the step's copy (:meth:`SnapshotCopies.record`), so no copy leaves the rank
without its record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer
from typing_extensions import override

from ckless_lightning.replication import SnapshotCopies
from ckless_lightning.replication.loop_state import encode_loop_state
from ckless_lightning.replication.state import (
    RNG_KEY,
    LiveParam,
    LiveStateListing,
    params_are_optimized,
    rng_state,
)
from ckless_lightning.training._lightning_compat import dump_training_state
from ckless_lightning.training.steps import is_step_end

__all__ = ["SnapshotCallback"]


class SnapshotCallback(pl.Callback):
    """Records each committed step of generation ``generation`` in ``snapshots``; ``on_first_record``
    runs once (the job has state)."""

    def __init__(
        self,
        snapshots: SnapshotCopies,
        *,
        generation: int = 0,
        on_first_record: Callable[[], None] | None = None,
    ) -> None:
        self.snapshots = snapshots
        self.generation = generation
        self.on_first_record = on_first_record
        self.record_s = 0.0  # taking snapshots (dump, pickle, host copy, posting the exchange)
        self.record_cpu_s = 0.0  # the same, in this thread's CPU time (what it costs on busy cores)
        self.settle_s = 0.0  # waiting for the exchange before the next step
        self.records = 0
        self._listing = LiveStateListing()  # the live local state, listed once (see state_tensors)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Before each micro-batch: the previous step's buddy exchange must have completed.

        It overlaps the end of the previous step (logging, checkpointing) and the batch
        fetch; waiting here means a fault anywhere in this step finds every buddy copy of the
        last committed step complete, so only a fault inside an update can cost a step.
        """
        start = time.perf_counter()
        self.snapshots.settle()
        self.settle_s += time.perf_counter() - start

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once, when training ends: finish the last buddy exchange before leaving ``fit``.

        A rank that left with its exchange in flight closed its connections under a slower peer
        still posting its own half of it: that peer failed after the last step (seen one run in
        two once nothing else synchronized the ranks at the end) and waited for a generation
        nobody would join.
        """
        start = time.perf_counter()
        self.snapshots.settle()
        self.settle_s += time.perf_counter() - start

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the optimizer update of a step (its last micro-batch), once per step."""
        if not is_step_end(trainer, batch_idx):
            return
        start, cpu_start = time.perf_counter(), time.thread_time()
        light = getattr(trainer.strategy, "light_state", None)
        if light is None:
            raise TypeError("SnapshotCallback needs CheckpointlessStrategy (its light_state())")
        with light():
            checkpoint = dump_training_state(trainer)
        checkpoint[RNG_KEY] = rng_state()  # set again when a restored generation starts training
        tensors = self.state_tensors(pl_module, trainer.optimizers)
        step = trainer.global_step
        self.snapshots.record(step, encode_loop_state(checkpoint), tensors, gen=self.generation)
        self.snapshots.exchange(step)
        if self.on_first_record is not None:
            self.on_first_record()
            self.on_first_record = None
        self.record_s += time.perf_counter() - start
        self.record_cpu_s += time.thread_time() - cpu_start
        self.records += 1

    def state_tensors(self, module: pl.LightningModule, optimizers: list[Optimizer]) -> list[torch.Tensor]:
        """The local state tensors, listed again only when the parameters or optimizer state change
        (:class:`~ckless_lightning.replication.state.LiveStateListing`)."""
        if self._listing.current(module, optimizers) is None:
            # After an optimizer step FSDP2 has resharded every block: what is registered is stepped.
            assert params_are_optimized(module, optimizers), "registered parameters are not the stepped ones"
        return self._listing.tensors(module, optimizers)

    def live_params(self, module: pl.LightningModule, optimizers: list[Optimizer]) -> list[LiveParam] | None:
        """The live state as listed after the last snapshot, if it is still the state of ``module``
        and ``optimizers``; None otherwise.

        Valid whatever the module's registration looks like now: a fault inside an FSDP2 collective
        can leave a block's unsharded parameters registered, while the sharded ones (these, the
        optimizer's) are untouched until the next optimizer step.
        """
        return self._listing.current(module, optimizers)
