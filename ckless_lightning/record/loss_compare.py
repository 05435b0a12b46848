"""Two runs' losses compared step by step, bit for bit: is a recovered run the run that never failed?

Each run's final loss per step is the last record of that step in its
``losses.jsonl`` (a step computed again after a rollback is logged twice);
losses are compared as exact floats. A leaf: no torch, no Lightning.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from ckless_lightning.record.loss_log import read_losses

__all__ = ["LossComparison", "compare_losses"]


@dataclass(frozen=True)
class LossComparison:
    """Final loss per step (last record of each step) of two runs, compared as exact floats."""

    equal: bool  # same (non-empty) step set and every step's loss bitwise equal
    common: int  # steps in both runs
    differing: int  # common steps whose losses differ
    first_difference: int | None  # the first common step that differs
    only_here: tuple[int, ...]
    only_there: tuple[int, ...]
    here_loss: float | None = None  # the losses at first_difference
    there_loss: float | None = None

    def describe(self, there: str = "the other run") -> str:
        """One line: bitwise equal, or the first step that differs and the step sets."""
        if self.equal:
            return f"losses bitwise equal to {there} on all {self.common} steps"
        if not (self.common or self.only_here or self.only_there):
            return f"no losses to compare: neither this run nor {there} logged a step"
        parts = []
        if self.only_here or self.only_there:
            parts.append(
                f"step sets differ (only here: {_steps(self.only_here)}; only in {there}: "
                f"{_steps(self.only_there)})"
            )
        if self.first_difference is not None:
            parts.append(
                f"{self.differing} of {self.common} common steps differ, first step {self.first_difference} "
                f"({self.here_loss!r} vs {self.there_loss!r})"
            )
        elif self.common:
            parts.append(f"the {self.common} common steps are bitwise equal")
        return f"losses differ from {there}: " + "; ".join(parts)


def _steps(steps: tuple[int, ...]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{len(steps)} steps, {steps[0]}..{steps[-1]}"


def _same(a: float, b: float) -> bool:
    """Bit for bit (so -0.0 is not 0.0, and a NaN equals the same NaN)."""
    return struct.pack("<d", a) == struct.pack("<d", b)


def compare_losses(run_dir: str | Path, other_dir: str | Path) -> LossComparison:
    """Compare ``<run_dir>/losses.jsonl`` with ``<other_dir>/losses.jsonl`` step by step (last record wins).

    Raises ``FileNotFoundError`` naming the path of a run without ``losses.jsonl``.
    """
    paths = [Path(run_dir) / "losses.jsonl", Path(other_dir) / "losses.jsonl"]
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"no losses.jsonl: {path}")
    here, there = (read_losses(p) for p in paths)
    common = sorted(here.keys() & there.keys())
    diffs = [s for s in common if not _same(here[s], there[s])]
    first = diffs[0] if diffs else None
    only_here = tuple(sorted(here.keys() - there.keys()))
    only_there = tuple(sorted(there.keys() - here.keys()))
    return LossComparison(
        equal=bool(common) and not diffs and not only_here and not only_there,
        common=len(common),
        differing=len(diffs),
        first_difference=first,
        only_here=only_here,
        only_there=only_there,
        here_loss=None if first is None else here[first],
        there_loss=None if first is None else there[first],
    )
