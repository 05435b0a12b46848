"""Self-test of tests/slurm.py's private one-host Slurm cluster: srun tasks, and a batch job that
requeues itself (the pattern of examples/slurm/train.sbatch: exit 75 -> ``scontrol requeue``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from slurm import SlurmCluster

pytest_plugins = ["slurm"]  # the slurm_cluster fixture (imported here, it would trip ruff's F811)


@pytest.mark.timeout(120)
def test_srun_two_tasks(slurm_cluster: SlurmCluster) -> None:
    result = slurm_cluster.srun(
        ["-n", "2", "bash", "-c", "echo $SLURM_PROCID $SLURM_NTASKS $SLURM_JOB_NODELIST"], timeout=60
    )
    assert result.returncode == 0, result.stderr
    node = slurm_cluster.node
    assert sorted(result.stdout.splitlines()) == [f"0 2 {node}", f"1 2 {node}"], result.stderr


REQUEUE_SCRIPT = """\
#!/bin/bash
echo "run SLURM_RESTART_COUNT=${{SLURM_RESTART_COUNT:-unset}}" >> {runs}
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
    # What train.sbatch does when launch.py exits 75: the job requeues itself. slurmctld then
    # cancels this run (SIGTERM), so the lines below may not run; the exit code does not matter.
    scontrol requeue "$SLURM_JOB_ID"
    exit 75
fi
srun -n 2 bash -c 'echo step $SLURM_PROCID' >> {runs}  # a job step in the requeued run
echo "restart $SLURM_RESTART_COUNT" > {done}
exit 0
"""


@pytest.mark.timeout(180)
def test_batch_job_requeues_itself(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    runs, done = tmp_path / "runs.log", tmp_path / "done"
    script = tmp_path / "job.sbatch"
    script.write_text(REQUEUE_SCRIPT.format(runs=runs, done=done))
    start = time.monotonic()
    job = slurm_cluster.sbatch(
        script, "--requeue", "-n", "2", "--open-mode=append", f"--output={tmp_path / 'job.out'}"
    )
    state = slurm_cluster.wait_job(job, timeout=120)
    elapsed = time.monotonic() - start
    log = runs.read_text() if runs.exists() else ""
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    info = f"{slurm_cluster.show_job(job)}\nruns.log:\n{log}\njob.out:\n{output}"
    assert state == "COMPLETED", info
    assert slurm_cluster.requeue_count(job) == 1, info
    assert done.read_text() == "restart 1\n", info
    assert log.splitlines()[:2] == ["run SLURM_RESTART_COUNT=unset", "run SLURM_RESTART_COUNT=1"], info
    assert sorted(log.splitlines()[2:]) == ["step 0", "step 1"], info
    # A requeued job may start again only cred_expire + 1 s after the requeue.
    assert elapsed < slurm_cluster.cred_expire + 60, info
