"""Peer reachability probes (agent/peer_reach.py): the verdict, the probe, the store records, and one
check end to end on loopback. The job-level test is tests/test_partition.py's peers-only cut."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest

from ckless_lightning.agent.peer_reach import (
    PeerReach,
    ReachListener,
    Verdict,
    peer_host,
    probe,
    reach_verdict,
    wait_for_replacement,
)
from ckless_lightning.comm import Heartbeat, JobStore
from ckless_lightning.runtime.config import AgentConfig

SECRET = "peer-reach-test-secret-0123456789"
OWNERS = {0: "a0", 1: "a1"}


def test_the_verdict_cuts_off_the_side_with_fewer_nodes_and_a_standby_breaks_a_tie():
    assert reach_verdict(OWNERS, ["s"], {}) == []  # nobody reported a miss: one part
    # Node 1 reaches nobody (its peer link is down); node 0 reaches the standby.
    assert reach_verdict(OWNERS, ["s"], {"a1": ["a0", "s"], "a0": ["a1"]}) == [1]
    # Node 1 did not report at all: node 0 missing it is enough.
    assert reach_verdict(OWNERS, ["s"], {"a0": ["a1"]}) == [1]
    # Node 0 is the one cut off: the standby sides with node 1.
    assert reach_verdict(OWNERS, ["s"], {"a0": ["a1", "s"], "a1": ["a0"]}) == [0]
    # Two nodes and no standby: a tie, the lowest node stays (one decision, never both).
    assert reach_verdict(OWNERS, [], {"a0": ["a1"], "a1": ["a0"]}) == [1]
    # A dead registered agent (an old owner, a dead standby) that nobody reaches cuts nobody off.
    assert reach_verdict(OWNERS, ["old", "s"], {"a0": ["old"], "a1": ["old"]}) == []
    # Three nodes, node 2 alone: the two that reach each other stay.
    owners = {0: "a0", 1: "a1", 2: "a2"}
    assert reach_verdict(owners, [], {"a0": ["a2"], "a1": ["a2"], "a2": ["a0", "a1"]}) == [2]
    # Four nodes split two and two, a standby with nodes 2 and 3: they stay.
    owners = {0: "a0", 1: "a1", 2: "a2", 3: "a3"}
    apart = {"a0": ["a2", "a3", "s"], "a1": ["a2", "a3", "s"]}
    assert reach_verdict(owners, ["s"], apart) == [0, 1]


def test_probe_tells_a_listener_from_a_closed_port_and_a_silent_address():
    with ReachListener("127.0.0.1") as listener:
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            closed_port = closed.getsockname()[1]  # bound, not listening: refused
        addresses = {
            "up": listener.address,
            "closed": f"127.0.0.1:{closed_port}",
            "silent": "192.0.2.1:9",  # TEST-NET-1: no answer (or unroutable)
        }
        started = time.monotonic()
        assert probe(addresses, timeout_s=0.5) == ["closed", "silent"]
        assert time.monotonic() - started < 5.0  # bounded by the timeout, not TCP's retries
        # The listener keeps answering (its accept thread empties the backlog).
        assert probe({f"up{i}": listener.address for i in range(300)}, timeout_s=2.0) == []


def test_peer_host_reads_the_interface_the_ranks_use():
    assert peer_host({"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert peer_host({"NCCL_SOCKET_IFNAME": "=lo"}) == "127.0.0.1"
    hostname_address = socket.gethostbyname(socket.gethostname())
    assert peer_host({"NCCL_SOCKET_IFNAME": "^docker,lo"}) == hostname_address  # an exclusion: default
    assert peer_host({}) == hostname_address
    with pytest.raises(OSError):
        peer_host({"GLOO_SOCKET_IFNAME": "no-such-if0"})


def test_probe_after_is_validated_and_defaults_to_a_quarter_of_hang_timeout():
    assert AgentConfig(hang_timeout=20).probe_after == 5
    with pytest.raises(ValueError, match=r"agent\.probe_after=30 must be above 0"):
        AgentConfig(hang_timeout=20, probe_after=30)


@pytest.fixture
def store():
    host = JobStore.host("127.0.0.1", 0, secret=SECRET)
    yield host
    del host


def _beats(now: float, silent_s: float) -> dict[int, Heartbeat]:
    return {0: Heartbeat(0, 7, now - silent_s, "step"), 1: Heartbeat(0, 7, now, "step")}


def test_a_check_finds_the_node_cut_off_and_every_agent_reads_one_verdict(store):
    """Node 1's listener is gone (its peer link down): node 0's check and node 1's (which reaches
    nobody: the others' addresses are unroutable from it, simulated by its own probe of closed ports)
    store one verdict, and both read it."""
    with _node0_beside_node1_and_a_standby(store, probe_after_s=1.0) as (reach0, l1):
        l1.close()  # node 1 no longer answers
        now = time.time()
        assert not reach0.suspects(now, _beats(now, 0.5), [0, 1])
        assert not reach0.suspects(now, {0: Heartbeat(0, -1, now - 5, "start")}, [0])  # before step 1
        assert reach0.suspects(now, _beats(now, 1.5), [0, 1])
        reach0.check(gen=0)
        reach0.check(gen=0)  # one check at a time
        verdict = _taken(reach0)
        assert verdict.cut_off == (1,) and verdict.unreached == ("a1",) and verdict.round == 1
        # Node 1's later verdict computation (it reached nobody) cannot change the stored one.
        assert store.settle_reach_verdict(0, 1, [0]) == [1]
        assert store.reach_reports(0, 1) == {0: ("a0", ["a1"])}


@contextlib.contextmanager
def _node0_beside_node1_and_a_standby(
    store, *, probe_after_s: float
) -> Iterator[tuple[PeerReach, ReachListener]]:
    """Node 0's :class:`PeerReach` (registered), node 1's listener (registered; close it to cut node 1
    off) and a standby's, on loopback."""
    store.set_node_owner(0, "a0")
    store.set_node_owner(1, "a1")
    with ReachListener("127.0.0.1") as l0, ReachListener("127.0.0.1") as standby:
        store.register_reach("s", standby.address)
        l1 = ReachListener("127.0.0.1")
        reach0 = PeerReach(
            store,
            l0,
            agent_id="a0",
            node=0,
            nnodes=2,
            probe_after_s=probe_after_s,
            connect=lambda: JobStore(store._server, secret=SECRET),
        )
        reach0.register()
        store.register_reach("a1", l1.address)
        try:
            yield reach0, l1
        finally:
            l1.close()


