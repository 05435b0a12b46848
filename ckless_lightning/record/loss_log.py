"""``<run_dir>/losses.jsonl``: one record per optimizer step, ``{"step", "loss", "t"}``, written by rank 0.

A leaf (no torch, no Lightning), so that the agent and the summary can read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckless_lightning.record.events import read_jsonl

__all__ = ["read_loss_records", "read_losses"]


def read_loss_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record in file order (a restarted run appends the steps after its resume point again).

    A torn last line (rank 0 killed mid-write) is skipped, as in the event log.
    """
    return read_jsonl(path)


def read_losses(path: str | Path) -> dict[int, float]:
    """{step: loss}; a step recorded twice (after a restart) keeps the last record."""
    return {int(r["step"]): float(r["loss"]) for r in read_loss_records(path)}
