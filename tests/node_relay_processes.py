"""Processes for tests/test_node_relay.py: a node agent's relay with its ranks, and a rank alone.

    python tests/node_relay_processes.py agent PORT SECRET WORLD RANK[,RANK...]
    python tests/node_relay_processes.py rank PORT SECRET WORLD RANK BOARD SLOT [PARENT_PID]

``agent``: a node agent's part of the relay (its heartbeat board, :class:`JoinRelay`, its move watch)
that starts one rank process per RANK (they die with it, as a NodeAgent's ranks do), prints
``ready <pid> <pid>...`` and waits to be killed. ``rank``: a rank that joins the job's generations
through its node's relay (board BOARD, slot SLOT) and prints ``joined <gen>`` each time, then joins the
next one once the job moves, until killed. Every wait is bounded (the join's timeout, 60 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ckless_lightning.agent.move_watch import MoveWatch
from ckless_lightning.comm import JobStore
from ckless_lightning.comm.beat_board import BeatBoard, BoardBeats
from ckless_lightning.comm.node_relay import JoinRelay, NodeLink
from ckless_lightning.recovery.session import GenerationSession
from ckless_lightning.runtime.contract import die_with_parent

_LIFE_S = 120.0  # nothing here outlives a test's timeout


def agent(port: int, secret: str, world: int, ranks: list[int]) -> None:
    store = JobStore.connect("127.0.0.1", port, secret=secret)
    board = BeatBoard.create(len(ranks))
    relay = JoinRelay(
        board,
        ranks=ranks,
        world_size=world,
        store=store.another_client(),
        waiter=store.another_client(),
        generation=store.generation(),
    )
    watch = MoveWatch(store.another_client(), store.generation(), on_moved=relay.moved)
    watch.start()
    relay.start()
    procs = []
    for slot, rank in enumerate(ranks):
        relay.slot_started(slot)
        argv = [
            sys.executable,
            __file__,
            "rank",
            str(port),
            secret,
            str(world),
            str(rank),
            board.path,
            str(slot),
        ]
        procs.append(subprocess.Popen([*argv, str(os.getpid())]))
    print("ready", *(p.pid for p in procs), flush=True)
    time.sleep(_LIFE_S)


def rank(
    port: int, secret: str, world: int, rank: int, board_path: str, slot: int, parent: int | None
) -> None:
    if parent is not None:
        die_with_parent(parent)
    store = JobStore.connect("127.0.0.1", port, secret=secret)
    board = BeatBoard.open(board_path)
    session = GenerationSession(
        store,
        rank=rank,
        world_size=world,
        generation=0,
        join_timeout_s=60.0,
        beats=BoardBeats(board, rank=rank, slot=slot),
        waiter=store.another_client(),
        link=NodeLink(board, slot=slot),
    )
    link = NodeLink(board, slot=slot)
    deadline = time.monotonic() + _LIFE_S
    while time.monotonic() < deadline:
        gen = session.join()
        print("joined", gen, flush=True)
        link.wait_moved(gen, rank, timeout_s=deadline - time.monotonic())  # then the next generation


if __name__ == "__main__":
    mode, port, secret, world, *rest = sys.argv[1:]
    if mode == "agent":
        agent(int(port), secret, int(world), [int(r) for r in rest[0].split(",")])
    else:
        parent = int(rest[3]) if len(rest) > 3 else None
        rank(int(port), secret, int(world), int(rest[0]), rest[1], int(rest[2]), parent)
