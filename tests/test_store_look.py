"""A node agent's pass against the job store (agent/store_look.py): two requests for any number of
nodes, nothing written by an agent whose node was taken over, beat counts that never go back."""

from __future__ import annotations

import time

import pytest

from ckless_lightning.agent.store_look import StoreLook
from ckless_lightning.comm import Heartbeat, JobStore

SECRET = "store-look-test-secret"


class _CountingRequests:
    """The store a JobStore talks through, counting each request by kind."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        method = getattr(self.inner, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return call


@pytest.fixture
def host():
    store = JobStore.host("127.0.0.1", 0, secret=SECRET)
    yield store


def _client(host: JobStore) -> tuple[JobStore, _CountingRequests]:
    store = host.another_client()
    counting = _CountingRequests(store._tcp)
    store._tcp = counting  # type: ignore[assignment]
    return store, counting


@pytest.mark.parametrize("nnodes", [2, 64])
def test_a_pass_costs_one_read_and_one_write_at_any_node_count(host, nnodes):
    for node in range(1, nnodes):  # the other agents have beaten once
        host.set_node_owner(node, f"agent-{node}")
        host.agent_pass_write(node, 0, 1, {})
    host.set_node_owner(0, "agent-0")
    store, counting = _client(host)
    look = StoreLook(store, node=0, nnodes=nnodes, node_timeout_s=30.0, agent_id="agent-0")
    look.look(0, [])  # the first pass finds every key: from now on one multi_get reads them
    counting.calls.clear()
    reading = look.look(0, [])
    assert counting.calls == ["multi_get", "multi_set"]
    assert (reading.owned, reading.giveup, reading.current, reading.silent_nodes) == (True, False, 0, ())
    assert host.agent_heartbeat(0) == (0, 2)


def test_before_every_agent_beat_a_pass_reads_key_by_key_and_then_in_one_request(host):
    host.set_node_owner(0, "agent-0")
    store, counting = _client(host)
    look = StoreLook(store, node=0, nnodes=2, node_timeout_s=30.0, agent_id="agent-0")
    assert look.look(0, []).owned  # node 1's agent has not beaten: no multi_get would return
    assert "multi_get" not in counting.calls
    host.agent_pass_write(1, 0, 1, {})
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
