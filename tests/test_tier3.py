"""Tier 3 on 4 CPU ranks: in-process recovery, bitwise equal to the fault-free run.

Each model trains 12 steps with a checkpoint every 2; one run per model carries
a plan of seven faults, one in every phase of a step plus one during a recovery,
mixing exceptions (the rank stays alive and recovers in-process), kills (the
agent gives the rank to a warm spare) and, for Mixtral, a hang (the agent kills
it). Every recovery reloads the last disk checkpoint, so the run must end with
the same weights, optimizer state and per-step losses, bit for bit, as the
fault-free reference; surviving ranks keep their process throughout.
"""

from __future__ import annotations

import re
import socket
from collections import defaultdict
from pathlib import Path

import pytest
from checkpoint_utils import assert_same_run
from conftest import launch_job, left_behind_traces, uncut_ranks
from test_agent import events_of, free_port, job_processes

from ckless_lightning.record.summary import summarize_run

STEPS = 12
COMMON = (
    f"trainer.max_steps={STEPS}",
    "checkpoint.every_n_steps=2",
    "tier=3",
    "agent.hang_timeout=6",
    "agent.max_restarts=10",
)

# One fault per phase, in step order; "recovery" fires while the job recovers from the fault before it.
PLANS = {
    "llama3_tiny": [
        ("exception", 1, 3, "data"),
        ("kill", 2, 4, "forward"),
        ("exception", 3, 5, "backward"),
        ("kill", 0, 6, "grad_reduction"),
        ("exception", 1, 7, "commit"),
        ("kill", 3, 9, "optimizer"),
        ("exception", 2, 9, "recovery"),
    ],
    "mixtral_tiny": [
        ("kill", 1, 3, "data"),
        ("exception", 2, 4, "forward"),
        ("hang", 3, 5, "backward"),
        ("exception", 0, 6, "grad_reduction"),
        ("kill", 1, 7, "commit"),
        ("exception", 2, 9, "optimizer"),
        ("kill", 0, 9, "recovery"),
    ],
}


# The srun hint shows only where Slurm is installed (CI installs it for tests/test_slurm.py).
KNOWN_NOISE = re.compile(
    r"💡 Tip|`isinstance\(treespec, LeafSpec\)` is deprecated|exists and is not empty"
    r"|The `srun` command is available on your system but is not used"
)


def plan_override(plan: list[tuple[str, int, int, str]]) -> str:
    entries = ",".join(f"{{type:{t},rank:{r},step:{s},phase:{p}}}" for t, r, s, p in plan)
    return f"fault.plan=[{entries}]"


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_cache) -> dict[str, Path]:
    runs = {}
    for recipe in PLANS:
        run = tmp_path_factory.mktemp(f"reference-{recipe}")
        launch_job(run, data_cache, f"recipe={recipe}", *COMMON)
        runs[recipe] = run
    return runs


def pids_by_rank(run: Path) -> dict[int, list[int]]:
    """Each rank's process ids, in order of the generations it joined."""
    pids: dict[int, list[int]] = defaultdict(list)
    joined = [e for e in events_of(run, "rank_phase") if e["phase"] == "generation_joined"]
    for event in sorted(joined, key=lambda e: (e["gen"], e["t"])):
        if not pids[event["rank"]] or pids[event["rank"]][-1] != event["pid"]:
            pids[event["rank"]].append(event["pid"])
    return pids


