"""Warm spares: prepared before they are handed a rank, and a pool that refills itself.

The pool tests run :class:`SparePool` over a stand-in spare (a few lines of Python that
say "ready" on the pool's pipe and wait on stdin), so they take seconds. The job test runs
``launch.py`` at tier 4 with one spare, kills rank 1 once the spare is ready, and reads the
hand-over from ``events.jsonl``: the spare-born rank imported no module after it was handed
its rank, and a new spare was started once the ranks trained again. (Spares forked by the
fork server, the default; test_tier3.py's Mixtral run has cold ranks and cold spares.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import launch_command, left_behind_ranks, left_behind_traces
from test_agent import job_processes

from ckless_lightning.agent.processes import SparePool
from ckless_lightning.record.events import EventLog, read_events


def events_of(path: Path, kind: str | None = None) -> list[dict]:
    """The events of ``path`` (an events file, or a run directory's events.jsonl) of ``kind`` (any)."""
    path = path / "events.jsonl" if path.is_dir() else path
    return [e for e in read_events(path) if kind is None or e["kind"] == kind]


# A stand-in spare: waits for GATE (a file) if given, says ready on --ready-fd, waits on stdin;
# MARKER in its command line finds it. With EXIT set it exits 1 at once (a spare that cannot start).
FAKE_SPARE = """
import os, sys, time
args = sys.argv[1:]
gate, fd = args[0], int(args[args.index("--ready-fd") + 1])
if os.environ.get("FAKE_SPARE_EXIT"):
    sys.exit(1)
while gate != "-" and not os.path.exists(gate):
    time.sleep(0.02)
os.write(fd, b"ready\\n")
os.close(fd)
sys.stdin.readline()
"""


def fake_command(marker: str, gate: Path | None = None) -> list[str]:
    return [sys.executable, "-c", FAKE_SPARE, str(gate) if gate else "-", marker]


def marked(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if marker in (proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def wait_for(condition, timeout: float = 30.0, tend: SparePool | None = None):
    deadline = time.monotonic() + timeout
    while True:
        if tend is not None:
            tend.tend()
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def pool_factory(tmp_path):
    pools: list[tuple[SparePool, str]] = []

    def make(size: int, gate: Path | None = None, **kwargs) -> tuple[SparePool, str]:
        marker = f"spare-test-{len(pools)}-{tmp_path.name}"
        events = EventLog(tmp_path / f"events{len(pools)}.jsonl", source="agent0")
        pool = SparePool(size, command=fake_command(marker, gate), events=events, **kwargs)
        pools.append((pool, marker))
        return pool, marker

    yield make
    left = []
    for pool, marker in pools:
        pool.close()
        left += marked(marker)
    for proc in left:  # a spare a failed test took and did not end
        proc.kill()
    assert not left, "close() left a spare running"


@pytest.mark.timeout(60)
def test_taken_spare_is_replaced(pool_factory):
    pool, marker = pool_factory(2)
    assert pool.take() is None and len(pool) == 0, "nothing starts before fill()"
    pool.tend()
    assert len(pool) == 0
    pool.fill()
    first = wait_for(lambda: len(pool.ready_pids()) == 2 and pool.ready_pids())
    spare = pool.take()
    assert spare is not None and spare.pid == first[0], "the oldest ready spare is handed out"
    pool.tend(start=False)  # the agent while its ranks recover: nothing starts
    assert len(pool) == 1
    pool.tend()
    assert len(pool) == 2, "the replacement is counted as soon as it is being started"
    ready = wait_for(lambda: len(pool.ready_pids()) == 2 and pool.ready_pids())
    assert spare.pid not in ready and first[1] in ready
    spare.stdin.close()  # the taken spare is the caller's now: the pool does not kill it
    assert spare.wait(timeout=10) == 0
    pool.close()
    assert not marked(marker) and len(pool) == 0


@pytest.mark.timeout(60)
def test_dead_and_stopped_spares_are_replaced(pool_factory, tmp_path):
    pool, marker = pool_factory(2)
    pool.fill()
    killed, stopped = wait_for(lambda: len(pool.ready_pids()) == 2 and pool.ready_pids())
    psutil.Process(killed).send_signal(signal.SIGKILL)
    psutil.Process(stopped).suspend()
    ready = wait_for(
        lambda: len(set(pool.ready_pids()) - {killed, stopped}) == 2 and pool.ready_pids(), tend=pool
    )
    assert not psutil.pid_exists(stopped) or psutil.Process(stopped).status() == psutil.STATUS_ZOMBIE
    assert len(marked(marker)) == 2 and {p.pid for p in marked(marker)} == set(ready)
    lost = {e["pid"]: e["reason"] for e in events_of(tmp_path / "events0.jsonl", "spare_lost")}
    assert lost == {killed: "exited", stopped: "stopped"}


@pytest.mark.timeout(60)
def test_ready_spares_are_handed_out_first(pool_factory, tmp_path):
    gate = tmp_path / "gate"  # a stand-in spare says ready once this file exists
    gate.touch()
    pool, _ = pool_factory(1, gate=gate)
    pool.fill()
    (first,) = wait_for(lambda: pool.ready_pids())
    gate.unlink()
    pool.size = 2
    pool.tend()
    wait_for(lambda: len(pool) == 2 and len(pool.pids) == 2)
    time.sleep(0.2)
    assert pool.ready_pids() == [first]
    taken = [pool.take(), pool.take()]
    assert taken[0].pid == first, "the ready spare first"
    assert taken[1] is not None, "then one still preparing (further along than a new process)"
    assert pool.take() is None
    for spare in taken:
        spare.kill()
        spare.wait()


@pytest.mark.timeout(120)
def test_spare_handed_out_while_preparing_survives_its_closed_ready_pipe():
    """The real spare: the pool closed its end of the ready pipe (it took the spare before it was
    ready); saying ready must not kill it. stdin closing then ends it cleanly."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    spare = subprocess.Popen(
        [sys.executable, "-m", "ckless_lightning.spare", "--ready-fd", str(write_fd)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        pass_fds=(write_fd,),
    )
    os.close(write_fd)
    try:
        out, _ = spare.communicate(timeout=100)  # stdin closed: no assignment
    finally:
        spare.kill()
    assert spare.returncode == 0, out.decode(errors="replace")[-2000:]


@pytest.mark.timeout(60)
def test_spare_that_cannot_start_is_retried_with_backoff(pool_factory, tmp_path, monkeypatch):
    """A spare that exits by itself is replaced after 1 s, then 2 s, ...: no restart storm."""
    monkeypatch.setenv("FAKE_SPARE_EXIT", "1")
    events = tmp_path / "events0.jsonl"
    pool, _ = pool_factory(1, max_backoff_s=60.0)
    pool.fill()
    lost = wait_for(
        lambda: len(events_of(events, "spare_lost")) >= 2 and events_of(events, "spare_lost"), tend=pool
    )
    until = lost[1]["t"] + 1.5
    while time.time() < until:
        pool.tend()
        time.sleep(0.02)
    started = events_of(events, "spare_started")
    assert len(started) == 2, "the third start waits 2 s"
    assert started[1]["t"] - lost[0]["t"] >= 0.9, "the second start waits 1 s"
    assert {e["reason"] for e in lost} == {"exited"} and {e["exit_code"] for e in lost} == {1}


@pytest.mark.timeout(60)
def test_close_kills_a_spare_being_started(pool_factory):
    pool, marker = pool_factory(3)
    pool.fill()
    pool.close()
    time.sleep(0.5)
    assert not marked(marker) and len(pool) == 0
    pool.tend()
    assert len(pool) == 0, "a closed pool starts nothing"


def wait_for_event(run: Path, job: subprocess.Popen[str], match, what: str, timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        if (run / "events.jsonl").exists():
            for event in events_of(run):
                if match(event):
                    return event
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


@pytest.mark.timeout(600)
def test_spare_handed_a_rank_imports_nothing_and_pool_refills(tmp_path, data_cache):
    """Kill rank 1 once the spare is ready: the spare takes the rank, imports no module after the
    hand-over, is ready to train within moments, and a new spare starts once the ranks train."""
    run = tmp_path / "run"
    job = subprocess.Popen(
        # enough steps that the spare (started after the first step) is ready well before the end
        launch_command(
            run, data_cache, "tier=4", "agent.spares=1", "trainer.max_steps=60", "agent.hang_timeout=30"
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = wait_for_event(run, job, lambda e: e["kind"] == "spare_prepared", "a prepared spare")
        (started,) = [e for e in events_of(run, "ranks_started") if e["gen"] == 0]
        victim = started["pids"][1]
        psutil.Process(victim).send_signal(signal.SIGKILL)
        _, stderr = job.communicate(timeout=300)
        assert job.returncode == 0, stderr[-3000:]
    finally:
        job.kill()
        job.wait()

    # (a survivor left behind in a gloo wait is replaced too: conftest.left_behind_ranks)
    left = left_behind_ranks(run)
    started = events_of(run, "ranks_started")
    replacements = [e for e in started if e["gen"] == 1 and not set(e["ranks"]) <= left]
    assert len(replacements) == 1, (replacements, left_behind_traces(run))
    (replaced,) = replacements
    assert replaced["ranks"] == [1] and replaced["warm"] == [True] and replaced["pids"] == [ready["pid"]]
    phases = {e["phase"]: e for e in events_of(run, "rank_phase") if e["rank"] == 1 and e["gen"] == 1}
    assert {"process_start", "spare_handed", "spare_ready", "generation_joined"} <= set(phases)
    assert phases["spare_ready"]["t"] - phases["process_start"]["t"] == pytest.approx(
        phases["spare_ready"]["handover_s"], abs=1e-3
    )
    # The hand-over itself is milliseconds (a JSON line and the environment); a spare that still
    # parsed the config or imported anything here would take far longer.
    assert phases["spare_ready"]["handover_s"] < 3.0, phases["spare_ready"]
    (late,) = [e for e in events_of(run, "spare_imports") if e["rank"] == 1]
    assert late["count"] == 0, f"imported after the hand-over: {late['names']}"

    # The pool refills once every rank trains again (beats with a step after the state load), not
    # during the recovery.
    loaded = max(
        e["t"] for e in events_of(run, "rank_phase") if e["gen"] == 1 and e["phase"] == "state_load_done"
    )
    refills = [e for e in events_of(run, "spare_started") if e["t"] >= phases["process_start"]["t"]]
    assert refills, "no new spare after the take"
    # With the fork server (the default), spares are forked from it: ready in moments, no imports.
    assert all(e.get("forked") for e in events_of(run, "spare_started")), events_of(run, "spare_started")
    # A forked spare only looks the dataset up (no imports: a cold one takes ~6 s idle here); 15 s
    # tells the two apart with room for a loaded machine (5.04 s seen with a chaos test beside it).
    assert ready["start_s"] < 15.0, ready
    assert refills[0]["pid"] != ready["pid"] and loaded <= refills[0]["t"] < loaded + 15.0, refills
    assert not job_processes(run), [p.info["cmdline"] for p in job_processes(run)]
