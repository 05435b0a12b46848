"""The timeline picture and ``python -m ckless_lightning.report``: synthetic runs, then two real ones.

The synthetic run is test_summary.py's tier-0 timeline (rank 1 killed in step
6, every rank restarted, step 5 redone) written to a run dir: fast, no job. The
real runs are one tier-4 job with rank 1 killed and its fault-free twin; every
job draws its own ``timeline.png`` at the end (cli.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import launch_job
from test_summary import tier0_events, tier0_losses

from ckless_lightning import cli
from ckless_lightning.record import timeline_plot
from ckless_lightning.record.events import EventLog, read_events
from ckless_lightning.record.loss_compare import compare_losses
from ckless_lightning.record.timeline_plot import render_timeline
from ckless_lightning.report import main as report
from ckless_lightning.runtime.logger_config import CSV_LOGGER

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run: Path, losses: list[dict] | None = None) -> Path:
    """A run dir holding the synthetic tier-0 events and ``losses`` (default: its own)."""
    run.mkdir(parents=True)
    log = EventLog(run / "events.jsonl", "agent0")
    for e in tier0_events():
        log.emit(e["kind"], **{k: v for k, v in e.items() if k != "kind"})
    records = tier0_losses() if losses is None else losses
    (run / "losses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def assert_picture(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    assert len(data) > 20_000, f"{path}: {len(data)} bytes, an empty figure?"


def test_render_writes_the_picture_in_the_run_dir(tmp_path):
    run = write_run(tmp_path / "run")
    assert render_timeline(run) == run / "timeline.png"
    assert_picture(run / "timeline.png")
    out = render_timeline(run, out=tmp_path / "pictures" / "t.png", against=run)
    assert out == tmp_path / "pictures" / "t.png"
    assert_picture(out)


def test_lanes_follow_the_events():
    """Every rank has a lane; rank 1 trains until the fault, then restarts; markers where they happened."""
    events = sorted(tier0_events(), key=lambda e: e["t"])
    names, bars, marks = timeline_plot._lanes(events, 1025.0)
    assert names == ["rank 0", "rank 1", "rank 2", "rank 3", "agent0"]
    assert ("rank 1", 1012.75, "injected") in marks
    assert ("agent0", 1013.0, "detected") in marks
    rank1 = [(a, b, c) for lane, a, b, c in bars if lane == "rank 1"]
    assert [c for _, _, c in rank1] == ["imports", "comm", "state", "data", "first", "training"] * 2
    training = [(a, b) for a, b, c in rank1 if c == "training"]
    # The synthetic fault is a "sigkill" (not a "kill"): the lane ends where the agent saw the exit.
    assert training == [(1010.0, 1013.0), (1021.75, 1025.0)]


def test_report_against_itself_is_bitwise_equal(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert report([str(run), "--against", str(run), "--require-equal"]) == 0
    out = capsys.readouterr().out
    assert "SIGKILL@1" in out and "sigkill/backward" in out and "goodput" in out  # the summary table
    assert f"timeline:     {run / 'timeline.png'}" in out
    assert "losses bitwise equal" in out and "all 10 steps" in out
    assert_picture(run / "timeline.png")


def test_report_names_the_first_differing_step(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    changed = tier0_losses()
    changed[-3] = {**changed[-3], "loss": changed[-3]["loss"] + 1e-7}  # step 8's only record
    other = write_run(tmp_path / "other", changed)
    assert report([str(run), "--against", str(other), "--out", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "losses differ" in out and "1 of 10 common steps differ, first step 8" in out
    assert_picture(tmp_path / "t.png")
    assert report([str(run), "--against", str(other), "--require-equal"]) == 1
    capsys.readouterr()

    # Only the last record of a step counts: change step 5's first attempt (redone after the fault).
    first_attempt = tier0_losses()
    first_attempt[4] = {**first_attempt[4], "loss": 0.0}
    assert compare_losses(run, write_run(tmp_path / "first", first_attempt)).equal

    shorter = write_run(tmp_path / "shorter", tier0_losses()[:-1])
    assert report([str(run), "--against", str(shorter), "--require-equal"]) == 1
    out = capsys.readouterr().out
    assert "step sets differ (only here: 10; only in" in out


def test_compare_losses_is_bitwise(tmp_path):
    def run(name: str, loss: float) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "losses.jsonl").write_text(json.dumps({"step": 1, "loss": loss, "t": 1.0}) + "\n")
        return path

    assert not compare_losses(run("zero", 0.0), run("minus_zero", -0.0)).equal
    assert compare_losses(run("nan", float("nan")), run("nan2", float("nan"))).equal
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "losses.jsonl").write_text("")
    nothing = compare_losses(empty, empty)
    assert not nothing.equal and "neither" in nothing.describe()


def test_report_refuses_a_dir_without_events(tmp_path):
    missing = tmp_path / "no_such_run"
    result = subprocess.run(
        [sys.executable, "-m", "ckless_lightning.report", str(missing)], capture_output=True, text=True
    )
    assert result.returncode == 2, result
    assert str(missing) in result.stderr and "events.jsonl" in result.stderr
    run = write_run(tmp_path / "run")
    assert report([str(run), "--against", str(missing)]) == 2


def test_job_report_survives_a_rendering_failure(tmp_path, capsys, monkeypatch):
    """cli._report draws the picture on node 0, and a failure to draw is a warning, not an error."""
    run = write_run(tmp_path / "run")
    job = SimpleNamespace(
        timeline=True,
        cluster=SimpleNamespace(node_rank=0),
        checkpoint=SimpleNamespace(dir=run / "ck"),
        run_dir=str(run),
        logger=SimpleNamespace(target=CSV_LOGGER, kwargs={"save_dir": str(run), "name": "logs"}),
    )
    cli._report(job, run, 0)
    out = capsys.readouterr().out
    assert f"timeline:     {run / 'timeline.png'}" in out
    assert_picture(run / "timeline.png")

    def no_matplotlib(*args: object, **kwargs: object) -> Path:
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(timeline_plot, "render_timeline", no_matplotlib)
    cli._report(job, run, 0)
    captured = capsys.readouterr()
    assert "timeline:" not in captured.out and "done" in captured.out
    assert captured.err.strip() == "warning: no timeline picture (ImportError: No module named 'matplotlib')"


def test_matplotlib_is_imported_only_to_draw():
    """The agent (cli.py) and the report import the renderer at start; matplotlib waits for a picture."""
    code = (
        "import sys, ckless_lightning.cli, ckless_lightning.report, ckless_lightning.record.timeline_plot; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


# --- real runs --------------------------------------------------------------------------------------

REAL = (
    "trainer.max_steps=8",
    "timeline=true",
    "tier=4",
    "agent.hang_timeout=6",
    "checkpoint.every_n_steps=0",
)


@pytest.fixture(scope="module")
def faulted_and_twin(tmp_path_factory, data_cache) -> tuple[Path, Path, str]:
    """A tier-4 run with rank 1 killed in step 5 (with launch.py's output) and its fault-free twin."""
    faulted = tmp_path_factory.mktemp("faulted")
    result = launch_job(faulted, data_cache, *REAL, "fault=kill", "fault.rank=1", "fault.step=5")
    twin = tmp_path_factory.mktemp("twin")
    launch_job(twin, data_cache, *REAL)
    # The console of a recovered run: survivors say in one line that they leave the generation;
    # a lost peer's collective traceback is not printed (the killed rank leaves none).
    console = result.stdout + result.stderr  # rank 0's output is echoed on launch.py's stdout
    assert "leaving generation 0" in console and "Traceback" not in console, console[-3000:]
    return faulted, twin, result.stdout


@pytest.mark.timeout(600)
def test_every_job_draws_its_timeline(faulted_and_twin):
    faulted, twin, stdout = faulted_and_twin
    assert f"timeline:     {faulted / 'timeline.png'}" in stdout
    for run in (faulted, twin):
        assert_picture(run / "timeline.png")
    events = read_events(faulted / "events.jsonl")
    names, bars, marks = timeline_plot._lanes(events, events[-1]["t"])
    assert {"rank 0", "rank 1", "rank 2", "rank 3"} <= set(names)
    assert any(lane == "rank 1" and kind == "injected" for lane, _, kind in marks)
    # Survivors left the failed generation in-process; the replaced rank trained again after the fault.
    fault_t = next(e["t"] for e in events if e["kind"] == "fault_injected")
    assert any(c == "leaving" for lane, a, _, c in bars if lane == "rank 0" and a >= fault_t)
    assert any(c == "training" for lane, a, _, c in bars if lane == "rank 1" and a > fault_t)


@pytest.mark.timeout(600)
def test_report_finds_the_recovered_run_bitwise_equal_to_its_twin(faulted_and_twin, tmp_path, capsys):
    faulted, twin, _ = faulted_and_twin
    out_png = tmp_path / "against.png"
    assert report([str(faulted), "--against", str(twin), "--out", str(out_png), "--require-equal"]) == 0
    out = capsys.readouterr().out
    assert "SIGKILL@1" in out and " kill/" in out and "losses bitwise equal" in out and "all 8 steps" in out
    assert_picture(out_png)
