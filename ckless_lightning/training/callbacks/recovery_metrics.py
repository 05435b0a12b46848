"""What a recovery cost, to the experiment logger: rank 0 logs it once training runs again.

In a generation after a fault (``generation > 0``), rank 0 reads the job's ``events.jsonl`` and
``losses.jsonl`` and logs, for the recovery that led to this generation, with ``step`` = the
first optimizer step completed in it:

``recovery/seconds``
    fault -> the last rank's first completed step after it (the summary's ``total``);
``recovery/steps_lost``
    steps completed before the fault and computed again (the summary's ``lost``);
``recovery/count``
    the job's recoveries so far, this one included;
``goodput``
    steps done x median step time / wall time since the job started, so far;
``ml_goodput``
    steps kept / steps computed, so far.

The figures are those of :func:`ckless_lightning.record.summary.summarize`. They are complete once
every rank has reported its first step of the generation, usually at the end of the step after
it (a rank reports its first step before it can take part in the next one); if training ends
first, they are logged then, from the ranks that reported. A generation left before that logs
nothing: the next one logs only its own recovery.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from ckless_lightning.record.events import read_events, read_jsonl
from ckless_lightning.record.summary import summarize
from ckless_lightning.training.steps import is_step_end

__all__ = ["RecoveryMetricsCallback", "recovery_metrics"]


def recovery_metrics(
    events: list[dict[str, Any]],
    losses: list[dict[str, Any]],
    *,
    generation: int,
    world_size: int,
    now: float,
    require_all: bool = True,
) -> list[dict[str, float]] | None:
    """The metrics of each recovery into ``generation`` (normally one), as logged (see the module).

    ``events``: the job's ``events.jsonl`` records; ``losses``: ``losses.jsonl``'s; ``now``: the
    time the figures are taken at (``goodput``'s wall time ends there). ``None`` while fewer than
    ``world_size`` ranks reported their first completed step in ``generation`` (the recovery's time
    is not known yet), unless ``require_all`` is false. ``goodput`` is left out without a
    ``job_start`` event (ranks started by torchrun) or before there is a median step time.
    """
    first_steps = {
        int(e["rank"])
        for e in events
        if e["kind"] == "rank_phase" and e.get("phase") == "first_step_done" and e.get("gen") == generation
    }
    if require_all and len(first_steps) < world_size:
        return None
    summary = summarize(events, losses)
    # (new generation, seconds, steps lost) of each recovery, in time order
    recovered = [
        (f.new_gen, f.total_s, f.steps_lost)
        for f in summary.faults
        if f.new_gen is not None and f.total_s is not None
    ]
    before = sum(1 for gen, _, _ in recovered if gen < generation)
    starts = [float(e["t"]) for e in events if e["kind"] == "job_start"]
    shared: dict[str, float] = {}
    if starts and summary.steps_done and summary.step_time_s and now > min(starts):
        shared["goodput"] = summary.steps_done * summary.step_time_s / (now - min(starts))
    if summary.ml_goodput is not None:
        shared["ml_goodput"] = summary.ml_goodput
    metrics = []
    mine = [(seconds, lost) for gen, seconds, lost in recovered if gen == generation]
    for count, (seconds, lost) in enumerate(mine, start=before + 1):
        row = {"recovery/seconds": seconds, "recovery/count": float(count), **shared}
        if lost is not None:
            row["recovery/steps_lost"] = float(lost)
        metrics.append(row)
    return metrics


class RecoveryMetricsCallback(pl.Callback):
    """Logs :func:`recovery_metrics` of ``generation`` to the Trainer's loggers, once, on global rank 0.

    Call contract: one instance per Trainer, built with the generation this Trainer trains in (the
    rank's ``RankContext.generation`` at tiers 0-2, the joined generation at tiers 3-4) and the
    job's world size; a no-op in generation 0 and on ranks other than 0. ``run_dir`` holds the
    job's ``events.jsonl`` and ``losses.jsonl``. Until the figures are complete it re-reads both
    files at the end of each optimizer step. Keeps no state worth checkpointing (a restored or new
    Trainer is a new generation with its own instance).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        generation: int,
        world_size: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.events_path = Path(run_dir) / "events.jsonl"
        self.losses_path = Path(run_dir) / "losses.jsonl"
        self.generation = generation
        self.world_size = world_size
        self.clock = clock
        self.first_step: int | None = None  # the first optimizer step completed in this generation
        self.logged = generation == 0  # nothing to log in the first generation

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After each micro-batch; acts at the end of an optimizer step until it has logged."""
        if self.logged or not trainer.is_global_zero or not is_step_end(trainer, batch_idx):
            return
        if self.first_step is None:
            self.first_step = trainer.global_step
        self._log(trainer, require_all=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training ended before every rank reported: log from the ranks that did."""
        if not self.logged and trainer.is_global_zero and self.first_step is not None:
            self._log(trainer, require_all=False)

    def _log(self, trainer: pl.Trainer, *, require_all: bool) -> None:
        try:
            metrics = recovery_metrics(
                read_events(self.events_path),
                read_jsonl(self.losses_path),
                generation=self.generation,
                world_size=self.world_size,
                now=self.clock(),
                require_all=require_all,
            )
        except (OSError, ValueError, KeyError, TypeError) as err:  # unreadable or malformed records
            # A report: it must not fail the step (a raising rank would be a fault to recover from).
            self.logged = True
            rank_zero_warn(f"recovery metrics of generation {self.generation} not logged: {err!r}")
            return
        if metrics is None:
            return
        self.logged = True
        for row in metrics:
            for logger in trainer.loggers:
                logger.log_metrics(row, step=self.first_step)
                logger.save()
