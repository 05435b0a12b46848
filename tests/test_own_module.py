"""A user's own LightningModule and DataModule, named by a recipe, under the agent at tiers 3 and 4.

examples/own_module/ is an MLP regressor on synthetic data with a StatefulDataLoader (nothing of
the built-in models or data pipeline). Each test runs the recipe through launch.py as a user would
(``--config-dir examples/own_module/conf recipe=own_module``, the example on PYTHONPATH), without
a fault and with a rank killed, and compares the two bitwise: every step's loss, and the final
checkpoint (weights, optimizer state, scheduler).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from checkpoint_utils import assert_bitwise_equal, load_full_checkpoint

from ckless_lightning.record.loss_log import read_losses
from ckless_lightning.runtime.checkpointing import checkpoint_name

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_module"
STEPS = 10


def _launch(run_dir: Path, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        "--config-dir",
        str(EXAMPLE / "conf"),
        "recipe=own_module",
        f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={STEPS}",
        "trainer.enable_progress_bar=false",
        "timeline=false",
        *overrides,
    ]
    result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
    return result


def _assert_same_run(faulted: Path, clean: Path, scratch: Path) -> None:
    assert read_losses(faulted / "losses.jsonl") == read_losses(clean / "losses.jsonl")
    final = checkpoint_name(STEPS)
    a = load_full_checkpoint(faulted / "checkpoints" / final, scratch)
    b = load_full_checkpoint(clean / "checkpoints" / final, scratch)
    assert assert_bitwise_equal(a, b) > 0


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """The fault-free run of a configuration, once per module (the tier changes no bit of it)."""
    runs: dict[tuple[str, ...], Path] = {}

    def get(*extra: str) -> Path:
        if extra not in runs:
            runs[extra] = tmp_path_factory.mktemp("clean") / "run"
            _launch(runs[extra], "tier=4", "fault=none", *extra)
        return runs[extra]

    return get


@pytest.mark.parametrize(
    ("tier", "fault", "extra"),
    [
        # buddy copies: survivors adopt their live state, the killed rank's comes from its buddy
        ("4", ("fault=kill", "fault.rank=1", "fault.step=7"), ()),
        # with dropout: each rank's RNG comes back with the state (from a buddy's copy)
        ("4", ("fault=kill", "fault.rank=2", "fault.step=6"), ("module.dropout=0.2",)),
        # the disk checkpoint of step 5 (the loader's position and every rank's RNG in it); 2
        # micro-batches a step
        (
            "3",
            ("fault=kill", "fault.rank=1", "fault.step=7"),
            ("trainer.global_batch_size=64", "module.dropout=0.2"),
        ),
        # before the first checkpoint: the same processes start over, and build the same weights
        ("3", ("fault=exception", "fault.rank=2", "fault.step=3"), ()),
    ],
    ids=["tier4-kill", "tier4-kill-dropout", "tier3-kill-accumulate-dropout", "tier3-start-over"],
)
def test_own_module_recipe_recovers_bitwise(tmp_path, clean_run, tier, fault, extra):
    clean = clean_run(*extra)
    faulted = tmp_path / "faulted"
    result = _launch(faulted, f"tier={tier}", *fault, *extra)
    assert f"@{fault[1][-1]}" in result.stdout  # the fault's row in the summary
    config = yaml.safe_load((faulted / "config.yaml").read_text())
    assert config["module"]["_target_"] == "own_module.MLPRegressor"
    assert config["datamodule"]["_target_"] == "own_module.RegressionData"
    _assert_same_run(faulted, clean, tmp_path)
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckless_lightning.report",
            str(faulted),
            "--against",
            str(clean),
            "--require-equal",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stdout + report.stderr


def test_own_module_dry_run_plans_from_the_module_on_meta(tmp_path):
    result = _launch(tmp_path / "dry", "dry_run=true", "tier=4")
    assert "own_module.MLPRegressor" in result.stdout
    assert "parameters:   538,888" in result.stdout  # built on the meta device: counted, not allocated
    assert "not known:    optimizer state" in result.stdout
