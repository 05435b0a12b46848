"""Which samples each rank trained on, per optimizer step: ``<run_dir>/samples/rank<N>.jsonl``.

For exactly-once accounting (``data.record_samples=true``): a restarted run
appends the steps after its resume point again, and the last record of a
(step, micro-batch) wins, as in losses.jsonl. Appends only, so no state to checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

__all__ = ["SampleLogCallback", "read_sample_log"]


class SampleLogCallback(pl.Callback):
    """Before each training batch: append ``{"step", "micro", "sample_ids", "gen", "dp_size"}`` for this
    rank (``gen``: the job generation it trained in; an elastic job's step may be tried at one width
    and committed at another, in a later generation).

    Before, not after: a rank killed between its step's commit and the end of the batch (its
    last micro-batch's ``on_train_batch_end`` runs after the optimizer step) must not leave a
    committed step without its samples; a step tried and not committed is tried again, by a
    later generation, whose records win."""

    def __init__(self, out_dir: str | Path, generation: int = 0) -> None:
        self.out_dir = Path(out_dir)
        self.generation = generation

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        accumulate = trainer.accumulate_grad_batches
        record = {
            # the optimizer step this micro-batch belongs to (1-based, as in losses.jsonl)
            "step": int(batch["step"]) // accumulate + 1,
            "micro": int(batch["step"]) % accumulate,
            "sample_ids": batch["sample_ids"].tolist(),
            "gen": self.generation,
            "dp_size": trainer.world_size,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / f"rank{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_sample_log(path: str | Path) -> dict[tuple[int, int], list[int]]:
    """{(step, micro): sample ids} of one rank; later records of the same key win."""
    samples: dict[tuple[int, int], list[int]] = {}
    path = Path(path)
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                samples[(record["step"], record["micro"])] = record["sample_ids"]
    return samples
