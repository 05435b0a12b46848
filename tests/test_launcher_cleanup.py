"""Nothing of a job outlives launch.py: SIGTERM stops every rank; SIGKILL of the launcher kills them too."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT

from ckless_lightning.agent.batch_cache_service import orphan_cache_dirs
from ckless_lightning.record.events import read_events


def start_long_run(
    tmp_path: Path, data_cache: Path, *overrides: str
) -> tuple[subprocess.Popen[bytes], list[psutil.Process]]:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            f"hydra.run.dir={run_dir}",
            f"data.cache_dir={data_cache}",
            "data.max_source_bytes=2000000",
            "trainer.max_steps=100000",
            "trainer.enable_progress_bar=false",
            "checkpoint.every_n_steps=0",
            "fault=none",
            "timeline=false",
            "data.seq_len=32",
            *overrides,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    losses = run_dir / "losses.jsonl"
    deadline = time.monotonic() + 120
    try:
        while not (losses.exists() and losses.read_text().strip()):
            assert proc.poll() is None, f"launch.py exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "training did not start within 120 s"
            time.sleep(0.5)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if _cmdline(p) is not None]
        assert len(ranks) >= 4
    except BaseException:
        proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
        raise
    return proc, ranks


def _cmdline(p: psutil.Process) -> str | None:
    """``p``'s command line, None once it exited (the fork server's intermediate child of a fork, or a
    spare being started, lives for milliseconds: it can be listed and gone a moment later)."""
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return None


def _stop(proc: subprocess.Popen[bytes], procs: list[psutil.Process]) -> None:
    """Kill the launcher and whatever of ``procs`` still runs (a failed assertion leaves nothing)."""
    proc.kill()
    for p in procs:
        if p.is_running():
            p.kill()


def wait_for_spare(launcher: subprocess.Popen[bytes], timeout: float = 120) -> psutil.Process:
    """The warm spare the agent starts once the ranks train (tier 4, the default: one spare)."""
    deadline = time.monotonic() + timeout
    while True:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            if "ckless_lightning.spare" in (_cmdline(child) or ""):
                return child
        assert time.monotonic() < deadline, "no warm spare within the timeout"
        time.sleep(0.2)


def assert_all_gone(procs: list[psutil.Process], timeout: float = 30) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        p.kill()
    assert not alive, f"left running: {[p.pid for p in alive]}"


@pytest.mark.timeout(240)
def test_sigterm_stops_every_rank(tmp_path, data_cache):
    """Ranks and the batch-cache reader forked from the fork server stop with the launcher."""
    proc, ranks = start_long_run(tmp_path, data_cache)
    try:
        commands = [_cmdline(p) or "" for p in ranks]
        assert not any("ckless_lightning.data.cache_reader" in c for c in commands), commands  # forked
        events = read_events(tmp_path / "run" / "events.jsonl")
        (started,) = [e for e in events if e["kind"] == "reader_started"]
        assert started["forked"] is True and started["pid"] in [p.pid for p in ranks], started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert_all_gone(ranks)
    finally:
        _stop(proc, ranks)


@pytest.mark.timeout(240)
def test_killed_launcher_takes_its_ranks_along(tmp_path, data_cache):
    """Cold ranks, a cold reader and a cold warm spare (no fork server: each a ``python -m``
    process of its own, the path the other jobs of the tests do not take) die with a SIGKILLed
    launcher."""
    shm = tmp_path / "shm"  # the killed agent cannot remove its batch cache: not in /dev/shm
    shm.mkdir()
    proc, ranks = start_long_run(
        tmp_path, data_cache, "agent.fork_server=false", f"data.mmap_cache_base={shm}"
    )
    try:
        commands = [_cmdline(p) or "" for p in ranks]
        assert sum("ckless_lightning.rank" in c for c in commands) == 4, commands
        assert sum("ckless_lightning.data.cache_reader" in c for c in commands) == 1, commands
        spare = wait_for_spare(proc)
        ranks.append(spare)
        assert "ckless_lightning.spare" in " ".join(spare.cmdline())
        proc.kill()
        proc.wait(timeout=30)
        assert_all_gone(ranks)
        # What it left is its agent's batch cache, which the next agent on the node removes as it
        # starts (BatchCacheService: a cache directory whose agent is dead)
        left = list(shm.iterdir())
        assert len(left) == 1 and orphan_cache_dirs(shm) == left, left
    finally:
        _stop(proc, ranks)


def test_processes_the_agent_starts_turn_nccl_errors_into_exceptions(monkeypatch):
    """Ranks get TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator, raise in the rank; torch's
    default tears the process down), unless the user chose a value."""
    from ckless_lightning.runtime.contract import launcher_env

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert launcher_env()["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    assert launcher_env()["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
