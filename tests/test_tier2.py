"""Tier 2 through launch.py: the node's batch cache, exactly-once samples, and cleanup.

Runs as in test_agent.py: llama3_tiny, 12 steps, checkpoint every 5, faults in
step 8. Every run records the sample ids each rank trained on per step; a
recovered run must have trained every step on exactly the samples of the
fault-free run (the last record of a step wins, as a replayed step overwrites).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from checkpoint_utils import assert_same_run
from conftest import TINY_REFERENCE, launch_command, launch_job

from ckless_lightning.record.events import read_events
from ckless_lightning.record.loss_log import read_losses
from ckless_lightning.training.callbacks.sample_log import read_sample_log

STEPS = 12
COMMON = (f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=5", "data.record_samples=true")


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    """Fault-free, without the cache (tier 0): the order the cache must reproduce."""
    assert set(COMMON) <= set(TINY_REFERENCE)
    return reference_run(*TINY_REFERENCE)


def samples(run: Path) -> dict[int, dict]:
    return {r: read_sample_log(run / "samples" / f"rank{r}.jsonl") for r in range(4)}


def assert_same_training(run: Path, reference: Path, scratch: Path) -> None:
    expected = samples(reference)
    assert sorted(expected[0]) == [(step, 0) for step in range(1, STEPS + 1)]
    assert samples(run) == expected
    seen = [sid for per_rank in expected.values() for ids in per_rank.values() for sid in ids]
    assert len(seen) == len(set(seen)), "a sample repeated within the epoch"
    assert_same_run(run, reference, scratch, STEPS)


def cache_overrides(base: Path) -> tuple[str, ...]:
    base.mkdir(parents=True, exist_ok=True)
    return ("tier=2", f"data.mmap_cache_base={base}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("fault", "window"),
    [
        # The default window (prefetch 8, lookback 4): step 5's batch is still cached at the restart.
        ("exception", ()),
        # prefetch 2, lookback 0: the resumed step 5 is long gone from the cache when step 8 fails,
        # so the reader refills it.
        ("kill", ("data.prefetch=2", "data.lookback=0")),
    ],
)
def test_rank_fault_reads_the_same_samples(tmp_path, data_cache, reference, fault, window):
    run, base = tmp_path / "run", tmp_path / "shm"
    launch_job(
        run,
        data_cache,
        *COMMON,
        *cache_overrides(base),
        *window,
        f"fault={fault}",
        "fault.rank=2",
        "fault.step=8",
    )
    assert_same_training(run, reference, tmp_path)
    assert [e["kind"] for e in read_events(run / "events.jsonl")].count("reader_started") == 1
    assert not list(base.iterdir()), "the batch cache outlived the job"


@pytest.fixture(scope="module")
def two_jobs_reader_signalled(tmp_path_factory, data_cache) -> tuple[dict[str, Path], Path, dict[str, float]]:
    """Two jobs at once on one node with one cache base: job KILL's reader gets SIGKILL and job
    STOP's SIGSTOP once each job trained 4 steps. Returns their run dirs, the base, and when each
    reader was signalled."""
    tmp = tmp_path_factory.mktemp("two_jobs")
    base = tmp / "shm"
    runs = {sig: tmp / sig.lower() for sig in ("KILL", "STOP")}
    jobs = {
        sig: subprocess.Popen(
            launch_command(run, data_cache, *COMMON, *cache_overrides(base)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for sig, run in runs.items()
    }
    signalled: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 240
        while len(signalled) < len(jobs):
            for sig, run in runs.items():
                if sig in signalled or not (run / "losses.jsonl").exists():
                    continue
                if len(read_losses(run / "losses.jsonl")) >= 4:
                    (started,) = [
                        e for e in read_events(run / "events.jsonl") if e["kind"] == "reader_started"
                    ]
                    signalled[sig] = time.time()
                    subprocess.run(["kill", f"-{sig}", str(started["pid"])], check=True)
            # Only a job still waiting for its signal must be alive: the other may finish meanwhile
            # (its 12 steps can all run while a loaded machine starts this one).
            ended = [sig for sig, job in jobs.items() if sig not in signalled and job.poll() is not None]
            assert not ended, f"job {ended} ended before its reader was signalled"
            assert time.monotonic() < deadline, (
                f"training did not reach step 4: signalled {sorted(signalled)}"
            )
            time.sleep(0.1)
        results = {sig: job.communicate(timeout=300) for sig, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill()
            job.wait()
    assert [job.returncode for job in jobs.values()] == [0, 0], [err[-2000:] for _, err in results.values()]
    return runs, base, signalled


@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_reader_killed_or_stopped_mid_run_is_restarted(two_jobs_reader_signalled, reference, tmp_path, sig):
    """A dead reader is restarted; so is a stopped one (killed first, found within a second or two)."""
    runs, _, signalled = two_jobs_reader_signalled
    events = read_events(runs[sig] / "events.jsonl")
    started = [e for e in events if e["kind"] == "reader_started"]
    assert [e["forked"] for e in started] == [True, True], started  # from the fork server, both
    (restarted,) = [e for e in events if e["kind"] == "reader_restarted"]
    assert restarted["stopped"] is (sig == "STOP")
    # noticed by the reader's exit or process state within a pass or two, not by its progress
    # bound (data.reader_timeout_s, 30 s); the margin is for a loaded machine
    assert restarted["t"] - signalled[sig] <= 15.0, "the agent took too long to notice the reader"
    assert_same_training(runs[sig], reference, tmp_path)


@pytest.mark.timeout(900)
def test_two_concurrent_jobs_have_separate_caches(two_jobs_reader_signalled):
    """The two jobs above ran at once with one cache base: each had its own cache directory (and
    restarted its own reader into it), and neither left it behind."""
    runs, base, _ = two_jobs_reader_signalled
    roots = [
        {e["root"] for e in read_events(run / "events.jsonl") if e["kind"] == "reader_started"}
        for run in runs.values()
    ]
    assert all(len(r) == 1 for r in roots), roots
    (a,), (b,) = roots
    assert a != b and Path(a).parent != Path(b).parent
    assert not list(base.iterdir()), "a job's batch cache was left behind"


@pytest.mark.timeout(600)
def test_a_wedged_reader_is_restarted_after_its_timeout_and_no_rank_is_blamed(
    tmp_path, data_cache, reference
):
    """The reader stops building at step 7's batch while it keeps running (not dead, not stopped):
    the ranks wait for that batch, the agent sees it owed longer than ``data.reader_timeout_s`` and
    restarts the reader; no rank is taken for hung, no generation is lost, samples stay exact."""
    run, base = tmp_path / "run", tmp_path / "shm"
    timeout_s = 3.0
    launch_job(
        run,
        data_cache,
        *COMMON,
        *cache_overrides(base),
        "fault=reader_stall",
        "fault.step=7",
        f"data.reader_timeout_s={timeout_s}",
        "agent.hang_timeout=30",
    )
    events = read_events(run / "events.jsonl")
    (stalled,) = [e for e in events if e["kind"] == "process_fault_injected"]
    assert (stalled["target"], stalled["signal"], stalled["step"]) == ("reader", "stall", 6)
    (restarted,) = [e for e in events if e["kind"] == "reader_restarted"]
    assert (restarted["reason"], restarted["owed_step"]) == ("no_progress", 6), restarted
    assert timeout_s < restarted["owed_s"] <= timeout_s + 5.0, restarted  # an agent pass past the bound
    assert not [e for e in events if e["kind"] in ("fault_detected", "generation")]
    assert_same_training(run, reference, tmp_path)
    assert not list(base.iterdir())
