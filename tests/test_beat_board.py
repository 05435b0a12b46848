"""The node's heartbeat board: ranks beat into shared memory, the agent reads it and publishes."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from ckless_lightning.agent.node_agent import NodeAgent
from ckless_lightning.agent.policies import ReplaceFailed
from ckless_lightning.agent.store_look import StoreLook
from ckless_lightning.comm import Heartbeat, JobStore
from ckless_lightning.comm.beat_board import _RECORD, _SLOT, BeatBoard, BoardBeats
from ckless_lightning.recovery.where import WhereReporter
from ckless_lightning.runtime.config import AgentConfig
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


def test_a_rank_process_reports_where_it_is_on_the_agents_board(board):
    """The rank's WhereReporter writes through its BoardBeats into its slot; the agent reads it there."""
    code = (
        "import sys\n"
        "from ckless_lightning.comm.beat_board import BeatBoard, BoardBeats\n"
        "BoardBeats(BeatBoard.open(sys.argv[1]), rank=7, slot=2).set_rank_where(7, 'peers')\n"
    )
    subprocess.run([sys.executable, "-c", code, board.path], check=True, timeout=60)
    assert board.read_where(2) == "peers"
    assert board.read_where(0) is None and board.read_where(1) is None
    assert board.read(2) is None  # a position is no heartbeat

    rank_side = BeatBoard.open(board.path)  # a second mapping of the same memory, as a rank has
    try:
        beats = BoardBeats(rank_side, rank=5, slot=1)
        reporter = WhereReporter(beats, 5, interval_s=0.01)
        reporter.start()
        deadline = time.monotonic() + 30
        while reporter._last is None and time.monotonic() < deadline:  # in this file's code only: a
            time.sleep(0.01)  # sample taken in the board's reads (ckless_lightning/comm/) says "peers"
        reporter.stop()
        assert board.read_where(1) == "running"  # the main thread runs this test's own code
        with pytest.raises(AssertionError):
            beats.set_rank_where(6, "peers")  # only this rank's own position
    finally:
        rank_side.close()


def test_a_slots_heartbeats_and_position_are_independent_records(board):
    board.write(1, Heartbeat(2, 5, 101.0))
    board.write(1, Heartbeat(2, 5, 100.0), by_agent=True)
    assert board.read_where(1) is None
    board.write_where(1, "device")
    board.write_where(1, "data")  # overwritten in place
    assert board.read(1) == Heartbeat(2, 5, 101.0)
    assert board.read_where(1) == "data"
    board.write(1, Heartbeat(2, 6, 102.0, "recovery"))
    board.write(1, Heartbeat(2, 6, 103.0), by_agent=True)
    assert board.read_where(1) == "data"
    assert board.read(1) == Heartbeat(2, 6, 103.0)
    assert (board.read(0), board.read_where(0), board.read(2), board.read_where(2)) == (None,) * 4


def test_a_torn_position_reads_as_none_and_the_next_write_restores_it(board):
    board.write(1, Heartbeat(1, 4, 60.0))
    board.write_where(1, "running")
    offset = 1 * _SLOT + 2 * _RECORD  # slot 1's position record
    (seq,) = struct.unpack_from("<Q", board._map, offset)
    struct.pack_into("<Q", board._map, offset, seq + 1)  # its writer killed between two stores
    assert board.read_where(1) is None
    assert board.read(1) == Heartbeat(1, 4, 60.0)  # the beats are other records
    board.write_where(1, "peers")  # the slot's next process writes on
    assert board.read_where(1) == "peers"
    board._map[offset + 16 : offset + 18] = b"xx"  # seen half written, counter even: the CRC tells
    assert board.read_where(1) is None
    board.write_where(1, "data")
    assert board.read_where(1) == "data"


class _WhereCountingJobStore(JobStore):
    asked: list[list[int]]

    def rank_where(self, ranks):
        self.asked.append(list(ranks))
        return super().rank_where(ranks)


class _Running:
    def __init__(self) -> None:
        self.pid = os.getpid()  # running, not stopped (state T)
        self.killed = False

    def poll(self) -> int | None:
        return None

    def kill(self) -> None:
        self.killed = True


def test_the_agents_hang_blame_reads_where_the_ranks_are_from_its_board(board):
    """Ranks 4 and 5 are stale, both waiting on peers; rank 6 beat a moment later but runs its own
    code: it is the one blamed, read from the node's board, with no store request (the store's
    stale ``where/<rank>`` keys say otherwise and are not read)."""
    host = JobStore.host("127.0.0.1", 0, secret=SECRET)
    store = _WhereCountingJobStore(host._server, secret=SECRET)
    store.asked = []
    store.set_rank_where(4, "running")  # what nothing writes with a board: must not be read
    store.set_rank_where(6, "peers")
    emitted: list[tuple[str, dict]] = []
    agent = NodeAgent.__new__(NodeAgent)  # the methods the policy uses, on a node of ranks 4, 5, 6
    agent.store, agent.board, agent.local_ranks = store, board, [4, 5, 6]
    agent.ranks = {r: _Running() for r in (4, 5, 6)}  # type: ignore[misc]
    agent.cfg, agent.node, agent.finished = AgentConfig(), 0, set()
    agent.events = SimpleNamespace(emit=lambda kind, **fields: emitted.append((kind, fields)))  # type: ignore[assignment]
    for slot, where in enumerate(("peers", "peers", "running")):
        BoardBeats(board, rank=4 + slot, slot=slot).set_rank_where(4 + slot, where)
    beats = {4: Heartbeat(1, 7, 100.0), 5: Heartbeat(1, 7, 100.1), 6: Heartbeat(1, 7, 100.2)}

    policy = ReplaceFailed(agent, store, budget=None)  # type: ignore[arg-type]
    assert policy._report_hang(1, [4, 5], beats) == 6
    assert agent.ranks[6].killed and not agent.ranks[4].killed  # type: ignore[attr-defined]
    [(kind, fields)] = emitted
    assert kind == "fault_detected" and fields["where"] == {"4": "peers", "5": "peers", "6": "running"}
    assert store.asked == []

    # A local rank that never reported on the board is asked of the store; no board: all of them.
    assert agent.local_where([4, 7]) == {4: "peers"} and store.asked == [[7]]
    agent.board = None
    assert agent.local_where([4, 5, 6]) == {4: "running", 6: "peers"}


@pytest.mark.timeout(60)
def test_doorbells_wake_the_agent_and_a_rank_across_processes(board):
    """A rank process opens the board's doorbells by path: it rings the agent, the agent rings its
    slot back; a wait with no ring times out; the node record reads as the agent wrote it."""
    board.write_node("4 3 1")
    code = (
        "import sys, time\n"
        "from ckless_lightning.comm.beat_board import BeatBoard\n"
        "board = BeatBoard.open(sys.argv[1])\n"
        "assert board.read_node() == '4 3 1'\n"
        "assert not board.wait_slot(1, 0.2)  # nothing rang\n"
        "board.write_request(1, 'join', 5)\n"
        "board.ring_agent()\n"
        "start = time.monotonic()\n"
        "assert board.wait_slot(1, 30)\n"
        "print(time.monotonic() - start)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, board.path], stdout=subprocess.PIPE, text=True)
    try:
        assert board.wait_for_ranks(30)  # the rank rang
        assert board.read_request(1) == ("join", 5) and board.read_request(0) == ("", -1)
        board.ring(1)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert float(out) < 5  # woken by the ring, not by its 30 s timeout
    assert not board.wait_for_ranks(0.05)  # the ring was consumed by the wait
