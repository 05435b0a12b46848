"""Tier 2 batch cache: entry format, atomic commit, corruption, the reader's window, a killed reader."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from ckless_lightning.data import DataConfig, StepBatchLoader, load_prepared, prepare_dataset
from ckless_lightning.data.batch_cache import (
    HEADER_SIZE,
    BatchCacheLayout,
    BatchCacheReader,
    BatchCacheWriter,
    CorruptEntryError,
    create_cache_dir,
    remove_cache_dir,
    source_tag,
)
from ckless_lightning.data.reader_process import consumer_wants, run_reader, window_steps

ROOT = Path(__file__).resolve().parents[1]
MBS, ROW = 3, 9


def fake_source(step: int, dp_rank: int, offset: int = 0) -> dict[str, torch.Tensor]:
    """A pure function of (step, dp_rank): every value says where it came from."""
    base = offset + step * 1000 + dp_rank * 100
    return {
        "input_ids": torch.arange(MBS * ROW, dtype=torch.long).reshape(MBS, ROW) + base,
        "sample_ids": torch.arange(MBS, dtype=torch.long) + base,
    }


def make_layout(base: Path, job: str = "job", dp_ranks: tuple[int, ...] = (4, 5, 6), tag: str = "t"):
    return BatchCacheLayout(create_cache_dir(base, job, 0), dp_ranks, MBS, ROW, tag)


def assert_batch(got: dict, want: dict, step: int) -> None:
    assert got["step"] == step
    for key in ("input_ids", "sample_ids"):
        assert got[key].dtype == torch.long and torch.equal(got[key], want[key]), (key, step)


@contextmanager
def reader_thread(layout: BatchCacheLayout, source, **kwargs) -> Iterator[threading.Thread]:
    stop = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run_reader(layout, source, stop=stop, poll_s=0.005, **kwargs)
        except BaseException as err:  # surfaced to the test below
            errors.append(err)
            raise

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive(), "run_reader did not return after stop"
    assert not errors, errors


# --- format, directories -------------------------------------------------------------------------------


def test_round_trip_permissions_and_layout(tmp_path):
    layout = make_layout(tmp_path)
    for level in (tmp_path / "ckless-job", tmp_path / "ckless-job" / "node0"):
        assert stat.S_IMODE(level.stat().st_mode) == 0o700
    assert layout.entry_path(7).name == "step0000000007.batch"
    writer, reader = BatchCacheWriter(layout, fake_source), BatchCacheReader(layout)
    for step in (0, 1, 5, 12345):
        assert writer.write(step) is True
        assert writer.write(step) is False  # valid entry: no-op
        assert writer.verify(step)
        assert layout.entry_path(step).stat().st_size == layout.entry_nbytes
    for step in (0, 1, 5, 12345):
        for i, dp_rank in enumerate(layout.dp_ranks):
            assert_batch(reader.read(step, i), fake_source(step, dp_rank), step)
    with pytest.raises(FileNotFoundError):
        reader.read(2, 0)
    with pytest.raises(IndexError, match=r"local_index=3"):
        reader.read(0, 3)
    assert writer.evict_before(5) == 2 and writer.entry_steps() == [5, 12345]

    reader.request(42, 1)
    assert layout.want_path(1).read_text().strip() == "42"
    with pytest.raises(ValueError, match="distinct"):
        BatchCacheLayout(tmp_path, (1, 1), MBS, ROW)
    with pytest.raises(ValueError, match="row_len"):
        BatchCacheLayout(tmp_path, (0,), MBS, 0)
    with pytest.raises(ValueError, match=r"expects \(3, 10\)"):
        BatchCacheWriter(BatchCacheLayout(layout.root, (0,), MBS, ROW + 1), fake_source).write(0)


def test_jobs_are_disjoint_and_removed(tmp_path):
    a, b = make_layout(tmp_path, "A"), make_layout(tmp_path, "B")
    assert a.root != b.root
    BatchCacheWriter(a, fake_source).write(0)
    BatchCacheWriter(b, lambda s, r: fake_source(s, r, offset=7)).write(0)
    assert_batch(BatchCacheReader(a).read(0, 1), fake_source(0, 5), 0)
    assert_batch(BatchCacheReader(b).read(0, 1), fake_source(0, 5, offset=7), 0)
    assert remove_cache_dir(tmp_path, "A") is True
    assert not (tmp_path / "ckless-A").exists()
    assert remove_cache_dir(tmp_path, "A") is False  # idempotent
    assert_batch(BatchCacheReader(b).read(0, 0), fake_source(0, 4, offset=7), 0)
    for bad in ("", "a/b", "..", "."):
        with pytest.raises(ValueError, match="job id"):
            create_cache_dir(tmp_path, bad, 0)
    loose = tmp_path / "ckless-loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(PermissionError, match="ckless-loose"):
        create_cache_dir(tmp_path, "loose", 0)


def test_partial_and_corrupt_entries_never_served_and_repaired(tmp_path):
    layout = make_layout(tmp_path)
    writer, reader = BatchCacheWriter(layout, fake_source), BatchCacheReader(layout)
    writer.write(4)
    good = layout.entry_path(4).read_bytes()

    # a writer killed mid-write: only a temp file with half the bytes
    tmp = layout.root / ".tmp-99999-3"
    tmp.write_bytes(good[: len(good) // 2])
    with pytest.raises(FileNotFoundError):
        reader.read(3, 0)
    with pytest.raises(TimeoutError, match=r"step0000000003\.batch"):
        reader.wait_read(3, 0, timeout_s=0.05)

    flipped = bytearray(good)
    flipped[HEADER_SIZE + 5] ^= 0xFF
    other_tag = BatchCacheLayout(layout.root, layout.dp_ranks, MBS, ROW, "another run")
    BatchCacheWriter(other_tag, fake_source).write(9)
    corruptions = {
        "truncated": good[: len(good) - 8],
        "empty": b"",
        "checksum": bytes(flipped),
        "step": good,  # step 4's entry under step 3's name
        "magic": b"X" + good[1:],
    }
    for reason, data in corruptions.items():
        layout.entry_path(3).write_bytes(data)
        with pytest.raises(CorruptEntryError) as info:
            reader.read(3, 0)
        assert info.value.path == layout.entry_path(3), reason
        assert not writer.verify(3)
        assert writer.write(3) is True, reason  # rebuilt in place
        assert_batch(reader.read(3, 2), fake_source(3, 6), 3)
    with pytest.raises(CorruptEntryError, match="another data source"):
        reader.read(9, 0)
    assert writer.write(9) and writer.verify(9)

    assert writer.clean_temp() == 1
    assert not tmp.exists()
    assert not [p for p in layout.root.iterdir() if p.name.startswith(".tmp-")]


# --- the reader's window -------------------------------------------------------------------------------


def test_real_loader_batches_through_reader(tmp_path):
    rows = 40
    ds = Dataset.from_dict(
        {
            "input_ids": [[(i * 7 + j) % 251 for j in range(ROW)] for i in range(rows)],
            "sample_id": list(range(rows)),
        }
    )
    loaders = {r: StepBatchLoader(ds, seed=11, micro_batch_size=MBS, dp_rank=r, dp_size=4) for r in range(4)}
    layout = make_layout(tmp_path, dp_ranks=(2, 3))
    reader = BatchCacheReader(layout)
    steps = range(loaders[0].steps_per_epoch * 2 + 1)  # crosses two epoch boundaries
    window = {"prefetch": 3, "lookback": 1, "start_step": 0, "max_steps": None}
    with reader_thread(layout, {r: loaders[r].batch for r in (2, 3)}, **window):
        for step in steps:
            for i, dp_rank in enumerate(layout.dp_ranks):
                reader.request(step, i)
                assert_batch(reader.wait_read(step, i, timeout_s=20), loaders[dp_rank].batch(step), step)


def test_window_moves_to_a_far_request_and_back(tmp_path):
    layout = make_layout(tmp_path, dp_ranks=(0,))
    calls: list[int] = []

    def slow_far(step: int, dp_rank: int) -> dict[str, torch.Tensor]:
        calls.append(step)
        time.sleep(1.3 if step == 1000 else 0.01)
        return fake_source(step, dp_rank)

    reader, waits = BatchCacheReader(layout), []
    with reader_thread(layout, slow_far, prefetch=4, lookback=2, start_step=0, max_steps=1003):
        reader.wait_read(0, 0, timeout_s=10)
        _wait_for(lambda: BatchCacheWriter(layout, slow_far).entry_steps() == [0, 1, 2, 3], "initial window")
        reader.request(1000, 0)
        assert_batch(
            reader.wait_read(1000, 0, timeout_s=20, on_wait=waits.append), fake_source(1000, 0), 1000
        )
        assert len(waits) == 1 and 1.0 <= waits[0] < 20
        # the old window is evicted, the new one filled up to max_steps (exclusive)
        _wait_for(
            lambda: BatchCacheWriter(layout, slow_far).entry_steps() == [1000, 1001, 1002], "new window"
        )
        reader.request(1, 0)  # a restart at an old step: refilled
        assert_batch(reader.wait_read(1, 0, timeout_s=10), fake_source(1, 0), 1)
        _wait_for(lambda: BatchCacheWriter(layout, slow_far).entry_steps() == [1, 2, 3, 4], "back window")
    assert 1003 not in calls


def _wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# --- the real reader process, killed and restarted ------------------------------------------------------


def test_reader_process_sigkill_and_restart(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * (i % 9 + 1)}) + "\n" for i in range(200)))
    cfg = DataConfig(source=str(src), seq_len=ROW - 1, micro_batch_size=MBS, cache_dir=str(tmp_path / "prep"))
    prepared = prepare_dataset(cfg)
    dataset = load_prepared(prepared.path)
    dp_size, dp_ranks, seed = 4, (2, 3), 5
    loaders = {
        r: StepBatchLoader(dataset, seed=seed, micro_batch_size=MBS, dp_rank=r, dp_size=dp_size)
        for r in dp_ranks
    }
    root = create_cache_dir(tmp_path, "job", 1)
    layout = BatchCacheLayout(root, dp_ranks, MBS, ROW, source_tag(prepared.path, seed, dp_size, MBS))
    writer, reader = BatchCacheWriter(layout, lambda s, r: loaders[r].batch(s)), BatchCacheReader(layout)
    cmd = [sys.executable, "-m", "ckless_lightning.data.cache_reader", "--prepared", str(prepared.path)]
    cmd += ["--root", str(root), "--dp-ranks", "2,3", "--dp-size", str(dp_size), "--seed", str(seed)]
    cmd += ["--micro-batch-size", str(MBS), "--prefetch", "24", "--lookback", "2", "--start-step", "0"]

    def consume(steps: range) -> None:
        for step in steps:
            for i, dp_rank in enumerate(dp_ranks):
                reader.request(step, i)
                assert_batch(reader.wait_read(step, i, timeout_s=60), loaders[dp_rank].batch(step), step)

    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
        consume(range(3))
        for i in range(2):
            reader.request(300, i)  # far: the reader refills 300..323 and gets killed while at it
        _wait_for(lambda: layout.entry_path(301).exists(), "refill started", 60)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)
        # whatever the kill interrupted, every final-named entry is complete
        assert all(writer.verify(s) for s in writer.entry_steps())
        planted = root / f".tmp-{procs[0].pid}-310"
        planted.write_bytes(layout.entry_path(301).read_bytes()[:100])  # as if killed mid-write of 310
        layout.entry_path(305).unlink(missing_ok=True)  # a consumer deleted a corrupt entry

        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
        consume(range(300, 324))
        assert not planted.exists()
        # The reader still runs and evicts behind the consumers: an entry listed here may be gone
        # by the time it is read; one that exists must be complete.
        assert all(writer.verify(s) or not layout.entry_path(s).exists() for s in writer.entry_steps())
        _wait_for(lambda: min(writer.entry_steps()) >= 321, "eviction behind the consumers")
        procs[1].send_signal(signal.SIGTERM)
        out, _ = procs[1].communicate(timeout=30)
        assert procs[1].returncode == 0, out
        assert out.count("\n") == 1 and f"root={root}" in out, out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def test_window_order_and_consumer_wants(tmp_path):
    layout = make_layout(tmp_path, dp_ranks=(0, 1))
    assert consumer_wants(layout, 7) == [7, 7]  # nobody asked yet: the start step
    BatchCacheReader(layout).request(40, 1)
    assert consumer_wants(layout, 7) == [7, 40]
    # the wanted steps first, then the rest of every window, capped by max_steps
    assert window_steps([7, 40], 3, None) == [7, 40, 8, 9, 41, 42]
    assert window_steps([7, 40], 3, 41) == [7, 40, 8, 9]
    layout.want_path(0).write_text("garbage")
    with pytest.raises(ValueError, match=r"want\.0"):
        consumer_wants(layout, 0)


@pytest.mark.parametrize(
    "modules",
    [
        "ckless_lightning.data.cache_reader, ckless_lightning.data.batch_cache",
        # The agent, a standby, the launcher and a standalone store: Lightning's import cost every
        # job's agent ~2.7 s of CPU at the job's start, beside the fork server's own imports (it came
        # in through ckless_lightning.recovery's package, for recovery.sever).
        "ckless_lightning.cli, ckless_lightning.agent.node_agent, ckless_lightning.agent.standby, "
        "ckless_lightning.store",
    ],
    ids=["reader", "agent"],
)
def test_reader_and_agent_modules_do_not_import_lightning(modules):
    code = (
        f"import sys, {modules}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_orphan_sweep_takes_only_real_cache_dirs_of_dead_agents(tmp_path):
    """The sweep removes a dead agent's cache dir, never a symlink named like one (nor its
    target), a live agent's dir, or anything not named as ours."""
    from ckless_lightning.agent.batch_cache_service import orphan_cache_dirs
    from ckless_lightning.data.batch_cache import remove_cache_dir

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"ckless-{gone.pid}-ab12"
    orphan.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    (tmp_path / f"ckless-{gone.pid}-cd34").symlink_to(victim)
    (tmp_path / f"ckless-{os.getpid()}-ef56").mkdir()  # a live agent's
    (tmp_path / "not-ours").mkdir()
    assert orphan_cache_dirs(tmp_path) == [orphan]
    with pytest.raises(ValueError, match="symlink"):
        remove_cache_dir(tmp_path, f"{gone.pid}-cd34")
    assert remove_cache_dir(tmp_path, f"{gone.pid}-ab12") and not orphan.exists()
    assert (victim / "keep").exists()
