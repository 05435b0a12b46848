"""Forming tier 4's buddy exchange groups: a world-size gloo group (before) against pair groups (now).

    python bench/buddy_groups.py [--ranks 8 16 32] [--offset 1] [--json PATH]

Per world size N it starts N processes (forked from a fork server, no training) that form, from a
common start, either one gloo group of all N ranks (what ``new_group(backend="gloo")`` built for the
buddy exchanges until 2026-12-06) or each rank's two buddy pair groups
(``replication/buddy_links.py``), on a counted client of one TCPStore. It prints, per mode and N:
the formation time (the slowest rank's, from the common start), the store requests per rank (counted
at each client) and the TCP connections per rank after forming. Both modes run in the same
invocation, so their ratio is what to read on a noisy machine."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from control_plane_procs import CountingStore

from ckless_lightning.recovery.sever import tcp_connections
from ckless_lightning.replication.buddy_links import form_buddy_links

_TIMEOUT = timedelta(seconds=120)


@dataclass
class Row:
    mode: str  # "world" (one gloo group of every rank) or "pairs" (two groups of two per rank)
    ranks: int
    offset: int
    formation_s: float  # the slowest rank's, from the common start
    store_requests_per_rank: float
    connections_per_rank: float  # TCP connections to peers each rank holds after forming (mean)
    connections_max: int


def _barrier(store: dist.TCPStore, name: str, world: int) -> None:
    if store.add(name, 1) == world:  # the last to arrive releases the others
        store.set(f"{name}/all", "1")
    store.wait([f"{name}/all"])  # bounded by the client's timeout


def _rank(mode: str, rank: int, world: int, offset: int, port: int, out: mp.Queue) -> None:
    client = dist.TCPStore("127.0.0.1", port, world, False, timeout=_TIMEOUT)
    counts: Counter[str] = Counter()
    counted = CountingStore(client, lambda kind: counts.update((kind,)))

    def peers() -> int:
        return sum(1 for local, remote in tcp_connections() if port not in (local[1], remote[1]))

    _barrier(client, "start", world)
    start = time.time()
    if mode == "world":
        groups = dist.ProcessGroupGloo(dist.PrefixStore("world/", counted), rank, world, _TIMEOUT)
    else:
        prefixed = dist.PrefixStore("pairs/", counted)
        groups = form_buddy_links(prefixed, rank=rank, world_size=world, offset=offset, timeout=_TIMEOUT)
    formed = time.time()
    requests = sum(counts.values())
    _barrier(client, "formed", world)  # every peer's inbound connections are in
    out.put((rank, start, formed, requests, peers()))
    _barrier(client, "done", world)
    del groups


def measure(mode: str, world: int, offset: int) -> Row:
    """Form ``mode``'s groups in ``world`` forked processes; their figures."""
    # forkserver: children fork from a clean process that imported torch, not from this one, whose store
    # server thread may hold libc's resolver lock at the fork (a forked child then hangs in getnameinfo)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__"])  # this script and its imports, once
    host = dist.TCPStore("127.0.0.1", 0, world, True, timeout=_TIMEOUT, wait_for_workers=False)
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(mode, r, world, offset, host.port, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        results = [out.get(timeout=_TIMEOUT.total_seconds()) for _ in range(world)]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    start = min(r[1] for r in results)
    connections = [r[4] for r in results]
    return Row(
        mode=mode,
        ranks=world,
        offset=offset,
        formation_s=max(r[2] for r in results) - start,
        store_requests_per_rank=sum(r[3] for r in results) / world,
        connections_per_rank=sum(connections) / world,
        connections_max=max(connections),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--offset", type=int, default=1, help="replication.buddy_offset")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if any(n < 2 for n in args.ranks) or any(not 0 < args.offset < n for n in args.ranks):
        parser.error(f"--ranks must be >= 2 and --offset in 1..ranks-1 (got {args.ranks}, {args.offset})")
    rows: list[Row] = []
    print(f"{'mode':>6} {'ranks':>6} {'formation':>10} {'store req/rank':>15} {'conns/rank':>11} {'max':>4}")
    for world in args.ranks:
        for mode in ("world", "pairs"):
            row = measure(mode, world, args.offset)
            rows.append(row)
            print(
                f"{mode:>6} {world:>6} {row.formation_s:>9.3f}s {row.store_requests_per_rank:>15.1f}"
                f" {row.connections_per_rank:>11.1f} {row.connections_max:>4}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
