"""Faults from outside the product, as production sends them, and every way a job ends.

A test process sends the faults: it SIGKILLs and SIGSTOPs the job's processes by pid (read from
``events.jsonl``'s ``ranks_started``), never through ``fault=``. Each fault the job saw is a row of
the summary (cause as observed, ``-`` in the injected column), counted in the recoveries, marked on
the timeline, and the same in ``python -m ckless_lightning.report``; the rows are checked against
the agent's ``fault_detected`` records. Endings: completed, gave up (the fault budget), SIGTERM,
the launcher SIGKILLed; a job that does not complete prints, last, what happens next.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    TINY_REFERENCE,
    launch_command,
    left_behind_ranks,
    left_behind_traces,
    rows_besides_left_behind,
)
from test_agent import events_of, job_processes

from ckless_lightning.record.loss_log import read_losses
from ckless_lightning.record.summary import summarize_run
from ckless_lightning.record.timeline_plot import _lanes
from ckless_lightning.report import main as report
from ckless_lightning.runtime.checkpointing import latest_checkpoint

WAIT_S = 240  # for a step to be reached (a 4-rank job on 2 cores: a few seconds)
TIER4 = ("tier=4", "trainer.enable_progress_bar=false")


class OutsideJob:
    """``launch.py`` in the background and a fault sender that acts on its processes by pid."""

    def __init__(self, run: Path, data_cache: Path, *overrides: str) -> None:
        self.run = run
        self.proc = subprocess.Popen(
            launch_command(run, data_cache, *overrides),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def completed_step(self) -> int:
        path = self.run / "losses.jsonl"
        return max(read_losses(path), default=0) if path.exists() else 0

    def wait_for_step(self, step: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.completed_step() < step:
            assert self.proc.poll() is None, f"the job ended (exit {self.proc.returncode}) before step {step}"
            assert time.monotonic() < deadline, f"step {step} not reached within {WAIT_S} s"
            time.sleep(0.05)

    def pid_of(self, rank: int) -> int:
        """The pid of ``rank``'s current process, from the events the agent wrote."""
        started = [e for e in events_of(self.run, "ranks_started") if rank in e["ranks"]]
        pids = [e["pids"][e["ranks"].index(rank)] for e in started]
        assert pids, f"no ranks_started for rank {rank}"
        return pids[-1]

    def signal_rank(self, rank: int, sig: signal.Signals) -> int:
        pid = self.pid_of(rank)
        os.kill(pid, sig)
        return pid

    def finish(self, timeout: float = 300) -> str:
        out, _ = self.proc.communicate(timeout=timeout)
        return out

    def close(self) -> None:
        """Nothing outlives the test: the launcher (its processes die with it) and any job process."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        for proc in job_processes(self.run):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)


@pytest.fixture
def outside(tmp_path, data_cache):
    jobs: list[OutsideJob] = []

    def start(*overrides: str, name: str = "run") -> OutsideJob:
        job = OutsideJob(tmp_path / name, data_cache, *overrides)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.close()
    for job in jobs:
        assert not job_processes(job.run), "a process of the job outlived it"


def detected(run: Path) -> set[tuple[int, int]]:
    """(rank, generation) of each rank fault the agents reported."""
    return {(e["rank"], e["gen"]) for e in events_of(run, "fault_detected") if e.get("reason") != "node_lost"}


def table_rows(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#  fault"))
    return [line for line in lines[start + 1 :] if line[:1].isdigit()]


@pytest.mark.timeout(600)
def test_outside_kill_and_stop_are_rows_recoveries_and_marks(outside, reference_run, tmp_path, capsys):
    reference = reference_run(*TINY_REFERENCE)
    job = outside(*TINY_REFERENCE, *TIER4)
    job.wait_for_step(3)
    job.signal_rank(1, signal.SIGKILL)
    job.wait_for_step(7)
    job.signal_rank(3, signal.SIGSTOP)
    out = job.finish()
    assert job.proc.returncode == 0, out[-3000:]
    assert read_losses(job.run / "losses.jsonl") == read_losses(reference / "losses.jsonl")  # bitwise

    summary = summarize_run(job.run)
    names = rows_besides_left_behind([f.name for f in summary.faults], job.run)
    assert names == ["SIGKILL@1", "stopped@3"], summary.format() + left_behind_traces(job.run)
    assert all(f.injected_by is None for f in summary.faults)
    assert {(f.rank, f.old_gen) for f in summary.faults} == detected(job.run)  # one row per fault seen
    assert summary.startup_s is not None and summary.startup_s > 0
    text = summary.format()
    if not left_behind_ranks(job.run):  # a survivor left behind is a third fault and its recovery
        assert all(f.recovered for f in summary.faults)
        assert "recoveries       2," in text and "faults           2: 2 from outside, 0 injected" in text
    assert "exit status      0 (completed)" in text
    for row in table_rows(text):
        assert row.split()[3] == "-"  # injected: no
        assert row in out  # the launcher printed the same table
    assert "next:" not in out  # a completed job has no next step

    # The report CLI on the same run: the same rows; the timeline marks both faults on their lanes.
    assert report([str(job.run), "--out", str(tmp_path / "t.png")]) == 0
    assert table_rows(capsys.readouterr().out) == table_rows(text)
    events = [json.loads(line) for line in (job.run / "events.jsonl").read_text().splitlines()]
    events.sort(key=lambda e: e["t"])
    _, _, marks = _lanes(events, events[-1]["t"])
    left_behind = {f"rank {r}" for r in left_behind_ranks(job.run)}  # its exit(6) is marked too
    assert {lane for lane, _, kind in marks if kind == "outside"} == {"rank 1", "rank 3"} | left_behind


@pytest.mark.timeout(600)
def test_a_job_that_spends_its_budget_on_outside_faults_says_what_happens_next(outside):
    job = outside("trainer.max_steps=40", "checkpoint.every_n_steps=3", "agent.max_restarts=1", *TIER4)
    job.wait_for_step(4)
    job.signal_rank(1, signal.SIGKILL)
    job.wait_for_step(7)
    job.signal_rank(2, signal.SIGKILL)
    out = job.finish()
    assert job.proc.returncode == 75, out[-3000:]
    summary = summarize_run(job.run)
    names = rows_besides_left_behind([f.name for f in summary.faults], job.run)
    assert names == ["SIGKILL@1", "SIGKILL@2"], summary.format()
    assert summary.faults[-1].outcome.startswith("gave up: fault budget spent"), summary.format()
    assert "exit status      75 (gave up: fault budget spent" in out
    lines = out.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("next:"))  # the last thing printed
    what_next = " ".join(line.strip() for line in lines[start:])
    assert what_next.startswith("next: exit 75 asks the scheduler to requeue"), what_next
    assert f"resumes from {latest_checkpoint(job.run / 'checkpoints')}" in what_next
    assert "agent.max_restarts" in what_next


@pytest.mark.timeout(600)
def test_sigterm_and_a_killed_launcher_are_endings_with_their_faults(outside, tmp_path, capsys):
    # SIGTERM (a preemption): the summary, with the outside fault before it, and what happens next.
    job = outside("trainer.max_steps=100000", "checkpoint.every_n_steps=0", *TIER4, name="term")
    job.wait_for_step(3)
    job.signal_rank(2, signal.SIGKILL)
    job.wait_for_step(6)
    job.proc.send_signal(signal.SIGTERM)
    out = job.finish()
    assert job.proc.returncode == 143, out[-3000:]
    assert "exit status      143 (stopped by SIGTERM" in out
    assert [row.split()[1] for row in table_rows(out)] == ["SIGKILL@2"]
    assert any(line.startswith("next: stopped from outside") for line in out.rstrip().splitlines()[-2:])

    # The launcher SIGKILLed: nothing prints; the report reads the run back, fault and ending. Its
    # agent cannot remove its batch cache: not in /dev/shm (the next agent on a node would).
    shm = tmp_path / "shm"
    shm.mkdir()
    killed = outside(
        "trainer.max_steps=100000",
        "checkpoint.every_n_steps=0",
        *TIER4,
        f"data.mmap_cache_base={shm}",
        name="killed",
    )
    killed.wait_for_step(3)
    killed.signal_rank(1, signal.SIGKILL)
    killed.wait_for_step(6)
    killed.proc.kill()
    killed.finish()
    deadline = time.monotonic() + 30
    while job_processes(killed.run) and time.monotonic() < deadline:  # they die with it (PDEATHSIG)
        time.sleep(0.2)
    assert not job_processes(killed.run)
    capsys.readouterr()
    assert report([str(killed.run), "--out", str(killed.run / "t.png")]) == 0
    text = capsys.readouterr().out
    assert [row.split()[1] for row in table_rows(text)] == ["SIGKILL@1"]
    assert "unknown (no job_end event: the launcher was killed" in text
    assert "recoveries       1," in text
