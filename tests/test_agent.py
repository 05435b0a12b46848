"""The agent at tiers 0 and 1 on 4 CPU ranks: faults recovered, bitwise equal to the fault-free run.

Every run trains llama3_tiny for 12 steps with a checkpoint every 5; faults hit
step 8, so the job resumes from step 5 and redoes steps 6-7. A recovered run
must end with the same weights, optimizer state and per-step losses, bit for
bit, as the fault-free reference.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from checkpoint_utils import assert_same_run
from conftest import TINY_REFERENCE, launch_command, launch_job

from ckless_lightning.agent.processes import failure_report
from ckless_lightning.record.events import read_events

STEPS = 12
JOB_SECRET = "two-node-test-secret-0123456789"
COMMON = (f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=5", "agent.hang_timeout=8")


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    assert set(COMMON) - {"agent.hang_timeout=8"} <= set(TINY_REFERENCE)
    return reference_run(*TINY_REFERENCE)  # COMMON's training, fault-free


def assert_same_training(run: Path, reference: Path, scratch: Path) -> None:
    assert_same_run(run, reference, scratch, STEPS)


def events_of(run: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run / "events.jsonl") if e["kind"] == kind]


def job_processes(run: Path) -> list[psutil.Process]:
    """Live processes that belong to the job in ``run`` (by their command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(run) in cmdline and "pytest" not in cmdline:
            found.append(proc)
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("tier", "fault", "injected_by", "rank"),
    # Each fault type once per injector; tiers 3-4 (test_tier3/4.py) cover them again in-process.
    # Rank 0 killed at tier 1: the job store lives in the agent, not in rank 0, and survives.
    [
        (0, "kill", "inside", 1),
        (0, "exception", "inside", 1),
        (1, "kill", "outside", 0),
        (1, "hang", "outside", 2),
    ],
)
def test_fault_recovers_bitwise(tmp_path, data_cache, reference, tier, fault, injected_by, rank):
    run = tmp_path / "run"
    launch_job(
        run,
        data_cache,
        *COMMON,
        f"tier={tier}",
        f"fault={fault}",
        f"fault.rank={rank}",
        "fault.step=8",
        f"fault.injected_by={injected_by}",
        # A hang (SIGSTOP) is found by the rank's process state within a pass or two, not after
        # agent.hang_timeout: with a 60 s bound, a detection by timeout would fail the check below.
        *(["agent.hang_timeout=60"] if fault == "hang" else []),
    )
    assert_same_training(run, reference, tmp_path)

    injected = events_of(run, "fault_injected")
    assert [(e["rank"], e["step"], e["injected_by"]) for e in injected] == [(rank, 8, injected_by)]
    detected = events_of(run, "fault_detected")
    assert detected and detected[0]["rank"] == rank, detected
    assert detected[0]["reason"] == ("hang" if fault == "hang" else "exit"), detected
    if fault == "hang":
        assert detected[0]["completed_step"] == 7 and detected[0]["stopped"] is True, detected
        # found by its process state within a pass or two; agent.hang_timeout=60 would take 60 s
        # (the margin is for a loaded machine)
        assert detected[0]["t"] - injected[0]["t"] <= 15.0, "a stopped rank must be found by its state"
    loads = [e for e in events_of(run, "rank_phase") if e["phase"] == "state_load_done" and e["gen"] == 1]
    assert sorted(e["rank"] for e in loads) == [0, 1, 2, 3] and {e["step"] for e in loads} == {5}
    if tier == 1:
        inits = [e for e in events_of(run, "rank_phase") if e["phase"] == "comm_init_done"]
        assert {e["gen"] for e in inits} == {0, 1}
    assert not job_processes(run), [p.info["cmdline"] for p in job_processes(run)]