def _taken(reach: PeerReach) -> Verdict:
    deadline = time.monotonic() + 10
    while (verdict := reach.take()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return verdict


def test_a_silence_with_everyone_reachable_leaves_later_checks_of_the_generation(store):
    """A check that found every agent reachable (a straggler that went on) does not use
    up the generation: this agent checks again ``probe_after`` later and finds the cut that came since;
    another agent that did not report in that check joins it instead of starting one."""
    with _node0_beside_node1_and_a_standby(store, probe_after_s=0.5) as (reach0, l1):
        reach0.check(gen=3)
        first = _taken(reach0)
        assert (first.gen, first.round, first.cut_off, first.unreached) == (3, 1, (), ())
        l1.close()  # now node 1 no longer answers
        reach0.check(gen=3)  # within probe_after of the last check: not yet
        assert reach0.take() is None and store.reach_round(3) == 1
        time.sleep(0.6)
        reach0.check(gen=3)
        second = _taken(reach0)
        assert (second.round, second.cut_off, second.unreached) == (2, (1,), ("a1",))
        # Node 1's agent reported in neither: it joins the current check, and reads its verdict.
        assert store.reach_round(3) == 2 and store.next_reach_round(3, 1) == 2
        assert store.settle_reach_verdict(3, 2, []) == [1]
        assert store.reach_round(4) == 0  # a generation's checks are its own


def test_agents_that_start_a_check_at_once_share_its_round(store):
    """Both nodes' agents start a check of the same generation at the same moment: one round, both
    reports in it, one verdict both read (none cut off: every agent answers)."""
    with _node0_beside_node1_and_a_standby(store, probe_after_s=0.5) as (reach0, l1):
        reach1 = PeerReach(
            store,
            l1,
            agent_id="a1",
            node=1,
            nnodes=2,
            probe_after_s=0.5,
            connect=lambda: JobStore(store._server, secret=SECRET),
        )
        for gen in (5, 6, 7):  # each generation's first round
            reach0.check(gen=gen)
            reach1.check(gen=gen)
            verdicts = [_taken(reach0), _taken(reach1)]
            assert [(v.gen, v.round, v.cut_off) for v in verdicts] == [(gen, 1, ())] * 2
            assert sorted(store.reach_reports(gen, 1)) == [0, 1] and store.reach_round(gen) == 1


def test_a_cut_off_agent_waits_until_its_node_is_taken_or_the_job_ends(store):
    store.set_node_owner(1, "a1")
    renewals = []

    def wait(**hosting: bool) -> str:
        return wait_for_replacement(
            store,
            1,
            "a1",
            interval_s=0.01,
            renewed=lambda: renewals.append(1),
            others=[0],
            silent_s=60,
            **hosting,
        )

    store.give_up("test")
    assert wait() == "giveup"
    store.set_node_owner(1, "standby")
    assert wait() == "taken"
    # The store's host never leaves for a takeover: it serves the job to its end.
    assert wait(hosting=True) == "giveup"
    assert renewals == []  # each returned at its first look, before a renewal


def test_a_cut_off_agent_left_alone_stops_waiting(store):
    """Every other node's agent silent (node 0 beat once, then nothing): the wait ends, bounded."""
    store.set_node_owner(1, "a1")
    store.agent_pass_write(0, 0, 5, {})
    started = time.monotonic()
    how = wait_for_replacement(
        store, 1, "a1", interval_s=0.05, renewed=lambda: None, others=[0], silent_s=0.5
    )
    assert how == "lost" and time.monotonic() - started < 10
