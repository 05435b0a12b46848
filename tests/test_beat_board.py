"""The node's heartbeat board: ranks beat into shared memory, the agent reads it and publishes."""

from __future__ import annotations

import struct
import subprocess
import sys
import time

import pytest

from ckless_lightning.agent.store_look import StoreLook
from ckless_lightning.comm import Heartbeat, JobStore
from ckless_lightning.comm.beat_board import BeatBoard, BoardBeats
from ckless_lightning.runtime.contract import RankContext, UsageError

SECRET = "test-beat-board-secret-0123456789"


@pytest.fixture
def board():
    board = BeatBoard.create(slots=3)
    yield board
    board.close()


def test_a_rank_process_beats_into_the_agents_board_by_its_path(board):
    code = (
        "import sys\n"
        "from ckless_lightning.comm import Heartbeat\n"
        "from ckless_lightning.comm.beat_board import BeatBoard, BoardBeats\n"
        "BoardBeats(BeatBoard.open(sys.argv[1]), rank=7, slot=2).set_rank_heartbeat(\n"
        "    7, Heartbeat(3, 41, 1000.5, 'recovery'))\n"
    )
    subprocess.run([sys.executable, "-c", code, board.path], check=True, timeout=60)
    assert board.read(2) == Heartbeat(3, 41, 1000.5, "recovery")
    assert board.read(0) is None and board.read(1) is None


def test_a_read_returns_the_later_of_the_ranks_and_the_agents_record(board):
    board.write(1, Heartbeat(2, -1, 100.0), by_agent=True)  # the agent starts the rank
    board.write(1, Heartbeat(2, 5, 101.0))  # the rank's steps
    assert board.read(1) == Heartbeat(2, 5, 101.0)
    board.write(1, Heartbeat(2, 5, 102.0), by_agent=True)  # a recovery restarts its hang clock
    assert board.read(1) == Heartbeat(2, 5, 102.0)
    board.write(1, Heartbeat(2, 5, 103.0, "recovery"))
    assert board.read(1) == Heartbeat(2, 5, 103.0, "recovery")


def test_a_writer_killed_mid_write_loses_only_that_beat(board):
    board.write(0, Heartbeat(1, 3, 50.0), by_agent=True)
    board.write(0, Heartbeat(1, 4, 60.0))
    # A SIGKILL between the two stores of a write leaves the rank record's counter odd.
    (seq,) = struct.unpack_from("<Q", board._map, 0)
    struct.pack_into("<Q", board._map, 0, seq + 1)
    assert board.read(0) == Heartbeat(1, 3, 50.0)  # the agent's record; never a torn beat
    board.write(0, Heartbeat(2, -1, 70.0))  # the slot's next process writes on
    assert board.read(0) == Heartbeat(2, -1, 70.0)


def test_a_beat_seen_half_written_is_never_returned(board):
    """A weakly ordered CPU can show the counter's final store before the beat's bytes: the record's
    checksum tells, and the read falls back to what it can trust."""
    board.write(0, Heartbeat(1, 3, 50.0), by_agent=True)
    board.write(0, Heartbeat(1, 4, 60.0))
    board._map[16:18] = b"99"  # the beat's first bytes (after sequence, length, CRC-32); counter even
    assert board.read(0) == Heartbeat(1, 3, 50.0)
    board.write(0, Heartbeat(1, 5, 70.0))
    assert board.read(0) == Heartbeat(1, 5, 70.0)


def test_a_board_that_cannot_be_opened_is_a_config_error_naming_the_setting(tmp_path):
    context = RankContext(rank=1, generation=0, spawn_time=0.0, beat_board=str(tmp_path / "gone"))
    with pytest.raises(UsageError, match=r"agent\.local_beats=false"):
        context.beats(store=None)  # type: ignore[arg-type]
    assert RankContext(rank=1, generation=0, spawn_time=0.0).beats(store="the store") == "the store"  # type: ignore[arg-type]


class _CountingJobStore(JobStore):
    published: list[dict[int, Heartbeat]]

    def agent_pass_write(self, node, gen, count, beats):
        if beats:
            self.published.append(dict(beats))
        super().agent_pass_write(node, gen, count, beats)


def test_the_agents_look_reads_the_board_and_publishes_what_changed_in_one_request(board):
    host = JobStore.host("127.0.0.1", 0, secret=SECRET)
    store = _CountingJobStore(host._server, secret=SECRET)
    store.published = []
    store.set_node_owner(0, "agent-a")
    look = StoreLook(
        store,
        node=0,
        nnodes=1,
        node_timeout_s=30.0,
        agent_id="agent-a",
        board=board,
        slots={4: 0, 5: 1, 6: 2},
    )
    now = time.time()
    for slot, rank in enumerate((4, 5, 6)):  # the agent starts its ranks
        beat = Heartbeat(0, -1, now)
        store.set_rank_heartbeat(rank, beat)
        board.write(slot, beat, by_agent=True)
        look.published(rank, beat)
    started = Heartbeat.parse(Heartbeat(0, -1, now).encode().encode())  # to the microsecond, as encoded
    assert look.look(0, [4, 5, 6]).beats == {r: started for r in (4, 5, 6)}
    assert store.published == []  # what the agent wrote as it started them is in the store already

    later = float(int(now)) + 1.0
    BoardBeats(board, rank=5, slot=1).set_rank_heartbeat(5, Heartbeat(0, 0, later))
    BoardBeats(board, rank=6, slot=2).set_rank_heartbeat(6, Heartbeat(0, 0, later + 1))
    beats = look.look(0, [4, 5, 6]).beats
    assert beats[5] == Heartbeat(0, 0, later) and beats[6] == Heartbeat(0, 0, later + 1)
    assert store.published == [{5: Heartbeat(0, 0, later), 6: Heartbeat(0, 0, later + 1)}]
    assert store.rank_heartbeats([4, 5, 6]) == beats  # what other nodes read
    look.look(0, [4, 5, 6])
    assert len(store.published) == 1  # nothing changed: nothing sent