@pytest.mark.timeout(600)
def test_rank_stopped_during_startup_is_replaced(tmp_path, data_cache, reference):
    """SIGSTOP to a rank before its first step: found at once (not after agent.startup_timeout)."""
    run = tmp_path / "run"
    job = subprocess.Popen(
        launch_command(run, data_cache, *COMMON, "tier=1", "agent.startup_timeout=600"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "events.jsonl").exists() or not events_of(run, "ranks_started"):
            assert job.poll() is None and time.monotonic() < deadline, "no ranks_started event"
            time.sleep(0.05)
        pid = events_of(run, "ranks_started")[0]["pids"][3]
        stopped_at = time.time()
        psutil.Process(pid).suspend()
        _, stderr = job.communicate(timeout=300)
        assert job.returncode == 0, stderr[-3000:]
    finally:
        job.kill()
    detection = events_of(run, "fault_detected")[0]
    assert (detection["rank"], detection["completed_step"], detection["stopped"]) == (3, -1, True)
    assert detection["t"] - stopped_at <= 15.0  # by its process state: agent.startup_timeout is 600 s
    assert_same_training(run, reference, tmp_path)
    assert not job_processes(run)


@pytest.mark.timeout(600)
def test_fault_budget_spent_exits_75_and_leaves_nothing(tmp_path, data_cache):
    run = tmp_path / "run"
    port = free_port()
    result = launch_job(
        run,
        data_cache,
        *COMMON,
        "tier=1",
        "fault=kill",
        "fault.step=3",
        "agent.max_restarts=0",
        f"cluster.master_port={port}",
        expect=75,
    )
    reasons = [line for line in result.stderr.splitlines() if line.startswith("giving up:")]
    assert len(reasons) == 1 and "agent.max_restarts=0" in reasons[0]
    assert events_of(run, "giveup")
    assert not job_processes(run)
    with socket.socket() as sock:  # the job store's port is free again
        sock.bind(("127.0.0.1", port))


def start_node(
    run: Path, data_cache: Path, node: int, port: int, *overrides: str, nnodes: int = 2
) -> subprocess.Popen[str]:
    """Node ``node`` of ``nnodes`` (of 4 ranks in all) of the job in ``run``."""
    # Node 0's agent hosts the store on 127.0.0.2, not 127.0.0.1: a wrong address or bind shows.
    layout = (
        f"cluster.nnodes={nnodes}",
        f"cluster.nproc_per_node={4 // nnodes}",
        f"cluster.node_rank={node}",
        "cluster.master_addr=127.0.0.2",
    )
    return subprocess.Popen(
        launch_command(run, data_cache, *layout, f"cluster.master_port={port}", *COMMON, *overrides),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "CKLESS_JOB_SECRET": JOB_SECRET},  # the nodes of one job share it
    )


def finish(node: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str]:
    try:
        out, _ = node.communicate(timeout=timeout)
    finally:
        node.kill()
    return node.returncode, out


@pytest.mark.timeout(600)
def test_two_nodes_rank_killed_on_node1(tmp_path, data_cache, reference):
    run, port = tmp_path / "run", free_port()
    nodes = [
        start_node(run, data_cache, n, port, "tier=1", "fault=kill", "fault.rank=3", "fault.step=8")
        for n in (0, 1)
    ]
    results = [finish(node) for node in nodes]
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert_same_training(run, reference, tmp_path)
    assert events_of(run, "fault_detected")[0]["by"] == "agent1"
    assert not job_processes(run)


@pytest.mark.timeout(600)
def test_two_nodes_node1_lost_and_replaced(tmp_path, data_cache, reference):
    run, port = tmp_path / "run", free_port()
    overrides = ("tier=1", "fault=node_loss", "fault.node=1", "fault.step=8")
    node0 = start_node(run, data_cache, 0, port, *overrides)
    node1 = start_node(run, data_cache, 1, port, *overrides)
    try:
        code1, _ = finish(node1)
        assert code1 == -signal.SIGKILL  # node 1's agent was killed with its ranks
        time.sleep(1.0)
        replacement = start_node(run, data_cache, 1, port, *overrides)  # the scheduler brings a new node
        results = [finish(node0), finish(replacement)]
    finally:
        node0.kill()
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert_same_training(run, reference, tmp_path)
    assert events_of(run, "fault_injected")[0]["fault_type"] == "node_loss"
    assert not job_processes(run)


@pytest.mark.timeout(600)
def test_node_lost_and_taken_over_by_a_standby_agent(tmp_path, data_cache, reference):
    """Four nodes of one rank and a fifth agent standing by (cluster.standby=true); each agent
    watches one other (agent.watch_nodes=1: node n watches n + 1). Node 2 is lost at step 8; the
    job moves on (its survivors' ranks fail in their collectives, or node 2's one watcher, node 1,
    finds it silent), and the standby takes node 2's place within agent.node_timeout: no requeue,
    no replacement started by hand, the training bitwise the reference's."""
    run, port = tmp_path / "run", free_port()
    overrides = (
        "tier=1", "fault=node_loss", "fault.node=2", "fault.step=8", "agent.node_timeout=4",
        "agent.watch_nodes=1",
    )  # fmt: skip
    nodes = [start_node(run, data_cache, n, port, *overrides, nnodes=4) for n in range(4)]
    standby = start_node(run, data_cache, 0, port, *overrides, "cluster.standby=true", nnodes=4)
    try:
        results = [finish(p) for p in (*nodes, standby)]
    finally:
        for p in (*nodes, standby):
            p.kill()
    codes = [code for code, _ in results]
    assert codes == [0, 0, -signal.SIGKILL, 0, 0], "".join(out[-2000:] for _, out in results)
    assert "standby: node 2 went silent; this agent takes its place" in results[-1][1]
    assert_same_training(run, reference, tmp_path)
    # Only node 2's watcher may report it lost; whether it does depends on a race it need not win:
    # the survivors' ranks fail in their collectives at once (their agents move the job for that),
    # and the standby, timing every node, may claim node 2 before agent 1's node_timeout ends
    lost = [e for e in events_of(run, "fault_detected") if e["reason"] == "node_lost"]
    assert {e["by"] for e in lost} <= {"agent1"} and {e["node"] for e in lost} <= {2}, lost
    node2_pids = [e["pids"] for e in events_of(run, "ranks_started") if e["node"] == 2]
    assert len(node2_pids) == 2 and not set(node2_pids[0]) & set(node2_pids[1])
    assert len(events_of(run, "job_start")) == 1
    assert not job_processes(run)


