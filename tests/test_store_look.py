"""A node agent's pass against the job store (agent/store_look.py): two requests for any number of
nodes, nothing written by an agent whose node was taken over, beat counts that never go back; the
agent's two cadences (a look at its node every agent.monitor_interval, a store pass every
agent.store_interval) and its move watch (agent/move_watch.py), which brings a generation move at
once."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from store_counting import counted_client

from ckless_lightning.agent.move_watch import MoveWatch
from ckless_lightning.agent.node_agent import NodeAgent
from ckless_lightning.agent.policies import Action
from ckless_lightning.agent.store_look import StoreLook
from ckless_lightning.comm import Heartbeat, JobStore
from ckless_lightning.comm.beat_board import BeatBoard, BoardBeats
from ckless_lightning.runtime.config import AgentConfig, job_config_from_dict

SECRET = "store-look-test-secret"


@pytest.fixture
def host():
    store = JobStore.host("127.0.0.1", 0, secret=SECRET)
    yield store


@pytest.mark.parametrize("nnodes", [2, 64])
def test_a_pass_costs_one_read_and_one_write_at_any_node_count(host, nnodes):
    for node in range(1, nnodes):  # the other agents have beaten once
        host.set_node_owner(node, f"agent-{node}")
        host.agent_pass_write(node, 0, 1, {})
    host.set_node_owner(0, "agent-0")
    store, counting = counted_client(host)
    look = StoreLook(store, node=0, nnodes=nnodes, node_timeout_s=30.0, agent_id="agent-0")
    look.look(0, [])  # the first pass finds every key: from now on one multi_get reads them
    counting.calls.clear()
    reading = look.look(0, [])
    assert counting.calls == ["multi_get", "multi_set"]
    assert (reading.owned, reading.giveup, reading.current, reading.silent_nodes) == (True, False, 0, ())
    assert host.agent_heartbeat(0) == (0, 2)


def test_before_every_agent_beat_a_pass_reads_key_by_key_and_then_in_one_request(host):
    host.set_node_owner(0, "agent-0")
    store, counting = counted_client(host)
    look = StoreLook(store, node=0, nnodes=2, node_timeout_s=30.0, agent_id="agent-0")
    assert look.look(0, []).owned  # node 1's agent has not beaten: no multi_get would return
    assert "multi_get" not in counting.calls
    host.agent_pass_write(1, 0, 1, {})
    # A TCPStore client sends a set without waiting for a reply; a read on the same connection
    # returns only after the store applied it, so the other client's check below sees the beat.
    assert host.agent_heartbeat(1) == (0, 1)
    counting.calls.clear()
    look.look(0, [])
    assert counting.calls == ["check", "multi_get", "multi_set"]


def test_an_agent_whose_node_was_taken_over_writes_nothing(host):
    host.set_node_owner(0, "agent-0")
    host.set_rank_heartbeat(0, Heartbeat(0, 3, 100.0))
    look = StoreLook(host, node=0, nnodes=1, node_timeout_s=30.0, agent_id="agent-0")
    look.look(0, [0])
    before = host.agent_heartbeat(0)
    host.set_node_owner(0, "standby-1")  # a standby claimed the node while this agent was silent
    look_after = look.look(0, [0])
    assert not look_after.owned and look_after.beats == {}
    assert host.agent_heartbeat(0) == before


def test_a_new_owner_goes_on_from_the_nodes_beat_count(host):
    host.set_node_owner(0, "agent-0")
    first = StoreLook(host, node=0, nnodes=1, node_timeout_s=30.0, agent_id="agent-0")
    for _ in range(3):
        first.look(0, [])
    assert host.agent_heartbeat(0) == (0, 3)
    host.set_node_owner(0, "standby-1")
    second = StoreLook(host, node=0, nnodes=1, node_timeout_s=30.0, agent_id="standby-1")
    second.look(1, [])
    assert host.agent_heartbeat(0) == (1, 4)  # a claim names a count: it never comes back


def test_a_released_node_is_silent_at_once_and_claimed_without_waiting(host):
    """A node agent that gives its node up (cut off from the others: agent/peer_reach.py) writes its
    count negated: the other agents count the node lost at their next pass, a standby claims it at
    once, and the new owner goes on from the count's size."""
    from ckless_lightning.agent.standby import StandbyWatch

    for node in (0, 1):
        host.set_node_owner(node, f"agent-{node}")
    looks = [StoreLook(host, node=n, nnodes=2, node_timeout_s=30.0, agent_id=f"agent-{n}") for n in (0, 1)]
    for look in looks:
        look.look(0, [])
    assert looks[0].look(0, []).silent_nodes == ()
    looks[1].release(0)
    assert host.agent_heartbeat(1) == (0, -2)
    assert looks[0].look(0, []).silent_nodes == ((1, 0),)  # not node_timeout (30 s) later
    started = time.monotonic()
    watch = StandbyWatch(host, nnodes=2, node_timeout_s=30.0, agent_id="standby-1", interval_s=0.01)
    assert watch.wait_for_lost_node() == 1 and time.monotonic() - started < 10
    assert host.node_owner(1) == "standby-1"
    StoreLook(host, node=1, nnodes=2, node_timeout_s=30.0, agent_id="standby-1").look(1, [])
    assert host.agent_heartbeat(1) == (1, 3)


