"""Jobs under a real (one-host) Slurm: ``srun`` with one agent per task, and ``sbatch`` with
examples/slurm/train.sbatch requeueing after exit 75 (tests/slurm.py starts the cluster)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from checkpoint_utils import assert_same_run
from conftest import ROOT, TINY_REFERENCE, launch_command

from ckless_lightning.record.events import read_events

if TYPE_CHECKING:
    from slurm import SlurmCluster

pytest_plugins = ["slurm"]  # the slurm_cluster fixture (imported here, it would trip ruff's F811)

STEPS = 12
COMMON = (f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=5", "agent.hang_timeout=8")
SECRET = "slurm-test-job-secret-0123456789"
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    assert set(COMMON) - {"agent.hang_timeout=8"} <= set(TINY_REFERENCE)
    return reference_run(*TINY_REFERENCE)  # COMMON's training on one node, 4 ranks, no fault


def kinds(run: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run / "events.jsonl") if e["kind"] == kind]


def job_args(run: Path, data_cache: Path, *overrides: str) -> list[str]:
    """launch.py's arguments as the tests give them, for srun/sbatch (no node rank or count: Slurm's)."""
    return launch_command(run, data_cache, "cluster.nproc_per_node=2", *COMMON, *overrides)[1:]


@pytest.mark.timeout(400)
def test_srun_two_agents_rank_killed_tier4_bitwise(
    slurm_cluster: SlurmCluster, tmp_path, data_cache, reference
):
    run = tmp_path / "run"
    args = job_args(run, data_cache, "tier=4", "fault=kill", "fault.rank=3", "fault.step=8")
    result = slurm_cluster.srun(
        ["-n", "2", sys.executable, *args],
        timeout=300,
        env={**slurm_cluster.env, "CKLESS_JOB_SECRET": SECRET},
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.count("slurm: cluster.node_rank=1 cluster.nnodes=2") == 1, result.stdout[-3000:]
    assert_same_run(run, reference, tmp_path, STEPS)
    starts = kinds(run, "ranks_started")
    assert sorted((e["node"], tuple(e["ranks"])) for e in starts if e["gen"] == 0) == [
        (0, (0, 1)),
        (1, (2, 3)),
    ]
    assert kinds(run, "fault_detected")[0]["rank"] == 3


@pytest.mark.timeout(400)
def test_srun_node_lost_taken_over_by_a_spare_task(
    slurm_cluster: SlurmCluster, tmp_path, data_cache, reference
):
    """srun -n 3 with cluster.spare_nodes=1: two node agents and one standby; node 1's agent and
    ranks are killed at step 8 and the standby task takes its place: no requeue."""
    run = tmp_path / "run"
    args = job_args(
        run, data_cache, "tier=1", "cluster.spare_nodes=1", "fault=node_loss", "fault.node=1", "fault.step=8"
    )
    result = slurm_cluster.srun(
        ["-n", "3", sys.executable, *args, "agent.node_timeout=4"],
        timeout=300,
        env={**slurm_cluster.env, "CKLESS_JOB_SECRET": SECRET},
        cwd=ROOT,
    )
    # srun's own exit status reports the killed task (signal 9); the job itself went on.
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert "standby: node 1 went silent; this agent takes its place" in result.stdout, output
    assert "done" in result.stdout.splitlines(), output
    assert_same_run(run, reference, tmp_path, STEPS)
    assert kinds(run, "fault_injected")[0]["fault_type"] == "node_loss"
    assert len([e for e in kinds(run, "ranks_started") if e["node"] == 1]) == 2


@pytest.mark.timeout(500)
def test_sbatch_requeues_after_exit_75_and_resumes_bitwise(
    slurm_cluster: SlurmCluster, tmp_path, data_cache, reference
):
    """First run: a rank killed with no restart allowed -> exit 75 -> train.sbatch requeues the
    job; the second run (same job id, same run dir) resumes from the step-5 checkpoint."""
    run = tmp_path / "run"
    args = job_args(run, data_cache, "tier=1", "fault=kill", "fault.step=8", "agent.max_restarts=0")
    args = [a for a in args[1:] if not a.startswith("hydra.run.dir=")]  # launch.py's arguments only
    out = tmp_path / "job.out"
    export = f"--export=ALL,CKLESS_PYTHON={sys.executable},CKLESS_RUN_DIR={run}"
    options = ["-n", "2", "--ntasks-per-node=2", export, f"--output={out}"]
    job = slurm_cluster.sbatch(SBATCH, *options, script_args=args, cwd=ROOT)
    state = slurm_cluster.wait_job(job, timeout=400)
    log = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", f"{slurm_cluster.show_job(job)}\n{log[-6000:]}"
    assert slurm_cluster.requeue_count(job) == 1, log[-4000:]
    assert "ckless: exit 75, requeueing job" in log and "resuming from" in log, log[-4000:]
    assert_same_run(run, reference, tmp_path, STEPS)
    # The first run gave up, once, for one reason; each agent that saw it before node 0's store
    # closed records it (agent0, and agent1 unless it found the store gone first).
    giveups = kinds(run, "giveup")
    assert giveups and len({e["reason"] for e in giveups}) == 1, giveups
    assert {e["source"] for e in giveups} <= {"agent0", "agent1"}, giveups
    second_run = kinds(run, "job_start")[-1]["t"]
    assert len(kinds(run, "job_start")) == 2 and all(e["t"] < second_run for e in giveups), giveups
