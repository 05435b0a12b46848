"""A user's own Trainer and LightningModule get in-process recovery from InProcessRecovery's few lines.

tests/user_trainer_script.py builds its own ``pl.Trainer`` and LightningModule
(no recipe, no ``ckless_lightning.training``). The test hosts the job store
(normally in the node agent), starts the ranks itself, and runs the job twice:
without a fault, and with an exception on rank 1 at step 7 (checkpoints every 5
steps, 12 steps). The faulted run must recover in the same processes (one
recovery per rank, tier 3: reload step 5 and redo steps 6-12) and end bitwise
equal to the clean run: parameters, AdamW state and every step's loss.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckless_lightning.comm import JobStore

SECRET = "test-job-secret-0123456789"  # the job store's secret, handed to the ranks
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "user_trainer_script.py"
WORLD_SIZE = 4
STEPS = 12
RUN_TIMEOUT_S = 100.0


def _run_job(out: Path, *, fault_step: int, fault_rank: int = 1) -> list[int]:
    """Host a fresh job store, run every rank of the script to the end; returns the ranks' pids."""
    out.mkdir(parents=True)
    store = JobStore.host("127.0.0.1", 0, secret=SECRET)  # lives as long as this frame
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for rank in range(WORLD_SIZE):
            env = {
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD_SIZE),
                "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),  # unused: the process group forms on the job store
                "CKLESS_STORE_ADDR": "127.0.0.1",
                "CKLESS_STORE_PORT": str(store.port),
                "CKLESS_JOB_SECRET": SECRET,
                "CKLESS_GENERATION": "0",
                "OMP_NUM_THREADS": "1",
            }
            log = open(out / f"rank{rank}.log", "wb")  # closed in finally
            logs.append(log)
            cmd = [
                sys.executable,
                str(SCRIPT),
                "--out",
                str(out),
                "--steps",
                str(STEPS),
                "--fault-step",
                str(fault_step),
                "--fault-rank",
                str(fault_rank),
                "--ckpt-every",
                "5",
            ]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        codes = [proc.poll() for proc in procs]
        if codes != [0] * WORLD_SIZE:
            tails = "\n".join(
                f"--- rank {r} (exit {codes[r]}) ---\n"
                + (out / f"rank{r}.log").read_text(errors="replace")[-4000:]
                for r in range(WORLD_SIZE)
            )
            pytest.fail(f"ranks exited {codes} (None: still running after {RUN_TIMEOUT_S}s)\n{tails}")
        return [proc.pid for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for log in logs:
            log.close()
        del store


def _read(out: Path, rank: int) -> tuple[dict, dict[int, float], dict]:
    final = torch.load(out / f"final_rank{rank}.pt", weights_only=True)
    losses = {int(k): v for k, v in json.loads((out / f"losses_rank{rank}.json").read_text()).items()}
    info = json.loads((out / f"info_rank{rank}.json").read_text())
    return final, losses, info


@pytest.mark.timeout(240)
def test_user_trainer_recovers_in_process_bitwise(tmp_path: Path) -> None:
    clean_dir, fault_dir = tmp_path / "clean", tmp_path / "fault"
    _run_job(clean_dir, fault_step=0)
    fault_pids = _run_job(fault_dir, fault_step=7, fault_rank=1)

    assert (fault_dir / "fault_fired").exists(), "the fault never fired"
    assert not (clean_dir / "fault_fired").exists()
    for out in (clean_dir, fault_dir):
        # Lightning's default names: the recovery below finds step 5 under them.
        names = sorted(p.name for p in (out / "ckpt").iterdir())
        assert names == ["epoch=0-step=10.ckpt", "epoch=0-step=5.ckpt"]
    for rank in range(WORLD_SIZE):
        clean, clean_losses, clean_info = _read(clean_dir, rank)
        faulted, fault_losses, fault_info = _read(fault_dir, rank)

        assert clean_info["recoveries"] == 0
        assert fault_info["recoveries"] == 1, f"rank {rank}: {fault_info}"
        assert fault_info["pid"] == fault_pids[rank], f"rank {rank} ran in a process the test did not start"
        assert clean_info["global_step"] == fault_info["global_step"] == STEPS
        assert clean_info["steps_trained"] == list(range(1, STEPS + 1))
        # Tier 3: step 7 failed after step 6 completed; the step-5 checkpoint was reloaded, 6 redone.
        assert fault_info["steps_trained"] == [*range(1, 7), *range(6, STEPS + 1)], rank

        assert sorted(clean_losses) == sorted(fault_losses) == list(range(1, STEPS + 1)), rank
        for step in range(1, STEPS + 1):
            assert fault_losses[step] == clean_losses[step], f"rank {rank} step {step}"

        for part in ("params", "optim"):
            assert clean[part].keys() == faulted[part].keys(), (rank, part)
            assert clean[part], (rank, part)
            for name, tensor in clean[part].items():
                assert torch.equal(tensor, faulted[part][name]), f"rank {rank} {part} {name} differs"
        # AdamW state: exp_avg, exp_avg_sq and step for every parameter
        assert {k.rsplit(".", 1)[1] for k in clean["optim"]} == {"exp_avg", "exp_avg_sq", "step"}
