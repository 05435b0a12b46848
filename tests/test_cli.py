"""launch.py as a user runs it: bad input fails before any rank starts, dry run prints the plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT


def launch(
    tmp_path: Path, *overrides: str, timeout: float = 120, python_flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    run_dir = tmp_path / "run"
    return subprocess.run(
        [sys.executable, *python_flags, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", *overrides],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


def assert_no_rank_started(tmp_path: Path) -> None:
    assert not list((tmp_path / "run").glob("rank_logs/rank*.log")), "a rank was started"


def assert_nothing_started(tmp_path: Path) -> None:
    """A config that fails validation starts nothing, not even the fork server."""
    assert_no_rank_started(tmp_path)
    assert not list((tmp_path / "run").glob("rank_logs/forkserver*.log")), "the fork server was started"


@pytest.mark.timeout(120)
def test_unknown_recipe_lists_available(tmp_path):
    result = launch(tmp_path, "recipe=llama3_7b")
    assert result.returncode != 0
    assert "llama3_7b" in result.stderr
    for name in ("llama3_8b", "llama3_tiny", "mixtral_8x7b", "mixtral_tiny"):
        assert name in result.stderr
    assert_no_rank_started(tmp_path)


@pytest.mark.timeout(120)
def test_mesh_not_dividing_world_fails_before_ranks(tmp_path):
    result = launch(tmp_path, "cluster.replicate=3")
    assert result.returncode == 2
    assert "cluster.replicate=3" in result.stderr and "cluster.nproc_per_node=4" in result.stderr
    assert_nothing_started(tmp_path)


@pytest.mark.timeout(120)
def test_missing_data_path_names_the_path(tmp_path):
    missing = tmp_path / "no_such_corpus.jsonl"
    result = launch(tmp_path, f"data.source={missing}")
    assert result.returncode == 2
    assert str(missing) in result.stderr and "data.source" in result.stderr
    assert_no_rank_started(tmp_path)


@pytest.mark.timeout(120)
def test_recipe_that_does_not_fit_is_refused_with_plan(tmp_path):
    result = launch(tmp_path, "recipe=llama3_70b", "trainer.max_steps=10", "data.seq_len=512")
    assert result.returncode == 3
    assert "70.55B" in result.stderr and "dry_run=true" in result.stderr
    assert "no GPU here" in result.stderr and "recipe=llama3_tiny" in result.stderr
    assert_no_rank_started(tmp_path)


@pytest.mark.timeout(120)
def test_dry_run_prints_plan_and_exits_zero(tmp_path):
    result = launch(tmp_path, "recipe=mixtral_8x22b", "dry_run=true")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "140.63B" in out and "world size:   128" in out and "replicate=1 x shard=128" in out
    assert "optimizer state" in out and "torchrun" in out
    assert (tmp_path / "run" / "config.yaml").exists()
    assert_no_rank_started(tmp_path)


@pytest.mark.timeout(120)
def test_cfg_job_prints_composed_config(tmp_path):
    result = launch(tmp_path, "recipe=llama3_70b_long", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "seq_len: 16384" in result.stdout and "dim: 8192" in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["agent.hang_timeout=-5"], "agent.hang_timeout"),
        (["fault=kill", "fault.type=explode"], "fault.type"),
        (["fault=kill", "fault.rank=4"], "fault.rank"),
        (["fault=node_loss"], "cluster.nnodes"),
        (["tier=4", "replication.source=hsdp"], "cluster.replicate >= 2"),
        (["tier=2", "fault=kill", "fault.phase=recovery"], "fault.phase=recovery"),
        (["cluster.replicate=2", "fault=bitflip", "fault.tensor=no.such"], "fault.tensor='no.such'"),
    ],
)
def test_bad_agent_and_fault_config_fails_before_ranks(tmp_path, overrides, named):
    result = launch(tmp_path, *overrides)
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
    if "fault=bitflip" in overrides:  # checked against the model's names: after the fork server started
        assert_no_rank_started(tmp_path)
    else:
        assert_nothing_started(tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["trainer.max_steps=ten"], "trainer.max_steps must be an integer, got 'ten'"),
        (["data.source=/nonexistent"], "data.source='/nonexistent'"),
        (["tier=4", "cluster.nproc_per_node=1"], "use tier=3"),
        (["trainer.max_step=10"], "did you mean trainer.max_steps?"),
        (["model.dimm=64"], "did you mean model.dim?"),
        (["recipe=llama3_tinyy"], "did you mean recipe=llama3_tiny?"),
        (["fault=kil"], "did you mean fault=kill?"),  # an optional group once ran without the fault
        (["cluster=local_gpu"], "did you mean cluster=local_cpu?"),
        (["trainer.max_steps"], "write KEY=VALUE"),
    ],
)
def test_a_mistake_is_a_config_error_before_torch_is_imported(tmp_path, overrides, said):
    """Every bad input is exit 2 with a message naming the key and a fix, reported before the fork
    server, the data or any rank starts, and without importing torch (so in about a second)."""
    result = launch(tmp_path, *overrides, python_flags=("-X", "importtime"))
    message = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2, "\n".join(message)
    assert any(line.startswith("config error: ") and said in line for line in message), message
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "lightning" not in imported
    assert_nothing_started(tmp_path)


@pytest.mark.timeout(120)
def test_help_lists_recipes_tiers_faults_and_exit_codes(tmp_path):
    result = launch(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for recipe in sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")):
        assert recipe in out
    for said in ("Tiers", "fault: bitflip, chaos", "logger: csv", "cluster.replicate", "Exit codes", "75"):
        assert said in out
    assert out.count("python launch.py recipe=") >= 2 and "--config-dir DIR" in out
