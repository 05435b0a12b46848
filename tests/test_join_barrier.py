"""The join barrier between generations (recovery/session.py): a waiting rank blocks in the store
until the last rank opens it, or the job leaves the generation; it does not poll (issue #31)."""

from __future__ import annotations

import threading
import time

import pytest
from store_counting import counted_client

from ckless_lightning.comm import JobStore
from ckless_lightning.comm.beat_board import BeatBoard, BoardBeats
from ckless_lightning.recovery.session import GenerationSession, JobFinished, JobGaveUp

SECRET = "join-barrier-test-secret"


@pytest.fixture
def host():
    store = JobStore.host("127.0.0.1", 0, secret=SECRET)
    yield store


@pytest.fixture
def board():
    """The node's heartbeat board (shared memory): a rank's beats to it are no store requests."""
    board = BeatBoard.create(slots=1)
    yield board
    board.close()


def _session(
    store: JobStore, rank: int, waiter: JobStore, beats: BoardBeats | None = None
) -> GenerationSession:
    return GenerationSession(
        store, rank=rank, world_size=2, generation=0, join_timeout_s=30.0, waiter=waiter, beats=beats
    )


def _join_in_thread(session: GenerationSession) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["gen"] = session.join()
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.timeout(60)
def test_a_waiting_rank_blocks_until_the_last_rank_opens_the_barrier(host, board):
    store, counting = counted_client(host)
    waiter, waits = counted_client(host)
    thread, out = _join_in_thread(_session(store, 0, waiter, BoardBeats(board, rank=0, slot=0)))
    time.sleep(2.5)  # rank 0 waits alone, blocked in the store: it does not poll
    assert thread.is_alive()
    late = host.another_client()
    joined_at = time.monotonic()
    assert _session(late, 1, late.another_client()).join() == 0  # the last rank: it opens the barrier
    thread.join(timeout=10)
    assert out["gen"] == 0
    assert out["at"] - joined_at < 0.5  # woken by the store, not by its next look a second later
    # 2.5 s of waiting: the generation read, its membership, the count, the wait and the count again
    # (a poll every 10 ms made some 250 a second)
    assert sorted(counting.calls) == ["add", "add", "add", "set"], counting.calls
    assert waits.calls == ["wait"]
    assert board.read(0).phase == "recovery"  # to the board, for its agent


@pytest.mark.timeout(60)
def test_a_rank_that_left_joins_the_generation_it_read_with_four_requests(host, board):
    # After a fault: leave() reads the job's generation (and moves it on); join() counts the rank into
    # that generation without reading it again. Four requests per rank and barrier, the wait included.
    host.set_member(1, 0)
    store, counting = counted_client(host)
    waiter, waits = counted_client(host)
    session = _session(store, 0, waiter, BoardBeats(board, rank=0, slot=0))
    assert session.leave() == 1  # it moved the job on: generation 1
    counting.calls.clear()
    thread, out = _join_in_thread(session)
    time.sleep(0.5)
    assert thread.is_alive()
    late = host.another_client()
    late_session = GenerationSession(late, rank=1, world_size=2, generation=1, join_timeout_s=30.0)
    assert late_session.join() == 1
    thread.join(timeout=10)
    assert out["gen"] == 1
    assert sorted(counting.calls) == ["add", "add", "set"], counting.calls  # count, count, membership
    assert waits.calls == ["wait"]


@pytest.mark.timeout(60)
def test_a_move_from_the_generation_wakes_its_barrier_and_the_rank_joins_the_next(host):
    store, _ = counted_client(host)
    thread, out = _join_in_thread(_session(store, 0, store.another_client()))
    time.sleep(0.5)
    assert thread.is_alive()
    host.advance_generation(0, world_size=2)  # another fault: generation 0's barrier will never fill
    time.sleep(0.3)
    assert host.joined(1) == 1  # rank 0 left the old barrier at once and counted itself into gen 1
    moved_at = time.monotonic()
    late = host.another_client()
    assert _session(late, 1, late.another_client()).join() == 1
    thread.join(timeout=10)
    assert out["gen"] == 1 and out["at"] - moved_at < 1.5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["give_up", "finished"])
def test_a_give_up_or_a_finished_job_wakes_a_waiting_rank_at_once(host, end):
    store, _ = counted_client(host)
    session = _session(store, 0, store.another_client())
    errors: dict = {}

    def run() -> None:
        try:
            session.join()
        except (JobGaveUp, JobFinished) as err:
            errors["err"], errors["at"] = err, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive()
    ended_at = time.monotonic()
    if end == "give_up":
        host.give_up("fault budget spent")
    else:
        host.mark_rank_finished(1)  # rank 1 passed its last collective: the barrier never fills
    thread.join(timeout=10)
    assert isinstance(errors["err"], JobGaveUp if end == "give_up" else JobFinished)
    assert errors["at"] - ended_at < 1.0  # the store woke it: its own look comes every 5 s
