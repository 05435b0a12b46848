"""Two nodes, node 1 lost: a standby agent takes its place, against a requeue from the checkpoint.

    python bench/two_nodes.py [--recipe llama3_tiny] [--steps 30] [--every 10] [--fault-step 25]
                              [--node-timeout 5]

Two agents of 2 ranks each (``cluster.nnodes=2``; node 0's agent hosts the job store on
127.0.0.2, not the loopback default, so that no client reaches it by accident), tier 1. At
``--fault-step``, node 1's agent and ranks are SIGKILLed (``fault=node_loss``: a machine gone).
Rows, as in ``bench/recovery.py`` (which prints them beside its one-node rows):

- spare agent: a third agent stands by (``cluster.standby=true``; under Slurm a spare task,
  ``cluster.spare_nodes=1``), claims node 1 once its beats stop for ``agent.node_timeout`` and
  starts its ranks in the job's next generation; node 0's ranks restart with them (tier 1),
  from the last checkpoint.
- requeue: no spare: node 0's agent gives up (``agent.max_restarts=0``, exit 75) and both
  agents are started again in the same run directory, as ``examples/slurm/train.sbatch``'s
  requeue does; the new run resumes from the last checkpoint. The scheduler's own requeue
  latency (Slurm: seconds to minutes, a node to allocate) is not in the figure.

Both rows wait the same ``agent.node_timeout`` to call the node lost; the difference is what
comes after. Seconds, fault to the first step completed after it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ckless_lightning.record.events import read_events
from ckless_lightning.record.summary import FaultRecovery, summarize

ROOT = Path(__file__).resolve().parents[1]
STORE_ADDR = "127.0.0.2"

__all__ = ["two_node_rows"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((STORE_ADDR, 0))
        return sock.getsockname()[1]


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _agent(
    run_dir: Path, base: list[str], node: int, port: int, secret: str, *extra: str
) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        f"hydra.run.dir={run_dir}",
        *base,
        "cluster.nnodes=2",
        "cluster.nproc_per_node=2",
        f"cluster.node_rank={node}",
        f"cluster.master_addr={STORE_ADDR}",
        f"cluster.master_port={port}",
        "cluster.launcher=manual",
        *extra,
    ]
    env = {**os.environ, "CKLESS_JOB_SECRET": secret}  # the agents of one job share it
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _finish(agents: list[subprocess.Popen[str]], timeout: float = 900.0) -> list[tuple[int, str]]:
    results = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=timeout)
            results.append((agent.returncode, out))
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()
    return results


def _failed(what: str, results: list[tuple[int, str]], expected: list[int]) -> str | None:
    codes = [code for code, _ in results]
    if codes == expected:
        return None
    tails = "\n".join(out[-2000:] for code, out in results)
    print(f"{what}: exit codes {codes}, expected {expected}:\n{tails}", file=sys.stderr)
    return f"failed: exit codes {codes} (expected {expected}); see stderr"


def _slowest(events: list[dict[str, Any]], start: str, end: str) -> float | None:
    """The slowest rank's ``start`` -> ``end`` phase among ``events`` (rank_phase events)."""
    begin = {e["rank"]: e["t"] for e in events if e["phase"] == start}
    spans = [e["t"] - begin[e["rank"]] for e in events if e["phase"] == end and e["rank"] in begin]
    return max(spans) if spans else None


def spare_row(run_dir: Path, base: list[str], node_timeout: float) -> tuple[FaultRecovery, float] | str:
    port, secret = _free_port(), secrets.token_hex(32)
    _progress(f"{run_dir.name}: two nodes and a standby agent, node 1 lost")
    extra = (f"agent.node_timeout={node_timeout}",)
    agents = [_agent(run_dir, base, n, port, secret, *extra) for n in (0, 1)]
    agents.append(_agent(run_dir, base, 0, port, secret, *extra, "cluster.standby=true"))
    failed = _failed(run_dir.name, _finish(agents), [0, -9, 0])
    if failed:
        return failed
    events = read_events(run_dir / "events.jsonl")
    # the first fault is the node loss; node 0's agent may report node 1 silent again within it
    fault = summarize(events).faults[0]
    starts = [
        e["t"]
        for e in events
        if e["kind"] == "rank_phase" and e["phase"] == "process_start" and e["gen"] == 1
    ]
    return fault, max(starts) - fault.t_fault


