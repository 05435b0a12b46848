"""Recovery time by tier, side by side with the torchrun baseline, from one run of this script.

    python bench/recovery.py [--recipe llama3_tiny] [--steps 30] [--every 10] [--fault-step 25]

Every row trains the same recipe on 4 local ranks with a checkpoint every
``--every`` steps and one SIGKILL of rank 1 in step ``--fault-step``, then
reads the job's ``events.jsonl``. Rows:

- torchrun: ``torchrun --standalone --max-restarts 3`` over the same rank entry
  point and config, resuming from Lightning's last checkpoint: what a user
  would run today;
- tier 0: our agent, all ranks restarted cold, rendezvous through rank 0;
- tier 1: the job store in the agent, process groups per generation prefix;
- tier 1 + spares: as tier 1, and the restarted ranks are warm spares (imports done).

Columns (seconds): detect = fault to the agent's detection; restart = fault to
the last new process started; imports, comm init, ckpt load (model build +
checkpoint restore), data ready = the slowest new rank's phase; lost = steps
redone; total = fault to the first completed step after it. torchrun does not
report its detection, so its row has none. On torch 2.13 with gloo, torchrun's
restarted workers fail to re-form the process group (connectFullMesh refused:
they read the previous attempt's addresses); the row then says so. The
machine is shared and noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from ckless_lightning.events import EventLog, read_events
from ckless_lightning.loss_log import read_loss_records
from ckless_lightning.summary import FaultRecovery, summarize

ROOT = Path(__file__).resolve().parents[1]


def job_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"recipe={args.recipe}",
        f"trainer.max_steps={args.steps}",
        f"checkpoint.every_n_steps={args.every}",
        "trainer.enable_progress_bar=false",
        "fault=kill",
        "fault.rank=1",
        f"fault.step={args.fault_step}",
    ]


def run_ours(run_dir: Path, args: argparse.Namespace, *extra: str) -> tuple[FaultRecovery, float]:
    cmd = [sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", *job_overrides(args), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return only_fault(run_dir)


def run_torchrun(run_dir: Path, args: argparse.Namespace) -> tuple[FaultRecovery, float] | str:
    """The same job under torchrun: write the resolved config with a dry run, then start the ranks."""
    dry = [sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", *job_overrides(args)]
    dry.append("dry_run=true")
    subprocess.run(dry, check=True, capture_output=True)
    log = EventLog(run_dir / "events.jsonl", source="bench")
    log.emit("job_start", tier="torchrun", world_size=4, nnodes=1)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "--max-restarts=3",
        "-m",
        "ckless_lightning.rank",
        "--config",
        str(run_dir / "config.yaml"),
    ]
    try:
        result = subprocess.run(
            cmd, capture_output=True, text=True, cwd=run_dir, timeout=args.torchrun_timeout
        )
    except subprocess.TimeoutExpired as err:
        output = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else str(err.stderr)
        return _torchrun_failure(output, f"no result after {args.torchrun_timeout:g} s")
    if result.returncode:
        return _torchrun_failure(result.stderr, f"exit code {result.returncode}")
    log.emit("job_end", exit_code=0)
    # torchrun numbers its restarts (TORCHELASTIC_RESTART_COUNT, our ranks' "gen") but does not
    # log them: mark generation 1 where its first process started, so the summary can split phases.
    starts = [
        e["t"]
        for e in read_events(run_dir / "events.jsonl")
        if e["kind"] == "rank_phase" and e["phase"] == "process_start" and e["gen"] == 1
    ]
    log.emit("generation", gen=1, reason="torchrun restart", t=min(starts))
    return only_fault(run_dir)


def _torchrun_failure(output: str, how: str) -> str:
    """Why torchrun did not recover, in one line (its restarted workers' first error)."""
    errors = [line.strip() for line in output.splitlines() if "Error:" in line and "peer" not in line]
    return f"did not recover ({how}): {errors[0][:150] if errors else 'see its output'}"


def only_fault(run_dir: Path) -> tuple[FaultRecovery, float]:
    """The run's one fault, and the time from it to the last process of generation 1 started."""
    events = read_events(run_dir / "events.jsonl")
    summary = summarize(events, read_loss_records(run_dir / "losses.jsonl"))
    assert len(summary.faults) == 1, f"{run_dir}: expected one fault, got {len(summary.faults)}"
    fault = summary.faults[0]
    starts = [
        e["t"]
        for e in events
        if e["kind"] == "rank_phase" and e["phase"] == "process_start" and e["gen"] == 1
    ]
    return fault, max(starts) - fault.t_fault


def fmt(value: float | None) -> str:
    return f"{value:9.2f}" if value is not None else f"{'-':>9}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="llama3_tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--fault-step", type=int, default=25)
    parser.add_argument("--torchrun-timeout", type=float, default=180.0)
    args = parser.parse_args()

    rows: list[tuple[str, tuple[FaultRecovery, float] | str]] = []
    with tempfile.TemporaryDirectory(prefix="ckless-recovery-") as tmp:
        work = Path(tmp)
        rows.append(("torchrun --max-restarts", run_torchrun(work / "torchrun", args)))
        rows.append(("tier 0", run_ours(work / "tier0", args, "tier=0")))
        rows.append(("tier 1", run_ours(work / "tier1", args, "tier=1")))
        rows.append(("tier 1 + 4 spares", run_ours(work / "tier1s", args, "tier=1", "agent.spares=4")))

    header = ("setup", "detect", "restart", "imports", "comm", "ckpt load", "data", "lost", "total")
    print(f"{header[0]:<24}" + "".join(f"{h:>10}" for h in header[1:]))
    for name, row in rows:
        if isinstance(row, str):
            print(f"{name:<24} {row}")
            continue
        f, restart = row
        cells = (f.detection_s, restart, f.imports_s, f.comm_init_s, f.state_load_s, f.data_ready_s)
        lost = f"{f.steps_lost:>10}" if f.steps_lost is not None else f"{'-':>10}"
        print(f"{name:<24}" + "".join(f" {fmt(c)}" for c in cells) + lost + f" {fmt(f.total_s)}")
    print(
        f"\n{args.recipe}, 4 ranks, checkpoint every {args.every} steps, SIGKILL of rank 1 in step "
        f"{args.fault_step}; seconds."
    )


if __name__ == "__main__":
    main()
