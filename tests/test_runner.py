"""Your own script under the agent: ``python -m ckless_lightning.run [...] SCRIPT ARGS``.

Units: the runner's command line (options and overrides before the script, the script's own
after it), ``fit``'s refusals and its plain-Lightning mode without the runner,
the config checks of a script job. Then examples/own_module/train.py (the example's module and
DataModule, ``fit`` in place of ``Trainer.fit``) run by the runner on 3 ranks as
a user would, without a fault and with one, compared bitwise (every step's loss and the final
checkpoint): tier 4 with a rank killed and a warm spare (which runs the script) in its place, and
tier 3 with an exception before any checkpoint (the same processes start over from a fresh copy
of the module).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_utils import assert_bitwise_equal, load_full_checkpoint

from ckless_lightning.record.loss_log import read_losses
from ckless_lightning.run import parse_runner_args
from ckless_lightning.runtime.checkpointing import checkpoint_name
from ckless_lightning.runtime.config import job_config_from_dict

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_module"
SCRIPT = EXAMPLE / "train.py"
STEPS = 8


# -- units ---------------------------------------------------------------------------------------------


def test_the_command_line_splits_at_the_script() -> None:
    args = parse_runner_args(
        [
            "--nproc-per-node",
            "3",
            "--nnodes=1",
            "tier=3",
            "fault=kill",
            str(SCRIPT),
            "--max-steps",
            "5",
            "a=b",
        ]
    )
    assert args.script == [str(SCRIPT), "--max-steps", "5", "a=b"]  # the script's own, untouched
    assert args.hydra == [
        "recipe=script",
        "cluster.nproc_per_node=3",
        "cluster.nnodes=1",
        "tier='3'",
        "fault=kill",
    ]
    assert parse_runner_args(["recipe=mine", str(SCRIPT)]).hydra == ["recipe=mine"]
    for argv, message in [
        (["tier=4"], "no script given"),
        (["--nproc-per-node"], "--nproc-per-node needs a value"),
        (["--spares", "1", str(SCRIPT)], "unknown option --spares"),
        (["missing_train.py"], "script missing_train.py not found"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_runner_args(argv)


def test_a_script_job_is_checked_before_ranks_start(tmp_path) -> None:
    base = {
        "recipe": "script",
        "run_dir": str(tmp_path),
        "tier": 4,
        "comm": {"rootless": True},
        "script": [str(SCRIPT)],
    }
    job = job_config_from_dict(base)
    assert job.script == [str(SCRIPT)] and job.model is None and not job.data.mmap_cache
    for extra, message in [
        ({"script": [str(tmp_path / "nope.py")]}, "is not a file"),
        ({"module": {"_target_": "own_module.MLPRegressor"}}, "exclude each other"),
        ({"elastic": {"enabled": True}}, "elastic.enabled=true needs the built-in data pipeline"),
        ({"script": "train.py --max-steps 3"}, "script must be a list of strings"),
    ]:
        with pytest.raises(ValueError, match=message):
            job_config_from_dict({**base, **extra})


def test_fit_refuses_what_the_job_sets_and_is_plain_lightning_without_the_runner(
    tmp_path, monkeypatch
) -> None:
    from ckless_lightning.run import fit

    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.delenv("CKLESS_JOB_CONFIG", raising=False)
    from own_module import MLPRegressor, RegressionData

    with pytest.raises(ValueError, match=r"strategy= is the job's to set; .*cluster.replicate"):
        fit(MLPRegressor(), strategy="ddp")
    with pytest.raises(TypeError, match="LightningModule or a function returning one"):
        fit(torch.nn.Linear(2, 2))
    torch.manual_seed(0)
    model = MLPRegressor(hidden=16, depth=1)
    before = model.net.inp.weight.detach().clone()
    trainer = fit(
        model,
        datamodule=RegressionData(num_samples=64),
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    assert trainer is not None and trainer.global_step == 2
    assert trainer.lightning_module is model  # as Trainer.fit: the caller's module is trained
    assert not torch.equal(before, model.net.inp.weight)


# -- the runner ------------------------------------------------------------------------------------------


def _run(run_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "ckless_lightning.run",
        "--nproc-per-node",
        "3",
        f"hydra.run.dir={run_dir}",
        "timeline=false",
        *overrides,
        str(SCRIPT.relative_to(ROOT)),
        "--max-steps",
        str(STEPS),
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
    return result


@pytest.fixture(scope="module")
def clean_script_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    _run(run_dir, "tier=4", "fault=none")
    return run_dir


@pytest.mark.parametrize(
    ("tier", "fault"),
    [
        # a warm spare takes rank 1's place: it runs the script, which restores from rank 1's buddy
        ("4", ("fault=kill", "fault.rank=1", "fault.step=5", "agent.spares=1")),
        # no checkpoint yet: every rank starts over in its own process, from a fresh copy of the module
        ("3", ("fault=exception", "fault.rank=2", "fault.step=3")),
    ],
    ids=["tier4-kill-spare", "tier3-start-over"],
)
@pytest.mark.timeout(600)
def test_the_runner_recovers_a_script_bitwise(tmp_path, clean_script_run, tier, fault) -> None:
    faulted = tmp_path / "faulted"
    result = _run(faulted, f"tier={tier}", *fault)
    assert f"@{fault[1][-1]}" in result.stdout, result.stdout[-3000:]  # the fault's row in the summary
    if tier == "4":
        assert "(0 lost)" in result.stdout, result.stdout[-3000:]
    config = yaml.safe_load((faulted / "config.yaml").read_text())
    assert config["script"] == [str(SCRIPT), "--max-steps", str(STEPS)]
    started = [
        line for line in (faulted / "events.jsonl").read_text().splitlines() if "ranks_started" in line
    ]
    if "agent.spares=1" in fault:
        assert '"warm":[true]' in started[-1], started
    assert read_losses(faulted / "losses.jsonl") == read_losses(clean_script_run / "losses.jsonl")
    final = checkpoint_name(STEPS)
    a = load_full_checkpoint(faulted / "checkpoints" / final, tmp_path)
    b = load_full_checkpoint(clean_script_run / "checkpoints" / final, tmp_path)
    assert assert_bitwise_equal(a, b) > 0


def test_the_runner_says_what_is_wrong_before_ranks_start(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ckless_lightning.run", "elastic.enabled=true", str(SCRIPT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "config error: elastic.enabled=true needs the built-in data pipeline" in result.stderr


UNSHARDED_SCRIPT = """
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from own_module import RegressionData

from ckless_lightning.run import fit


class Unsharded(pl.LightningModule):  # no fully_shard in configure_model: each rank its own copy
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(32, 8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


fit(Unsharded(), datamodule=RegressionData(num_samples=256), max_steps=4, enable_progress_bar=False)
"""


def test_a_mistake_found_in_the_ranks_ends_the_job_with_exit_2_not_retried(tmp_path) -> None:
    """An unsharded module on 2 ranks is found in each rank (at tier 3, inside the recovery loop):
    the same in every generation, so the job ends at once with exit 2 naming the fix, without
    spending the fault budget on restarts."""
    script = tmp_path / "unsharded.py"
    script.write_text(UNSHARDED_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckless_lightning.run",
            f"hydra.run.dir={tmp_path / 'run'}",
            "tier=3",
            "timeline=false",
            str(script),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-4000:]
    assert "exited with a config error" in out and "is not sharded" in out and "fully_shard" in out
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert '"kind":"generation"' not in events  # no recovery was attempted
