"""bench/control_plane.py: a small simulated job runs, its counts add up, and the scale model reads them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


@pytest.mark.timeout(180)
def test_a_simulated_job_of_16_ranks_recovers_and_its_rows_feed_the_scale_model(tmp_path: Path) -> None:
    """Two nodes of 8 simulated ranks voting through the store (``--vote wait``, ``comm.vote=store``),
    one killed, each node in a worker process of its own: every
    rank reaches the next generation, the store requests of both workers are counted (votes, the
    agents' looks and what they publish), and ``scale_model.py --measured`` takes the rows as
    measured inputs."""
    rows_path = tmp_path / "rows.json"
    run = subprocess.run(
        [sys.executable, str(BENCH / "control_plane.py"), "--ranks", "16", "--steps", "12",
         "--kill-step", "8", "--step-ms", "20", "--procs", "2", "--vote", "wait", "--json", str(rows_path)],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(rows_path.read_text())
    assert (row["ranks"], row["nodes"], row["procs"], row["watch_nodes"]) == (16, 2, 2, 1)
    assert row["step_s"] >= 0.02 and row["agent_requests_per_node_s_counted"] >= 0
    kinds = row["requests_by_kind"]
    # Each rank-step: a vote (add, then a blocking wait and a get); the agents' looks on top. The two
    # heartbeats go to the node's board, and each agent publishes its ranks' changed beats once a pass
    # (multi_set; the steady window, 2 steps of 20 ms, may hold no pass). The tier-4 fingerprint stays
    # with the rank and its buddy's copy: no set per rank-step (it was one before 2026-12-06).
    assert kinds["add"] >= 1 and kinds.get("set", 0) < 0.5, kinds
    # A waiting vote blocks in the store (one wait and one get), it does not poll: the checks left
    # are the agents' looks (one per pass for all nodes).
    assert kinds["wait"] > 0 and kinds.get("check", 0) < 0.5, kinds
    assert row["store_requests_per_rank_step"] >= 2.5
    # The ranks' own share (the vote) per rank-step, and the agents' per node and second: together all
    assert 2.5 <= row["rank_requests_per_rank_step"] <= row["store_requests_per_rank_step"]
    assert row["agent_requests_per_node_s"] >= 0
    assert 0 < row["vote_p50_s"] <= row["vote_p99_s"]
    assert 0 < row["recovery_s"] < 30 and row["recovery_store_requests"] > 16
    # Through the node relays (the default): the store's part ends when the last agent saw the barrier
    assert 0 < row["recovery_store_s"] <= row["recovery_s"]
    assert "req/rank-step" in run.stdout

    model = subprocess.run(
        [sys.executable, str(BENCH / "scale_model.py"), "--measured", str(rows_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert model.returncode == 0, model.stderr
    line = next(line for line in model.stdout.splitlines() if line.startswith("vote_trips"))
    assert "measured" in line and "bench/control_plane.py, 16 simulated ranks" in line
    assert "the ranks' store requests per rank-step" in line
    line = next(line for line in model.stdout.splitlines() if line.startswith("agent_rps_per_node"))
    assert "measured" in line and "per node and second" in line


@pytest.mark.timeout(180)
def test_the_collective_vote_spans_the_simulators_worker_processes(tmp_path: Path) -> None:
    """``--vote collective`` over 2 worker processes: the vote's stand-in meets across them (every
    step of every rank decided, its two parts measured), the ranks send the store nothing in the
    steady state, a death in one worker fails the pending votes of the other (every rank joins the
    next generation), and the simulator's own CPU per rank-step is printed beside the vote."""
    rows_path = tmp_path / "rows.json"
    run = subprocess.run(
        [sys.executable, str(BENCH / "control_plane.py"), "--ranks", "16", "--steps", "12",
         "--kill-step", "8", "--step-ms", "20", "--procs", "2", "--vote", "collective",
         "--json", str(rows_path)],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(rows_path.read_text())
    assert row["procs"] == 2 and row["rank_requests_per_rank_step"] == 0, row["requests_by_kind"]
    assert 0 <= row["vote_skew_p50_s"] <= row["vote_skew_p99_s"] and row["vote_release_p99_s"] >= 0
    assert 0 < row["recovery_store_s"] <= row["recovery_s"] < 30
    # A recovery's store work is per node (the relays), not per rank
    assert 0 < row["recovery_store_requests_per_node"] <= 40
    # (CPU time is read in clock ticks, 10 ms: a steady window of 3 steps of 20 ms may read none)
    assert row["sim_cpu_per_rank_step_s"] >= 0 and row["cores"] >= 1
    assert "the simulator's own load" in run.stdout and "2 worker process(es)" in run.stdout


def test_the_thread_wake_floor_prints_each_size_beside_the_smallest() -> None:
    """``bench/thread_wake.py``, the simulator's floor quoted beside the vote: each size's wake-up
    of every thread timed, with its ratio to the smallest (the baseline)."""
    run = subprocess.run(
        [sys.executable, str(BENCH / "thread_wake.py"), "--threads", "4", "2", "--trials", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[1].split()[0] == "2" and lines[1].endswith("1.0x") and lines[2].split()[0] == "4"
    assert "baseline: 2 threads" in lines[-1]
    bad = subprocess.run(
        [sys.executable, str(BENCH / "thread_wake.py"), "--threads", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "--threads and --trials must be at least 1" in bad.stderr