def requeue_row(run_dir: Path, base: list[str], node_timeout: float) -> tuple[FaultRecovery, float] | str:
    port, secret = _free_port(), secrets.token_hex(32)
    _progress(f"{run_dir.name}: two nodes, node 1 lost, no spare: exit 75")
    extra = (f"agent.node_timeout={node_timeout}", "agent.max_restarts=0")
    failed = _failed(
        run_dir.name, _finish([_agent(run_dir, base, n, port, secret, *extra) for n in (0, 1)]), [75, -9]
    )
    if failed:
        return failed
    _progress(f"{run_dir.name}: requeued: both agents again, resuming from the checkpoint")
    again = [arg for arg in base if not arg.startswith("fault")] + ["fault=none"]
    port = _free_port()
    failed = _failed(run_dir.name, _finish([_agent(run_dir, again, n, port, secret) for n in (0, 1)]), [0, 0])
    if failed:
        return failed
    events = read_events(run_dir / "events.jsonl")
    (t_requeue,) = [e["t"] for e in events if e["kind"] == "job_start"][1:]
    first = summarize([e for e in events if e["t"] < t_requeue]).faults[0]
    fault = FaultRecovery(
        index=0,
        t_fault=first.t_fault,
        fault_type=first.fault_type,
        rank=first.rank,
        fault_step=first.fault_step,
        phase=first.phase,
        injected_by=first.injected_by,
        detected_by=first.detected_by,
        detection_s=first.detection_s,
        outcome="requeued",
    )
    phases = [e for e in events if e["kind"] == "rank_phase" and e["t"] >= t_requeue and e["gen"] == 0]
    fault.imports_s = _slowest(phases, "process_start", "imports_done")
    fault.comm_init_s = _slowest(phases, "comm_init_start", "comm_init_done")
    fault.state_load_s = _slowest(phases, "state_load_start", "state_load_done")
    fault.data_ready_s = _slowest(phases, "state_load_done", "data_ready")
    fault.total_s = max(e["t"] for e in phases if e["phase"] == "first_step_done") - fault.t_fault
    resumed = [e["step"] for e in phases if e["phase"] == "state_load_done"]
    if resumed and fault.fault_step is not None:
        fault.resumed_from_step = min(resumed)
        fault.completed_before = fault.fault_step - 1
        fault.steps_lost = max(0, fault.completed_before - fault.resumed_from_step)
    started = max(e["t"] for e in phases if e["phase"] == "process_start")
    return fault, started - fault.t_fault


def two_node_rows(
    work: Path, base: list[str], *, node_timeout: float
) -> list[tuple[str, tuple[FaultRecovery, float] | str]]:
    """The two rows, each from a run in ``work``; ``base``: the recipe, steps, checkpointing and
    ``fault=node_loss fault.node=1 fault.step=S`` overrides (tier 1 is added)."""
    base = [*base, "tier=1"]
    return [
        ("2 nodes: spare agent", spare_row(work / "nodes-spare", base, node_timeout)),
        ("2 nodes: requeue", requeue_row(work / "nodes-requeue", base, node_timeout)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="llama3_tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--fault-step", type=int, default=25)
    parser.add_argument("--node-timeout", type=float, default=5.0)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from recovery import table

    base = [
        f"recipe={args.recipe}",
        f"trainer.max_steps={args.steps}",
        f"checkpoint.every_n_steps={args.every}",
        "trainer.enable_progress_bar=false",
        "fault=node_loss",
        "fault.node=1",
        f"fault.step={args.fault_step}",
    ]
    with tempfile.TemporaryDirectory(prefix="ckless-two-nodes-") as tmp:
        rows = two_node_rows(Path(tmp), base, node_timeout=args.node_timeout)
    print("\n".join(table(rows)))
    print(
        f"\n{args.recipe}, 2 nodes x 2 ranks, tier 1, checkpoint every {args.every} steps, node 1 lost at "
        f"step {args.fault_step}, agent.node_timeout={args.node_timeout:g} s; seconds (the requeue row "
        "leaves out the scheduler's requeue latency)."
    )


if __name__ == "__main__":
    main()
