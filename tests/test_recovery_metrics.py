"""Recovery figures to the experiment logger: the computation on a synthetic timeline, and the
callback logging them once, at the first step after the recovery, in a single-process Trainer."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger
from test_faults import TinyModule

from ckless_lightning.record.events import EventLog
from ckless_lightning.training.callbacks import RecoveryMetricsCallback, TimelineCallback
from ckless_lightning.training.callbacks.recovery_metrics import recovery_metrics

T0 = 1000.0


def _phase(t: float, rank: int, gen: int, phase: str, **fields) -> dict:
    return {"t": T0 + t, "kind": "rank_phase", "rank": rank, "gen": gen, "phase": phase, **fields}


def _timeline() -> tuple[list[dict], list[dict]]:
    """2 ranks at tier 4, one step a second; rank 1 killed in step 5, restored from memory at step 4."""
    events = [
        {"t": T0, "kind": "job_start", "tier": 4, "world_size": 2, "nnodes": 1},
        *(_phase(11.0, rank, 0, "first_step_done", step=1) for rank in (0, 1)),
        {"t": T0 + 14.5, "kind": "fault_injected", "rank": 1, "step": 5, "phase": "forward"}
        | {"fault_type": "kill", "injected_by": "inside"},
        _phase(14.6, 0, 0, "recovery_start", completed_step=4),
        {"t": T0 + 14.7, "kind": "generation", "gen": 1, "reason": "fault"},
        *(_phase(15.0, rank, 1, "state_load_done", step=4) for rank in (0, 1)),
        _phase(16.0, 0, 1, "first_step_done", step=5),
        _phase(16.1, 1, 1, "first_step_done", step=5),
    ]
    losses = [{"step": s, "loss": 5.0 - s / 10, "t": T0 + 10 + s + (1 if s > 4 else 0)} for s in range(1, 7)]
    return events, losses


def _one(events: list[dict], losses: list[dict], **kwargs) -> dict[str, float]:
    rows = recovery_metrics(events, losses, generation=1, world_size=2, now=T0 + 20, **kwargs)
    assert rows is not None and len(rows) == 1, rows
    return rows[0]


def test_recovery_metrics_of_a_timeline() -> None:
    events, losses = _timeline()
    row = _one(events, losses)
    assert row["recovery/seconds"] == pytest.approx(1.6)  # fault -> the last rank's first step
    assert row["recovery/steps_lost"] == 0 and row["recovery/count"] == 1
    # 6 steps x 1 s median step (the step across the fault is left out) over 20 s since the job start
    assert row["goodput"] == pytest.approx(6 / 20) and row["ml_goodput"] == 1.0
    assert recovery_metrics(events, losses, generation=2, world_size=2, now=T0 + 20, require_all=False) == []

    # Until every rank reported its first step, the recovery's time is not known...
    partial = [e for e in events if not (e.get("phase") == "first_step_done" and e["t"] == T0 + 16.1)]
    assert recovery_metrics(partial, losses, generation=1, world_size=2, now=T0 + 20) is None
    # ...unless training ended: then from the ranks that reported.
    row = _one(partial, losses, require_all=False)
    assert row["recovery/seconds"] == pytest.approx(1.5)
    # No job_start (ranks started by torchrun): no goodput, the rest as before.
    row = _one(events[1:], losses)
    assert "goodput" not in row and row["recovery/count"] == 1


def test_callback_logs_at_the_first_step_after_the_recovery(tmp_path: Path) -> None:
    """Generation 1 of a 1-rank job whose step 3 failed and that restarted from step 0 (2 lost)."""
    events = EventLog(tmp_path / "events.jsonl", source="test")
    events.emit("job_start", tier=0, world_size=1, nnodes=1)
    events.emit("fault_injected", rank=0, step=3, phase="forward", fault_type="kill", injected_by="inside")
    events.emit("generation", gen=1, reason="fault")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=CSVLogger(tmp_path, name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            TimelineCallback(events, rank=0, generation=1),  # first_step_done of generation 1
            RecoveryMetricsCallback(tmp_path, generation=1, world_size=1),
        ],
    )
    trainer.fit(TinyModule())
    with (tmp_path / "logs" / "version_0" / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("recovery/seconds")]
    assert len(rows) == 1, rows
    [row] = rows
    assert row["step"] == "1" and float(row["recovery/seconds"]) > 0
    assert row["recovery/steps_lost"] == "2.0" and row["recovery/count"] == "1.0"
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    fault = next(e for e in records if e["kind"] == "fault_injected")
    first = next(e for e in records if e.get("phase") == "first_step_done")
    assert float(row["recovery/seconds"]) == pytest.approx(first["t"] - fault["t"])


def test_callback_warns_and_trains_on_when_the_record_is_unreadable(tmp_path: Path) -> None:
    """A report must not fail a step: a corrupt events.jsonl is a warning, and training goes on."""
    (tmp_path / "events.jsonl").write_text('{"t": 1, "kind": "job_start"}\nnot json\n{"t": 2, "kind": "x"}\n')
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=CSVLogger(tmp_path, name="logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RecoveryMetricsCallback(tmp_path, generation=1, world_size=1)],
    )
    with pytest.warns(UserWarning, match="recovery metrics of generation 1 not logged: ValueError"):
        trainer.fit(TinyModule())
    assert trainer.global_step == 3 and not logged_recoveries(tmp_path)


def logged_recoveries(run_dir: Path) -> dict[int, float]:
    """``recovery/seconds`` by step, from every ``metrics.csv`` of a run (one version per start)."""
    out: dict[int, float] = {}
    for path in sorted((run_dir / "logs").glob("version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("recovery/seconds"):
                    out[int(row["step"])] = float(row["recovery/seconds"])
    return out