def test_a_node_whose_count_stops_is_silent_after_the_timeout(host):
    for node in (0, 1):
        host.set_node_owner(node, f"agent-{node}")
    watcher = StoreLook(host, node=0, nnodes=2, node_timeout_s=0.2, agent_id="agent-0")
    other = StoreLook(host, node=1, nnodes=2, node_timeout_s=0.2, agent_id="agent-1")
    other.look(0, [])
    assert watcher.look(0, []).silent_nodes == ()
    time.sleep(0.3)
    other.look(0, [])  # it beats: not silent
    assert watcher.look(0, []).silent_nodes == ()
    time.sleep(0.3)
    assert watcher.look(0, []).silent_nodes == ((1, 0),)


def test_the_first_reason_to_give_up_stands_and_every_pass_sees_it(host):
    host.set_node_owner(0, "agent-0")
    look = StoreLook(host, node=0, nnodes=1, node_timeout_s=30.0, agent_id="agent-0")
    assert host.giveup_reason() is None and not look.look(0, []).giveup
    host.give_up("fault budget spent (3 restarts)")
    host.give_up("another reason", code=2)
    assert host.giveup_reason() == "fault budget spent (3 restarts)"
    assert host.giveup_code() is None
    assert look.look(0, []).giveup


def test_a_glance_reads_the_board_alone_with_the_last_passs_reading(host):
    board = BeatBoard.create(2)
    try:
        host.set_node_owner(0, "agent-0")
        store, counting = counted_client(host)
        look = StoreLook(
            store, node=0, nnodes=1, node_timeout_s=30.0, agent_id="agent-0", board=board, slots={0: 0, 1: 1}
        )
        for slot in (0, 1):  # the agent starts its ranks
            board.write(slot, Heartbeat(0, -1, 100.0), by_agent=True)
            look.published(slot, Heartbeat(0, -1, 100.0))
        assert look.glance([0, 1]) is None  # before the first store pass: only a pass can answer
        look.look(0, [0, 1])
        host.advance_generation(0, world_size=2)
        BoardBeats(board, rank=1, slot=1).set_rank_heartbeat(1, Heartbeat(0, 3, 101.0))
        counting.calls.clear()
        glance = look.glance([0, 1])
        assert counting.calls == []
        assert glance is not None and glance.beats[1] == Heartbeat(0, 3, 101.0)
        assert (glance.owned, glance.giveup, glance.current) == (True, False, 0)  # the last pass's
        assert look.look(0, [0, 1]).current == 1
    finally:
        board.close()


def test_without_a_board_a_glance_answers_with_the_last_passs_beats(host):
    host.set_node_owner(0, "agent-0")
    host.set_rank_heartbeat(0, Heartbeat(0, 3, 100.0))
    host.set_rank_heartbeat(1, Heartbeat(0, 3, 100.0))
    look = StoreLook(host, node=0, nnodes=1, node_timeout_s=30.0, agent_id="agent-0")
    look.look(0, [0])
    host.set_rank_heartbeat(0, Heartbeat(0, 4, 101.0))
    glance = look.glance([0])
    assert glance is not None and glance.beats == {0: Heartbeat(0, 3, 100.0)}  # read at the pass
    assert look.glance([0, 1]) is None  # rank 1 was not read: a store pass answers


