"""A Trainer that resumes mid-run (a restart, or tiers 3-4's new Trainer after a recovery), under gradient
accumulation: the progress bar keeps its total and counts micro-batches, and the job's checkpoint
callback does not write again the checkpoint the fit resumed from.

Lightning sets the bar's total in ``on_train_epoch_start``, which it skips when it resumes in the
middle of an epoch: its own bar then reads ``N/?``. A single-process Trainer over a step-addressed
loader (one epoch of ``max_steps x accumulate`` micro-batches, as ``StepBatchLoader``) runs 8 steps
with a checkpoint at step 4; a second Trainer resumes from it.

Lightning's ``ModelCheckpoint`` (2.6.6) writes that checkpoint again: the first micro-batch after a
resume from step S ends at ``global_step`` S, a multiple of ``every_n_train_steps``, and its "last
saved" step is not in its checkpoint state. The job's first step after a tier-3 recovery paid for that
save on every rank (docs/benchmarks.md, "The first step after a recovery"); ``StepCheckpoint`` does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ckless_lightning.training.callbacks import ResumedCheckpoints, StepCheckpoint, StepProgressBar

MAX_STEPS = 8


class _Steps:
    """``n`` micro-batches, resumable (the position comes from Lightning's restored loop)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return (torch.full((2, 4), float(i)) for i in range(self.n))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _Module(pl.LightningModule):
    def __init__(self, batches: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.batches = batches

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> _Steps:
        return _Steps(self.batches)


def _fit(
    root: Path,
    accumulate: int,
    save: ModelCheckpoint,
    ckpt_path: Path | None = None,
    *others: pl.Callback,
) -> StepProgressBar:
    bar = StepProgressBar()
    trainer = pl.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        max_steps=MAX_STEPS,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_model_summary=False,
        callbacks=[bar, save, *others],
    )
    assert trainer.progress_bar_callback is bar
    trainer.fit(_Module(MAX_STEPS * accumulate), ckpt_path=ckpt_path)
    assert trainer.global_step == MAX_STEPS
    return bar


@pytest.mark.parametrize("accumulate", [1, 2])
def test_bar_total_holds_after_a_resume_from_a_mid_run_step(tmp_path: Path, accumulate: int) -> None:
    total = MAX_STEPS * accumulate  # micro-batches: the bar counts batch_idx + 1

    def save() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)

    fresh = _fit(tmp_path, accumulate, save())
    assert (fresh.train_progress_bar.total, fresh.train_progress_bar.n) == (total, total)

    resumed = _fit(tmp_path, accumulate, save(), ckpt_path=tmp_path / "step=4.ckpt")
    assert (resumed.train_progress_bar.total, resumed.train_progress_bar.n) == (total, total)


@pytest.mark.parametrize("callback", ["lightning", "step_checkpoint", "users_own"])
def test_a_resumed_fit_does_not_write_its_checkpoint_again(tmp_path: Path, callback: str) -> None:
    """``lightning``: the premise, Lightning's own writes step 4 again; ``step_checkpoint``: the job's
    does not; ``users_own``: neither does Lightning's own beside ``ResumedCheckpoints`` (which
    ``InProcessRecovery`` adds to every generation's Trainer), while a second ``ModelCheckpoint``
    writing to another directory, which does not hold step 4, still saves it."""
    elsewhere = tmp_path / "elsewhere"
    others: tuple[pl.Callback, ...] = ()
    if callback == "users_own":
        # (another monitor: two ModelCheckpoints of one Trainer need state keys of their own)
        second = ModelCheckpoint(
            dirpath=elsewhere, every_n_train_steps=4, save_top_k=-1, monitor="step", mode="max"
        )
        others = (ResumedCheckpoints(), second)  # only in the resumed fit: its directory is empty

    def save() -> ModelCheckpoint:
        if callback in ("lightning", "users_own"):
            return ModelCheckpoint(
                dirpath=tmp_path,
                filename="step{step:08d}",
                auto_insert_metric_name=False,
                every_n_train_steps=4,
                save_top_k=-1,
            )
        return StepCheckpoint(tmp_path, every_n_train_steps=4, keep_last=-1)

    _fit(tmp_path, 2, save())
    step4 = tmp_path / "step00000004.ckpt"
    written = step4.stat().st_mtime_ns
    (tmp_path / "step00000008.ckpt").unlink()
    _fit(tmp_path, 2, save(), step4, *others)
    assert (tmp_path / "step00000008.ckpt").is_file()  # later checkpoints are still written
    assert (step4.stat().st_mtime_ns != written) == (callback == "lightning")
    if callback == "users_own":
        assert sorted(p.name for p in elsewhere.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]


def test_a_resume_at_a_step_with_no_checkpoint_on_disk_still_saves_it(tmp_path: Path) -> None:
    """Tier 4 resumes from memory; a step whose checkpoint never reached the disk is saved."""
    _fit(tmp_path, 2, StepCheckpoint(tmp_path, every_n_train_steps=4, keep_last=-1))
    step4 = tmp_path / "step00000004.ckpt"
    moved = step4.rename(tmp_path / "resume.ckpt")
    (tmp_path / "step00000008.ckpt").unlink()
    _fit(tmp_path, 2, StepCheckpoint(tmp_path, every_n_train_steps=4, keep_last=-1), ckpt_path=moved)
    assert step4.is_file() and (tmp_path / "step00000008.ckpt").is_file()