@pytest.mark.timeout(300)
def test_node0_lost_with_the_embedded_store_ends_the_job_for_a_requeue(tmp_path, data_cache):
    """Node 0's agent hosts the store: losing node 0 leaves nothing to coordinate; node 1's agent
    says so and exits 75 (the scheduler requeues; the job resumes from its checkpoint)."""
    run, port = tmp_path / "run", free_port()
    overrides = ("tier=1", "fault=node_loss", "fault.node=0", "fault.step=4")
    nodes = [start_node(run, data_cache, n, port, *overrides) for n in (0, 1)]
    (code0, out0), (code1, out1) = [finish(node) for node in nodes]
    assert code0 == -signal.SIGKILL, out0[-3000:]
    assert code1 == 75, out1[-3000:]
    assert "lost the job store at 127.0.0.2" in out1
    assert events_of(run, "store_lost")[0]["node"] == 1
    assert not job_processes(run)


@pytest.fixture
def standalone_store():
    """``python -m ckless_lightning.store`` on 127.0.0.2 (not the nodes' address); yields its port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckless_lightning.store", "--host", "127.0.0.2", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "CKLESS_JOB_SECRET": JOB_SECRET},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("job store listening on 127.0.0.2:"), line
        yield int(line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        finally:
            proc.kill()


@pytest.mark.timeout(600)
def test_node0_lost_with_a_standalone_store_is_a_node_loss(tmp_path, data_cache, reference, standalone_store):
    """With the store off node 0, losing node 0 (its agent and ranks) is recovered like any node
    loss: a replacement agent takes node 0's place and the job ends bitwise equal."""
    run = tmp_path / "run"
    overrides = (
        "tier=1",
        "fault=node_loss",
        "fault.node=0",
        "fault.step=8",
        f"cluster.store=127.0.0.2:{standalone_store}",
        "cluster.master_addr=127.0.0.3",  # the nodes' address: the store is elsewhere
    )
    node0 = start_node(run, data_cache, 0, 0, *overrides)
    node1 = start_node(run, data_cache, 1, 0, *overrides)
    try:
        code0, out0 = finish(node0)
        assert code0 == -signal.SIGKILL, out0[-3000:]  # node 0's agent was killed with its ranks
        time.sleep(1.0)
        replacement = start_node(run, data_cache, 0, 0, *overrides)
        results = [finish(replacement), finish(node1)]
    finally:
        node1.kill()
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert_same_training(run, reference, tmp_path)
    assert events_of(run, "fault_injected")[0]["fault_type"] == "node_loss"
    node0_starts = [e["gen"] for e in events_of(run, "ranks_started") if e["node"] == 0]
    assert len(node0_starts) == 2 and node0_starts[0] < node0_starts[1]  # the lost agent's, the new one's
    assert len(events_of(run, "job_start")) == 1  # the replacement joined the job, it did not start one
    assert not job_processes(run)
    # A store serves one job: a second job under the same secret would read this one's keys.
    second = start_node(tmp_path / "second", data_cache, 0, 0, *overrides[-2:])
    code, out = finish(second)
    assert code == 2, out[-3000:]
    assert "served a job under this secret that ended (exit 0" in out


def test_failure_report_shows_the_last_traceback_not_warnings():
    """The agent's report of a dead rank: its last traceback when it has one; otherwise its last
    lines without warning noise or progress-bar redraws; never the deprecation warning alone."""
    warning = (
        "/venv/lib/python3.11/site-packages/lightning/fabric/utilities/_pytree.py:12: "
        "FutureWarning: LeafSpec is deprecated\n  return LeafSpec()\n"
    )
    crashed = (
        "rank 1: started\n" + warning + 'Traceback (most recent call last):\n  File "x.py", line 3\n'
        'ValueError: first\nretrying\nTraceback (most recent call last):\n  File "y.py", line 9, in f\n'
        "    boom()\nRuntimeError: second\n" + warning
    )
    report = failure_report(crashed)
    assert report.startswith("Its last traceback:")
    assert "RuntimeError: second" in report and "ValueError: first" not in report

    killed = "rank 1: joined generation 0\n" + warning + "Epoch 0:  10%|#  | 4/40\rEpoch 0:  12%|#  | 5/40\n"
    report = failure_report(killed)
    assert report.startswith("Last lines of its log (no traceback):")
    assert "joined generation 0" in report and "Epoch 0:  12%" in report
    assert "Warning" not in report and "LeafSpec" not in report and "4/40" not in report

    assert "no output" in failure_report(warning)
    long_tb = (
        "Traceback (most recent call last):\n"
        + "".join(f"  frame {i}\n" for i in range(40))
        + "KeyError: 'x'\n"
    )
    report = failure_report(long_tb, lines=5)
    assert report.splitlines()[1] == "  ..." and report.splitlines()[-1] == "KeyError: 'x'"