# -- the move watch (agent/move_watch.py) ---------------------------------------------------------


def test_the_move_watch_wakes_at_a_move_and_follows_the_job(host):
    watch = MoveWatch(host.another_client(), 0)
    watch.start()
    try:
        assert not watch.take()
        for gen in (0, 1):
            start = time.monotonic()
            threading.Timer(0.2, lambda g=gen: host.advance_generation(g, world_size=2)).start()
            watch.pause(5.0)
            assert watch.take() and time.monotonic() - start < 2.0
    finally:
        watch.stop(release=host)
    assert not watch._thread.is_alive()


def test_a_give_up_wakes_the_move_watch_and_a_stop_without_release_is_bounded(host):
    watch = MoveWatch(host.another_client(), 0)
    watch.start()
    try:
        threading.Timer(0.2, lambda: host.give_up("fault budget spent")).start()
        watch.pause(5.0)
        assert watch.take()  # every agent's next store pass at once: it reads the reason
        start = time.monotonic()
        watch.stop(join_s=0.3)  # its node done first, the job goes on: nobody releases it yet
        assert time.monotonic() - start < 1.0 and watch._thread.is_alive()
    finally:
        watch.stop(release=host)  # the job is over
    assert not watch._thread.is_alive()


def test_a_mover_that_died_before_the_wake_up_is_seen_at_the_recheck(host):
    watch = MoveWatch(host.another_client(), 0, recheck_s=0.3)
    watch.start()
    try:
        host._tcp.compare_set("gen", "0", "1")  # a mover killed before it woke the watches
        watch.pause(3.0)
        assert watch.take() and watch.generation == 1
    finally:
        watch.stop(release=host)


# -- the agent's two cadences (NodeAgent._observe) ------------------------------------------------


class _FakeRank:
    """A local rank's process as the supervision loop sees it: running until ``ends_at`` (monotonic),
    then exit 0. Its pid is this process's (never stopped)."""

    def __init__(self, ends_at: float) -> None:
        self.ends_at = ends_at
        self.pid = os.getpid()

    def poll(self) -> int | None:
        return 0 if time.monotonic() >= self.ends_at else None

    def stop(self, grace_s: float) -> None:
        self.ends_at = 0.0

    def kill(self) -> None:
        self.ends_at = 0.0


def _supervising_agent(compose, host: JobStore, lives: dict[int, float], *overrides: str):
    """A node agent of a one-node, two-rank tier-0 job on ``host`` through a counting client, whose
    ranks (fakes) of generation ``g`` run ``lives[g]`` seconds; the starts it made, (gen, monotonic)."""
    job = job_config_from_dict(
        compose(
            "tier='0'",
            "fault=none",
            "cluster.nproc_per_node=2",
            "agent.fork_server=false",
            "data.mmap_cache=false",
            "agent.monitor_interval=0.1",
            *overrides,
        )
    )
    agent = NodeAgent(job, Path("unused.yaml"), prepared_path=None, secret=SECRET)
    store, counting = counted_client(host)
    agent._attach_store(store)
    store.set_node_owner(0, agent.agent_id)
    started: list[tuple[int, float]] = []

    def start_ranks(gen: int) -> None:  # as NodeAgent.start_rank writes a started rank's beat
        started.append((gen, time.monotonic()))
        for slot, rank in enumerate(agent.local_ranks):
            beat = Heartbeat(gen, -1, time.time())
            agent.board.write(slot, beat, by_agent=True)
            agent._look.published(rank, beat)
            agent.ranks[rank] = _FakeRank(time.monotonic() + lives[gen])

    agent.start_ranks = start_ranks  # type: ignore[method-assign]
    return agent, counting, started


def test_the_agent_goes_to_the_store_once_a_store_interval_not_once_a_look(compose, host):
    agent, counting, started = _supervising_agent(compose, host, {0: 3.0}, "agent.store_interval=1.0")
    try:
        assert agent._supervise() == 0  # its ranks run 3 s, then exit 0
    finally:
        agent._stop_watch(release=True)
        agent.board.close()
    begin = started[0][1]
    steady = [t for t in counting.times if begin + 0.5 <= t < begin + 2.5]  # 20 looks at its node
    # Two store passes of two requests each (a multi_get, a multi_set); a pass per look made 40.
    assert 2 <= len(steady) <= 6, counting.calls
    assert {"multi_get", "multi_set"} >= {counting.calls[counting.times.index(t)] for t in steady}


