"""The buddy exchanges' connections: one gloo group of two ranks per buddy pair, never a world-wide mesh.

Rank r sends its copy to its buddy r + o and receives its ward's from r - o (mod world, o the
``replication.buddy_offset``). Those are the only two peers its exchanges ever talk to, so each pair
("edge" k: rank k and its buddy k + o) gets a gloo process group of its own: a rank holds at most two
(one when its buddy is also its ward), forms them with O(1) store requests and connections, and a
world of any size forms all of them in three rounds.

Forming a gloo group blocks until both members connect, so the order matters: if every rank formed
its buddy's edge first, each would wait for a peer busy forming the next edge, round the whole ring.
The edges of one ring of buddies (rank c, c + o, c + 2o, ...: gcd(world, o) rings of world / gcd
ranks each) are coloured alternately 0 and 1, the last edge of an odd ring 2; every rank forms its
two edges in colour order. Adjacent edges never share a colour, so all colour-0 edges form at once,
then colour 1, then the one colour-2 edge per odd ring.

The groups are built directly (``ProcessGroupGloo`` on a prefix of the generation's store), not
registered with ``torch.distributed``: nothing but the exchange uses them, and torch's registry names a
locally synchronised group after its members and the number of groups this process already holds,
which the two members of a pair need not agree on. Their connections close when the last reference
goes (``SnapshotCopies.detach`` as the rank leaves a generation); a rank that leaves cuts them first,
with all the others (``recovery.sever``), so a peer blocked in an exchange fails at once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckless_lightning.comm.works import wait_works

__all__ = ["BuddyLinks", "edge_colour", "form_buddy_links"]


def _ring_position(rank: int, *, world_size: int, offset: int) -> tuple[int, int]:
    """``rank``'s position in its ring of buddies and the ring's length."""
    rings = math.gcd(world_size, offset)
    length = world_size // rings
    step = pow(offset // rings, -1, length) if length > 1 else 0
    return (rank - rank % rings) // rings * step % length, length


def edge_colour(source: int, *, world_size: int, offset: int) -> int:
    """The formation round (0, 1 or 2) of edge ``source`` -> ``source + offset``."""
    position, length = _ring_position(source, world_size=world_size, offset=offset)
    if length % 2 == 1 and position == length - 1:
        return 2
    return position % 2


@dataclass
class BuddyLinks:
    """A rank's two pair groups: ``to_buddy`` (this rank, its buddy) and ``from_ward`` (its ward,
    this rank); the same group when buddy and ward are one rank (world = 2 x offset)."""

    to_buddy: Any
    from_ward: Any
    buddy_index: int  # the buddy's rank in ``to_buddy``
    ward_index: int  # the ward's rank in ``from_ward``

    def send(self, tensor: torch.Tensor, tag: int = 0) -> Any:
        """Send ``tensor`` (contiguous, CPU) to the buddy; returns the work to wait for."""
        return self.to_buddy.send([tensor], self.buddy_index, tag)

    def recv(self, tensor: torch.Tensor, tag: int = 0) -> Any:
        """Receive into ``tensor`` from the ward; returns the work to wait for."""
        return self.from_ward.recv([tensor], self.ward_index, tag)

    def swap_shapes(self, mine: list[tuple[tuple[int, ...], torch.dtype]], timeout: timedelta) -> list[Any]:
        """Send this rank's shard shapes to the buddy, return the ward's (two small messages each way)."""
        payload = json.dumps([[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in mine])
        out = torch.frombuffer(bytearray(payload.encode()), dtype=torch.uint8)
        size_out, size_in = torch.tensor([out.numel()], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        wait_works((self.send(size_out, tag=1), self.recv(size_in, tag=1)), timeout)
        into = torch.empty(int(size_in.item()), dtype=torch.uint8)
        wait_works((self.send(out, tag=2), self.recv(into, tag=2)), timeout)
        theirs = []
        for shape, name in json.loads(bytes(into.numpy()).decode()):
            dtype = getattr(torch, name)
            assert isinstance(dtype, torch.dtype), f"the ward sent {name!r} as a dtype"
            theirs.append((tuple(shape), dtype))
        return theirs


def form_buddy_links(
    store: dist.Store, *, rank: int, world_size: int, offset: int, timeout: timedelta
) -> BuddyLinks:
    """Form ``rank``'s pair groups on ``store`` (the generation's namespace: its reads are bounded and
    end with the generation). Every rank of the world calls it; it returns once both of this rank's
    pairs are connected. ``timeout``: the groups' operations (the generation's collective timeout)."""
    assert world_size >= 2 and 0 < offset < world_size, (world_size, offset)
    buddy, ward = (rank + offset) % world_size, (rank - offset) % world_size
    edges = {rank: (rank, buddy), ward: (ward, rank)}  # source -> (source, its buddy)
    if buddy == ward:  # a ring of two: one pair, one group
        pair = (min(rank, buddy), max(rank, buddy))
        group = _pair_group(store, pair, rank, timeout)
        other = pair.index(buddy)
        return BuddyLinks(group, group, other, other)
    groups = {}
    for source in sorted(edges, key=lambda s: edge_colour(s, world_size=world_size, offset=offset)):
        groups[source] = _pair_group(store, edges[source], rank, timeout)
    return BuddyLinks(groups[rank], groups[ward], buddy_index=1, ward_index=0)


def _pair_group(store: dist.Store, pair: tuple[int, int], rank: int, timeout: timedelta) -> Any:
    return dist.ProcessGroupGloo(
        dist.PrefixStore(f"buddy/{pair[0]}-{pair[1]}/", store), pair.index(rank), 2, timeout
    )
