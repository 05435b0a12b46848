"""End to end on 4 CPU ranks through launch.py: checkpoint-resume (and so determinism), compared bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_utils import assert_bitwise_equal, load_full_checkpoint
from conftest import launch_job

from ckless_lightning.record.loss_log import read_losses
from ckless_lightning.runtime.checkpointing import checkpoint_name, latest_checkpoint


def train(run_dir: Path, data_cache: Path, *overrides: str):
    return launch_job(run_dir, data_cache, *overrides)


@pytest.mark.timeout(600)
def test_resume_from_step_10_equals_uninterrupted_20_steps(tmp_path, data_cache):
    """Also determinism: the split run is separate processes (twice), so equal weights, optimizer
    state and losses mean two runs of one config are bitwise equal (every fault test relies on it)."""
    common = ("trainer.max_steps=20", "checkpoint.every_n_steps=10")
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(whole, data_cache, *common)
    # Stop at step 10 on the 20-step schedule, then resume the same run directory.
    train(split, data_cache, "trainer.max_steps=10", "optim.decay_steps=20", "checkpoint.every_n_steps=10")
    assert latest_checkpoint(split / "checkpoints") == split / "checkpoints" / checkpoint_name(10)
    resumed = train(split, data_cache, *common)
    assert "resuming from" in resumed.stdout and checkpoint_name(10) in resumed.stdout

    whole_losses, split_losses = read_losses(whole / "losses.jsonl"), read_losses(split / "losses.jsonl")
    assert sorted(split_losses) == list(range(1, 21))
    assert split_losses == whole_losses
    a = load_full_checkpoint(whole / "checkpoints" / checkpoint_name(20), tmp_path)
    b = load_full_checkpoint(split / "checkpoints" / checkpoint_name(20), tmp_path)
    assert a["state_dict"], "no weights in the checkpoint"
    assert a["optimizer_0"]["state"], "no optimizer state in the checkpoint"
    assert assert_bitwise_equal(a, b) > 800_000  # elements compared: weights and AdamW state


def test_checkpoints_are_found_under_lightnings_default_names_too(tmp_path):
    """A user's ModelCheckpoint with its default template (``epoch=0-step=4.ckpt``, ``-v1`` on a
    clash) writes recovery points as good as the job's own ``step00000004.ckpt``: a recovery that
    did not recognize them restarted from step 1 without a word. ``last.ckpt`` says no step."""
    from ckless_lightning.runtime.checkpointing import checkpoint_step, quarantine_checkpoints

    def folder(name: str, complete: bool = True) -> Path:
        path = tmp_path / name
        path.mkdir()
        if complete:
            (path / ".metadata").touch()
            (path / "meta.pt").touch()
        return path

    assert [checkpoint_step(n) for n in ("epoch=0-step=4.ckpt", "epoch=1-step=12-v1.ckpt", "last.ckpt")] == [
        4,
        12,
        None,
    ]
    assert checkpoint_step("model-step=7-val_loss=0.50.ckpt") == 7
    folder("step00000003.ckpt")
    folder("epoch=0-step=8.ckpt")
    folder("epoch=0-step=9.ckpt", complete=False)  # killed mid-save: skipped
    folder("last.ckpt")
    assert latest_checkpoint(tmp_path) == tmp_path / "epoch=0-step=8.ckpt"
    moved = quarantine_checkpoints(tmp_path, after_step=3, tag="t")
    assert sorted(p.name for p in moved) == ["epoch=0-step=8.ckpt.suspect-t", "epoch=0-step=9.ckpt.suspect-t"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step00000003.ckpt"


def test_a_steps_loss_is_recorded_before_tier_4_records_the_step(compose, monkeypatch):
    """At a step's end the loss record comes before the recovery's callbacks (tier 4's snapshot):
    a rank 0 killed between the two left a step the job resumed after with no loss in
    losses.jsonl (a chaos soak, 2026-12-08). Killed after the record and before the snapshot, the
    step is redone and its loss recorded twice, the same."""
    import lightning.pytorch as pl

    from ckless_lightning.runtime.config import job_config_from_dict
    from ckless_lightning.training.callbacks import DataPositionCallback, LossHistoryCallback
    from ckless_lightning.training.job import build_trainer

    class Recovery(pl.Callback):  # stands for InProcessRecovery's callbacks (SnapshotCallback first)
        pass

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(key, value)  # what a rank's environment holds (TorchElasticEnvironment)
    recovery = Recovery()
    trainer = build_trainer(job_config_from_dict(compose("tier='4'", "fault=none")), callbacks=[recovery])
    kinds = [type(c) for c in trainer.callbacks]
    assert kinds[:3] == [DataPositionCallback, LossHistoryCallback, Recovery], kinds