def test_a_generation_moved_by_someone_else_reaches_the_agent_at_once(compose, host):
    # A store pass every 5 s: only the move watch brings the move within 2 s.
    agent, _, started = _supervising_agent(compose, host, {0: 30.0, 1: 0.3}, "agent.store_interval=5")
    moved_at: list[float] = []

    def move() -> None:
        moved_at.append(time.monotonic())
        host.advance_generation(0, world_size=2)  # another node's agent, or a rank

    timer = threading.Timer(1.5, move)  # after the agent's first store pass, well before its second
    timer.start()
    try:
        assert agent._supervise() == 0
    finally:
        timer.cancel()
        agent._stop_watch(release=True)
        agent.board.close()
    assert [gen for gen, _ in started] == [0, 1]
    assert started[1][1] - moved_at[0] < 2.0  # tiers 0-2 restart every rank on it


def test_node_0_waiting_for_the_other_nodes_sleeps_between_looks_after_a_wake(compose, host):
    """A wake the loop did not take yet (here: set by hand) must not turn the wait into a busy loop."""
    agent, counting, _ = _supervising_agent(
        compose, host, {}, "cluster.nnodes=2", "cluster.master_port=29999", "cluster.master_addr=127.0.0.1"
    )
    agent._watch = MoveWatch(host.another_client(), 0)
    agent._watch.start()
    agent._watch.moved.set()
    threading.Timer(1.0, lambda: host.mark_done(0, 1)).start()  # node 1 is done a second later
    try:
        assert agent._wait_for_other_nodes(0).action is Action.DONE
    finally:
        agent._stop_watch(release=True)
        agent.board.close()
    assert len(counting.calls) < 80, len(counting.calls)  # about 4 a look, a look per 0.1 s


# -- agent.store_interval -------------------------------------------------------------------------


def test_store_interval_defaults_to_a_second_and_must_leave_node_timeout_room():
    assert AgentConfig().store_interval == 1.0
    assert AgentConfig(node_timeout=4).store_interval == 1.0  # the tests' small node_timeout
    with pytest.raises(ValueError, match=r"agent\.store_interval must be a positive number"):
        AgentConfig(store_interval=0)
    with pytest.raises(ValueError) as err:
        AgentConfig(node_timeout=4, store_interval=2)
    message = str(err.value)
    assert "agent.store_interval=2 must be at most agent.node_timeout/3 = 1.33 s" in message
    assert "lower agent.store_interval or raise agent.node_timeout to at least 6" in message
    AgentConfig(node_timeout=6, store_interval=2)  # the fix it names works


def test_store_interval_composes_from_the_command_line(compose):
    assert job_config_from_dict(compose("agent.store_interval=0.5")).agent.store_interval == 0.5
    with pytest.raises(ValueError, match=r"agent\.store_interval=20 must be at most"):
        job_config_from_dict(compose("agent.store_interval=20"))


# -- who watches whom (agent.watch_nodes) ----------------------------------------------------------


def _agents(host, nnodes, *, timeout_s=30.0, watch_nodes=2):
    for node in range(nnodes):
        host.set_node_owner(node, f"agent-{node}")
    return [
        StoreLook(host, node=n, nnodes=nnodes, node_timeout_s=timeout_s, agent_id=f"agent-{n}",
                  watch_nodes=watch_nodes)
        for n in range(nnodes)
    ]  # fmt: skip


def _silent(look, gen=0):
    return sorted(node for node, _ in look.look(gen, []).silent_nodes)


