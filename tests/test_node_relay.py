"""The node relay (comm/node_relay.py): a node's ranks join a generation through their agent, which
makes the store requests once for them all; the ranks' generation watches learn a move from it too.
Killed inside the relay's barrier, a rank is not counted on its behalf, and an agent takes its ranks
with it (issue #31)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from store_counting import counted_client

from ckless_lightning.agent.move_watch import MoveWatch
from ckless_lightning.comm import JobStore
from ckless_lightning.comm.beat_board import BeatBoard, BoardBeats
from ckless_lightning.comm.node_relay import JoinRelay, NodeLink, NodeView
from ckless_lightning.recovery.session import GenerationSession, JobFinished, JobGaveUp
from ckless_lightning.recovery.watch import GenerationWatch

SECRET = "node-relay-test-secret-0123456789"
PROCESSES = Path(__file__).with_name("node_relay_processes.py")


class Node:
    """A node agent's part of the relay, in this process: its board, relay and move watch, with the
    relay's two store clients counted."""

    def __init__(self, host: JobStore, ranks: list[int], world: int, *, start: bool = True) -> None:
        self.ranks = ranks
        self.board = BeatBoard.create(len(ranks))
        self.store, self.counts = counted_client(host)
        self.waiter, self.waits = counted_client(host)
        self.relay = JoinRelay(
            self.board, ranks=ranks, world_size=world, store=self.store, waiter=self.waiter, generation=0
        )
        self.watch = MoveWatch(host.another_client(), 0, on_moved=self.relay.moved)
        self.watch.start()
        for slot in range(len(ranks)):
            self.relay.slot_started(slot)
        if start:
            self.relay.start()

    def session(self, host: JobStore, rank: int, world: int) -> tuple[GenerationSession, list[str]]:
        """A rank of this node joining through the relay; the list of its own store requests."""
        store, counting = counted_client(host)
        slot = self.ranks.index(rank)
        session = GenerationSession(
            store,
            rank=rank,
            world_size=world,
            generation=0,
            join_timeout_s=30.0,
            beats=BoardBeats(self.board, rank=rank, slot=slot),
            waiter=store.another_client(),
            link=NodeLink(self.board, slot=slot),
        )
        return session, counting.calls

    def close(self, host: JobStore) -> None:
        self.relay.stop()
        self.watch.stop(release=host)
        self.board.close()


@pytest.fixture
def host():
    return JobStore.host("127.0.0.1", 0, secret=SECRET)


@pytest.fixture
def nodes(host):
    made: list[Node] = []

    def make(ranks: list[int], world: int, *, start: bool = True) -> Node:
        made.append(Node(host, ranks, world, start=start))
        return made[-1]

    yield make
    for node in made:
        node.close(host)


def _join_all(sessions: list[GenerationSession]) -> list[int]:
    out: dict[int, int] = {}
    threads = [
        threading.Thread(target=lambda s=s: out.__setitem__(s.rank, s.join()), daemon=True) for s in sessions
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert len(out) == len(sessions), f"joined: {sorted(out)}"
    return [out[s.rank] for s in sorted(sessions, key=lambda s: s.rank)]


@pytest.mark.timeout(60)
def test_a_node_counts_its_ranks_in_with_two_requests_and_waits_with_two(host, nodes):
    world = 6
    a, b = nodes([0, 1, 2], world, start=False), nodes([3, 4, 5], world, start=False)
    joining = [node.session(host, r, world) for node in (a, b) for r in node.ranks]
    out: dict[int, int] = {}
    threads = [
        threading.Thread(target=lambda s=s: out.__setitem__(s.rank, s.join()), daemon=True)
        for s, _ in joining
    ]
    for thread in threads:
        thread.start()
    # Every rank asked before the agents serve (a node's ranks asking further apart than the relay's
    # gathering would be counted in two rounds, which is right too)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(
        node.board.read_request(slot) == ("join", 0) for node in (a, b) for slot in range(3)
    ):
        time.sleep(0.02)
    for node in (a, b):
        node.relay.start()
    for thread in threads:
        thread.join(timeout=20)
    assert out == dict.fromkeys(range(world), 0)
    # Each rank: its first join reads the job's generation, nothing more (a leave reads it already)
    assert [calls for _, calls in joining] == [["add"]] * world
    # Each node: the ranks' membership and their count, all ranks of a node counted at once; the node
    # that filled the barrier opens it and knows it full (no wait); the other waits for it once and
    # reads the count once
    filled = [node for node in (a, b) if "set" in node.counts.calls]
    assert len(filled) == 1, [node.counts.calls for node in (a, b)]
    for node in (a, b):
        if node in filled:
            assert sorted(node.counts.calls) == ["add", "multi_set", "set"], node.counts.calls
            assert node.waits.calls == [], node.waits.calls
        else:
            assert sorted(node.counts.calls) == ["add", "multi_set"], node.counts.calls
            assert node.waits.calls == ["wait", "add"], node.waits.calls
    assert host.joined(0) == world
    assert {host.member(r) for r in range(world)} == {0}
    assert all(b.board.read(slot).phase == "recovery" for slot in range(3))  # beats go to the board