@pytest.mark.timeout(900)
@pytest.mark.parametrize("recipe", list(PLANS))
def test_fault_in_every_phase_recovers_in_process_bitwise(tmp_path, data_cache, references, recipe):
    run, port = tmp_path / "run", free_port()
    plan = PLANS[recipe]
    result = launch_job(
        run,
        data_cache,
        f"recipe={recipe}",
        *COMMON,
        "fault=plan",
        plan_override(plan),
        f"cluster.master_port={port}",
        timeout=600,
    )
    assert_same_run(run, references[recipe], tmp_path, STEPS)
    # Known third-party noise is filtered at its source, in every generation of every rank.
    outputs = [result.stdout, result.stderr, *(p.read_text() for p in (run / "rank_logs").glob("*.log"))]
    noise = [line for text in outputs for line in text.splitlines() if KNOWN_NOISE.search(line)]
    assert not noise, noise[:5]

    injected = events_of(run, "fault_injected")
    assert sorted((e["fault_type"], e["rank"], e["step"], e["phase"]) for e in injected) == sorted(plan)
    summary = summarize_run(run)
    # A fault nobody injected (an innocent rank killed as hung, a rank left behind): where each rank
    # said it was, and the agent's and ranks' own words, for whoever reads a rare failure.
    detected = [
        {k: e.get(k) for k in ("rank", "reason", "where", "stale_ranks")}
        for e in events_of(run, "fault_detected")
    ]
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((run / "rank_logs").glob("rank*.log"))
    )
    # A rank the generation watch cut and could not free (the open gloo case,
    # docs/troubleshooting.md) is replaced like a hung rank: its rows are no planned fault's.
    uncut = uncut_ranks(run)
    if uncut:
        print(f"ranks {sorted(uncut)} were not freed by their cut:\n{left_behind_traces(run)}\n{logs}")
    faults = [f for f in summary.faults if not (f.rank in uncut and f.injected_by is None)]
    assert summary.exit_code == 0 and len(faults) == len(plan), (
        f"{summary.format()}\n{detected}\n{result.stderr[-3000:]}\n{logs}"
    )
    for fault in summary.faults:  # a recovery-phase fault supersedes, or joins, the recovery it hit
        assert fault.recovered or fault.outcome.startswith(("superseded", "handled in")), summary.format()

    # Survivors keep their process: a rank changes pid once per kill or hang that hit it, never else.
    replaced = defaultdict(int)
    for fault_type, rank, _, _ in plan:
        if fault_type in ("kill", "hang"):
            replaced[rank] += 1
    pids = pids_by_rank(run)
    for rank in uncut:
        replaced[rank] += 1
    for rank in range(4):
        assert len(pids[rank]) == 1 + replaced[rank], (rank, pids[rank], plan)

    # Every process that trained to the end holds no process group (of any generation) and no more
    # connections than one generation's group (a gloo pair per peer). Whether gloo has closed the last
    # group's pairs when the rank reports is timing: a fault-free rank was seen with 0 and with 3 (its
    # pairs to every peer), so the bound is one mesh, never the fault-free run's count. Listening
    # sockets and threads are not compared: gloo keeps a process-wide TCP transport (2 listeners,
    # ~6 threads) from the first recovery on.
    ends = {e["rank"]: e for e in events_of(run, "rank_end")}
    reference_ends = {e["rank"]: e for e in events_of(references[recipe], "rank_end")}
    reference_connected = [[s for s in e["tcp_states"] if s != "LISTEN"] for e in reference_ends.values()]
    one_mesh = max(4 - 1, *map(len, reference_connected))
    for rank in range(4):
        assert ends[rank]["process_groups"] == 0, ends[rank]
        # Not compared: their states (a peer that already exited leaves one in CLOSE_WAIT).
        connected = [s for s in ends[rank]["tcp_states"] if s != "LISTEN"]
        assert len(connected) <= one_mesh, (
            f"rank {rank}: {ends[rank].get('tcp_peers')} threads {ends[rank].get('thread_names')}; "
            f"fault-free: {reference_ends[rank].get('tcp_peers')}\n{summary.format()}\n{detected}"
        )
    assert not job_processes(run), [p.info["cmdline"] for p in job_processes(run)]
    with socket.socket() as sock:  # the job store's port is free again
        sock.bind(("127.0.0.1", port))


@pytest.mark.timeout(600)
def test_commit_vote_is_cast_every_step(references):
    """Fault-free: every rank cast one vote per optimizer step and recovered never."""
    votes = events_of(references["llama3_tiny"], "commit_votes")
    assert sorted(e["rank"] for e in votes) == [0, 1, 2, 3]
    assert all(e["votes"] == STEPS and e["recoveries"] == 0 for e in votes), votes