def test_each_agent_watches_the_next_nodes_and_every_node_is_watched_as_often(host):
    """A pass reads ``watch_nodes`` other agents' beats at any job size (one key more per watcher
    is what the store pays per node, not one per node); every node has that many watchers; a job
    of at most watch_nodes + 1 nodes is watched by every other node, as before."""
    looks = _agents(host, 64)
    assert looks[0].watched() == [1, 2] and looks[62].watched() == [63, 0] and looks[63].watched() == [0, 1]
    watchers = Counter(n for look in looks for n in look.watched())
    assert set(watchers.values()) == {2} and len(watchers) == 64
    for look in looks:
        look.look(0, [])
    assert all(look.watched() == [(look.node + 1) % 64, (look.node + 2) % 64] for look in looks)
    assert _agents(host, 3)[1].watched() == [2, 0]
    assert _agents(host, 5, watch_nodes=4)[2].watched() == [3, 4, 0, 1]


def test_lost_watchers_hand_their_watch_to_the_agent_before_them(host):
    """Nodes 1, 2 and 3 of 6 are lost together: 1 and 2 were 3's only watchers. The live agents
    before them (5 and 0) find the silent nodes they watch, read on past them and find the next,
    until they watch two live nodes again; a live node's list stays as it was; a lost node that
    beats again (a standby took it) ends the watch past it."""
    looks = _agents(host, 6, timeout_s=1.0)  # room for a loaded machine's pauses
    for look in looks:
        look.look(0, [])
    deadline = time.monotonic() + 20
    while _silent(looks[5]) != [1, 2, 3] and time.monotonic() < deadline:
        looks[4].look(0, [])
        looks[0].look(0, [])
        time.sleep(0.05)
    # Node 5 watched 0 and 1; 1 silent, it read 2 as well, and then 3: one node_timeout each
    assert _silent(looks[5]) == [1, 2, 3] and looks[5].watched() == [0, 1, 2, 3, 4]
    assert _silent(looks[0]) == [1, 2, 3] and looks[0].watched() == [1, 2, 3, 4, 5]
    assert _silent(looks[4]) == [] and looks[4].watched() == [5, 0]  # a live node's list as it was
    # A standby took node 2 over: it beats again, from the count it fell silent at
    host.set_node_owner(2, "standby-2")
    StoreLook(host, node=2, nnodes=6, node_timeout_s=1.0, agent_id="standby-2").look(1, [])
    assert _silent(looks[0], 1) == [1, 3] and looks[0].watched() == [1, 2, 3, 4]
    # Node 5's pass that finds 2 live still read 3 (silent); the next reads 0, 1 and 2 alone: 3 is
    # watched by 0 and (the standby's) 2
    assert _silent(looks[5], 1) == [1, 3] and looks[5].watched() == [0, 1, 2]
    assert _silent(looks[5], 1) == [1] and looks[5].watched() == [0, 1, 2]


def test_a_node_watched_again_is_timed_from_then_on(host):
    """A node an agent stopped watching (the silence before it ended) and watches again is timed
    from the new look, not from the count it read before: never lost at once on an old reading."""
    looks = _agents(host, 4, timeout_s=1.0)  # room for a loaded machine's pauses
    for look in looks + looks[1:] + looks[:1]:  # every agent beat, and 0 read the last beats of 1 and 2
        look.look(0, [])
    time.sleep(1.1)
    looks[2].look(0, [])  # 1 is silent, 2 and 3 beat
    looks[3].look(0, [])
    assert _silent(looks[0]) == [1] and looks[0].watched() == [1, 2, 3]
    assert _silent(looks[0]) == [1]  # this pass read 3's count
    looks[1].look(0, [])  # 1 beats again
    assert _silent(looks[0]) == [] and looks[0].watched() == [1, 2]
    looks[0].look(0, [])  # a pass without 3: its count is forgotten
    time.sleep(1.1)  # 1 and 3 fall silent; 2 beats
    looks[2].look(0, [])
    assert _silent(looks[0]) == [1] and looks[0].watched() == [1, 2, 3]
    assert _silent(looks[0]) == [1]  # 3's count is timed from this pass, not from 1.1 s ago


def test_watch_nodes_must_be_at_least_one_and_composes_from_the_command_line(compose):
    assert AgentConfig().watch_nodes == 2
    with pytest.raises(ValueError, match=r"agent\.watch_nodes must be at least 1 .* got 0: leave it at 2"):
        AgentConfig(watch_nodes=0)
    assert job_config_from_dict(compose("agent.watch_nodes=3")).agent.watch_nodes == 3
