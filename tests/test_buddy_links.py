"""Tier 4's buddy exchanges over pairwise gloo groups: formation order, connections per rank, shapes."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from dist import free_port, run_ranks

from ckless_lightning.comm.works import wait_works
from ckless_lightning.recovery.sever import tcp_connections
from ckless_lightning.recovery.where import where_is
from ckless_lightning.replication.buddy_links import edge_colour, form_buddy_links
from ckless_lightning.replication.snapshots import SnapshotCopies


def _formation_rounds(world: int, offset: int) -> int:
    """Simulate every rank forming its edges in colour order, an edge forming once both of its ranks
    reach it; the number of rounds until all formed (raises on a deadlock)."""
    if 2 * offset == world:  # one group per pair: no order to keep
        return 1
    edges = {k: frozenset({k, (k + offset) % world}) for k in range(world)}
    todo = {
        r: sorted({r, (r - offset) % world}, key=lambda k: edge_colour(k, world_size=world, offset=offset))
        for r in range(world)
    }
    rounds = 0
    while any(todo.values()):
        ready = {k for k in edges if all(todo[r] and todo[r][0] == k for r in edges[k])}
        assert ready, f"deadlock: world {world}, offset {offset}, left {todo}"
        for r in todo:
            if todo[r] and todo[r][0] in ready:
                todo[r].pop(0)
        rounds += 1
    return rounds


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 24, 33, 64, 1000, 1001])
def test_pair_groups_form_in_at_most_three_rounds_for_every_offset(world):
    """Adjacent edges of a ring never share a colour, so forming in colour order never deadlocks and
    takes at most three rounds whatever the world size (a ring order would take world / gcd rounds)."""
    for offset in range(1, world):
        for source in range(world):
            here = edge_colour(source, world_size=world, offset=offset)
            before = edge_colour((source - offset) % world, world_size=world, offset=offset)
            assert here in (0, 1, 2) and (here != before or 2 * offset == world), (world, offset, source)
        assert _formation_rounds(world, offset) <= 3, (world, offset)
    if world == 1001:  # one odd ring of 1,001 ranks: its colour-2 edge takes the third round
        assert _formation_rounds(1001, 1) == 3


def _links_rank(rank: int, world: int, offset: int, port: int) -> dict:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))

    def peer_connections() -> set:
        return {(local, remote) for local, remote in tcp_connections() if port not in (local[1], remote[1])}

    dist.barrier()  # the test's own gloo mesh is complete everywhere
    before = peer_connections()
    links = form_buddy_links(
        dist.PrefixStore("links/", store),
        rank=rank,
        world_size=world,
        offset=offset,
        timeout=timedelta(seconds=30),
    )
    ward = (rank - offset) % world
    shapes = links.swap_shapes([((rank, 3), torch.float32), ((0,), torch.bfloat16)], timedelta(seconds=30))
    sent, got = torch.full((rank + 1,), float(rank)), torch.empty(ward + 1)
    for work in (links.send(sent), links.recv(got)):
        work.wait(timedelta(seconds=30))
    new = peer_connections() - before  # before any wait: see the assertion below
    dist.barrier()
    del links, work  # a work holds its group
    time.sleep(0.2)
    left = peer_connections() - before
    dist.barrier()
    return {"shapes": shapes, "got": got.tolist(), "new": len(new), "left": len(left)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "offset"), [(5, 2), (4, 2), (3, 1), (2, 1)])
def test_buddy_links_hold_one_connection_per_pair_and_move_shapes_and_copies(world, offset):
    """Each rank connects to its buddy and its ward only (one connection for a ring of two), learns
    its ward's shard shapes from the ward (an empty shard too), receives its ward's copy, and the
    connections close when the links are dropped."""
    results = run_ranks(_links_rank, world, offset, free_port(), timeout=90)
    for rank, result in enumerate(results):
        ward = (rank - offset) % world
        assert result["shapes"] == [((ward, 3), torch.float32), ((0,), torch.bfloat16)]
        assert result["got"] == [float(ward)] * (ward + 1)
        # At most one connection per pair, never a mesh. Not "exactly": under load (seen about 1 run
        # in 10-20 with a connection churn beside it), gloo closes the receiving end of the ward's
        # pair soon after its last message, the exchange already complete; the cause is open
        # (docs/troubleshooting.md), so the count is taken at once and bounded, not pinned.
        assert 1 <= result["new"] <= (1 if 2 * offset == world else 2), result
        assert result["left"] == 0, result


def test_a_rank_blocked_in_a_buddy_exchange_reports_peers():
    """The exchanges' waits (snapshots' settle, the shape swap, a restore's transfers) go through
    comm/works.py, so a rank blocked in one reports ``peers``: after a cut, its generation watch ends
    it after comm.stuck_exit_s (a gloo send to a peer behind a dead link stays blocked), and a hang
    blames it after a rank in its own code. Seen before: ``running`` in a partition run, the rank
    left blocked until the agent's hang timeout."""
    seen: list[str] = []

    class BlockedWork:
        def wait(self, timeout: timedelta | None = None) -> None:  # the innermost Python frame's caller
            seen.append(where_is(sys._getframe(1)))

    snapshots = SnapshotCopies(rank=0, world_size=2, source="buddy", buddy_offset=1)
    snapshots._pending = SimpleNamespace(works=[BlockedWork()], held=None, step=1)
    assert snapshots.settle(timeout_s=1.0)
    wait_works([BlockedWork()])
    assert seen == ["peers", "peers"]