@pytest.mark.timeout(60)
def test_ranks_leaving_ask_their_agent_which_moves_the_job_once_for_the_node(host, nodes):
    world = 4
    a, b = nodes([0, 1], world), nodes([2, 3], world)
    joining = [node.session(host, r, world) for node in (a, b) for r in node.ranks]
    sessions = [s for s, _ in joining]
    assert _join_all(sessions) == [0] * world
    for node in (a, b):
        node.counts.calls.clear()
    for _, calls in joining:
        calls.clear()
    left: dict[int, int] = {}
    threads = [threading.Thread(target=lambda s=s: left.__setitem__(s.rank, s.leave())) for s in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert left == dict.fromkeys(range(world), 1)
    assert host.generation() == 1
    # No rank went to the store; each node moved the job at most once (one compare_set; its first
    # also wrote the restart time, woke the watches and announced), or learned it moved from its watch
    assert [calls for _, calls in joining] == [[]] * world
    moves = [node.counts.calls.count("compare_set") for node in (a, b)]
    assert 1 <= sum(moves) <= 2 and max(moves) == 1, moves
    assert _join_all(sessions) == [1] * world  # the generation each leave read: no read again
    assert [calls for _, calls in joining] == [[]] * world
    assert host.joined(1) == world


@pytest.mark.timeout(60)
def test_a_rank_waits_until_the_barrier_fills_and_follows_a_move_without_store_requests(host, nodes):
    world = 2
    a = nodes([0], world)
    session, calls = a.session(host, 0, world)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("gen", session.join()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while a.board.read_request(0) != ("join", 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.0)
    assert thread.is_alive() and calls == ["add"]  # it waits on its doorbell, not in the store
    host.advance_generation(0, world_size=world)  # another fault: generation 0 never fills
    deadline = time.monotonic() + 10
    while host.joined(1) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert thread.is_alive() and host.joined(1) == 1  # it followed the move, counted in by the relay
    late = host.another_client()
    assert GenerationSession(late, rank=1, world_size=world, generation=1, join_timeout_s=30.0).join() == 1
    thread.join(timeout=10)
    assert out["gen"] == 1
    assert calls.count("add") == 1 and "wait" not in calls  # the move came through its agent's record
    assert NodeLink(a.board, slot=0).view() == NodeView(moved=1, barrier=1, full=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["give_up", "finished"])
def test_a_give_up_or_a_finished_job_ends_a_relayed_wait(host, nodes, end):
    world = 2
    a = nodes([0], world)
    session, _ = a.session(host, 0, world)
    errors: dict = {}

    def run() -> None:
        try:
            session.join()
        except (JobGaveUp, JobFinished) as err:
            errors["err"], errors["at"] = err, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while host.joined(0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    ended_at = time.monotonic()
    if end == "give_up":
        host.give_up("fault budget spent")
    else:
        host.mark_rank_finished(1)  # (it opens the generation's barrier)
    thread.join(timeout=20)
    assert isinstance(errors.get("err"), JobGaveUp if end == "give_up" else JobFinished), errors
    assert errors["at"] - ended_at < 4.0  # woken by its agent's record, not its look 5 s later


@pytest.mark.timeout(60)
def test_a_generation_watch_learns_the_move_from_the_relay(host, nodes):
    world = 2
    a = nodes([0, 1], world)
    waiter, waits = counted_client(host)
    link = NodeLink(a.board, slot=1)
    watch = GenerationWatch(host, 0, 1, waiter=waiter, on_stuck=lambda: None, moves=link, grace_s=30.0)
    watch.start()
    time.sleep(0.5)
    moved_at = time.monotonic()
    host.advance_generation(0, world_size=world)
    while not watch.moved and time.monotonic() - moved_at < 10:
        time.sleep(0.01)
    assert watch.moved, "the move did not reach the watch"  # (its own recheck would be 600 s away)
    watch.stop()
    assert "wait" not in waits.calls  # no pending request of the rank's own in the store
    # A watch stopped before any move ends at once, through its own doorbell
    quiet = GenerationWatch(host, 1, 1, waiter=waiter, on_stuck=lambda: None, moves=link)
    quiet.start()
    time.sleep(0.2)
    stopped_at = time.monotonic()
    quiet.stop()
    assert time.monotonic() - stopped_at < 5.0 and not quiet.moved  # not its 600 s recheck


def _rank_process(port: int, world: int, rank: int, board: BeatBoard, slot: int) -> subprocess.Popen:
    argv = [
        sys.executable,
        str(PROCESSES),
        "rank",
        str(port),
        SECRET,
        str(world),
        str(rank),
        board.path,
        str(slot),
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def _read_joined(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """The generation ``proc`` printed it joined next (its stdout line ``joined <gen>``)."""
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert result and result[0].startswith("joined "), f"no join within {timeout_s} s: {result}"
    return int(result[0].split()[1])


def _end(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(120)
def test_a_rank_killed_inside_the_relayed_barrier_is_not_counted_for_and_is_replaced(host, nodes):
    """Ranks 0 and 1 (processes of node a) wait in generation 0's barrier for rank 2; rank 1 is
    killed there. The agent's part, as ReplaceFailed does it: mark the slot lost, move the job (rank 1
    was a member of generation 0), start a replacement. Everyone joins generation 1, counted once."""
    world = 3
    a = nodes([0, 1], world)
    port = host.port
    procs = [_rank_process(port, world, r, a.board, r) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 30
        while host.joined(0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.joined(0) == 2 and host.member(1) == 0  # both counted in by their agent
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=10)
        a.relay.slot_lost(1)  # the agent saw it exit
        assert host.member(1) >= host.generation()  # a member of the current generation: move on
        assert host.advance_generation(0, world_size=world) == 1
        a.relay.slot_started(1)
        procs.append(_rank_process(port, world, 1, a.board, 1))
        late = host.another_client()
        assert (
            GenerationSession(late, rank=2, world_size=world, generation=1, join_timeout_s=30.0).join() == 1
        )
        assert _read_joined(procs[0]) == 1 and _read_joined(procs[2]) == 1
        assert host.joined(1) == world  # each rank counted once: none for the killed process
        assert host.joined(0) == 2  # generation 0 stayed short; the move opened it
    finally:
        _end(procs)


@pytest.mark.timeout(120)
def test_an_agent_killed_inside_the_relayed_barrier_takes_its_ranks_and_the_job_moves_on(host, nodes):
    """Node a's agent (a process with its two rank processes) is killed while its ranks wait in
    generation 0's barrier for rank 2 (node b), which is not there yet. Its ranks die with it, the
    barrier never opens full, and once the job moves on (what the other agents do for a lost node)
    rank 2 and node a's replacements (here: a new relay in this process) join generation 1."""
    world = 3
    port = host.port
    agent = subprocess.Popen(
        [sys.executable, str(PROCESSES), "agent", str(port), SECRET, str(world), "0,1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    rank_pids: list[int] = []
    try:
        line = agent.stdout.readline()
        assert line.startswith("ready "), line
        rank_pids = [int(pid) for pid in line.split()[1:]]
        deadline = time.monotonic() + 30
        while host.joined(0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.joined(0) == 2
        b = nodes([2], world)
        session, _ = b.session(host, 2, world)
        out: dict = {}
        thread = threading.Thread(target=lambda: out.setdefault("gen", session.join()), daemon=True)
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in rank_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in rank_pids), "the agent's ranks outlived it"
        assert host.joined(0) == 2  # nothing counted for the dead: the barrier never opened full
        assert host.advance_generation(0, world_size=world) == 1  # the job leaves the lost node
        thread.start()  # rank 2 arrives after the move
        replacement = nodes([0, 1], world)
        sessions = [replacement.session(host, r, world)[0] for r in (0, 1)]
        for s in sessions:
            s.generation = 1
        assert _join_all(sessions) == [1, 1]
        thread.join(timeout=20)
        assert out.get("gen") == 1
        assert host.joined(1) == world
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(timeout=10)
        agent.stdout.close()
        for pid in rank_pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie child of this process counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
