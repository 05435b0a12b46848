"""``bench/control_plane.py``'s process plumbing: what its parent and forked workers share.

The simulated job's nodes are split over ``--procs`` forked worker processes
(``control_plane_sim.py``); this module is what crosses between them. :class:`JobSpec`: the job as
every process knows it. :class:`Shared` (memory mapped before the fork): every worker's request
counts by kind (:class:`CountingStore` clients; each worker writes its own slots, anyone reads them
all), when each step first started, the fault's time, how many ranks joined after it, the processes'
ids (for their CPU time) and the job's phases and end. The collective vote's stand-in is
hierarchical: a worker's ranks meet in memory (:class:`ProcAllReduce`), the worker sends the parent
one arrival per step over its pipe, and the parent's :class:`Coordinator` answers every worker once
all arrived (or tells them all the generation broke).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from torch.distributed import Store, TCPStore

SETUP_S = 600.0  # a worker's wait for each phase of the job's start (the parent's bound is the same)
# The job's start: every worker built its ranks and agents; every agent made its first store pass;
# every agent made one since, which found every other agent's keys (one request, as in a steady job)
PHASES = ("ready", "agents_up", "agents_steady")
# The store requests counted, by kind (a get's and a multi_get's WAIT apart: "get_wait")
KINDS = (
    "set", "get_wait", "get", "add", "compare_set", "check", "wait", "multi_get", "multi_set", "delete_key",
    "num_keys",
)  # fmt: skip
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class CountingStore(Store):
    """A ``TCPStore`` client that calls ``on_request(kind)`` for each request it sends."""

    def __init__(self, inner: TCPStore, on_request: Callable[[str], None]) -> None:
        super().__init__()
        self._inner = inner
        self._count = on_request

    @property
    def host(self) -> str:
        return self._inner.host

    @property
    def port(self) -> int:
        return self._inner.port

    def set(self, key: str, value: Any) -> None:
        self._count("set")
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get_wait")  # c10d's client sends a WAIT for the key first, then the GET
        self._count("get")
        return self._inner.get(key)

    def add(self, key: str, value: int) -> int:
        self._count("add")
        return self._inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count("compare_set")
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        self._count("check")
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait")
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count("get_wait")  # as get: a WAIT for the keys, then the MULTI_GET
        self._count("multi_get")
        return self._inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._count("multi_set")
        self._inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        self._count("num_keys")
        return self._inner.num_keys()


@dataclass
class JobSpec:
    """The simulated job, as every process knows it."""

    world: int
    per_node: int
    step_s: float
    steps: int
    kill_step: int
    tier: int
    port: int  # the job store's
    procs: int
    blocking_vote: bool = True  # False: waiting votes poll the decision (the design before)
    collective_vote: bool = False  # True: comm.vote=collective (ProcAllReduce), no store request
    local_beats: bool = True  # False: every rank beats to the store (agent.local_beats=false, before)
    node_join: bool = True  # False: every rank joins through the store (the design before the relay)
    watch_nodes: int = 2  # agent.watch_nodes; 0: every agent reads every other's beat (before 2026-12-08)

    def __post_init__(self) -> None:
        assert self.world % self.per_node == 0 and 1 <= self.procs <= self.nodes
        assert self.local_beats or not self.node_join, "the node relay goes through the board"

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    @property
    def agent_watch_nodes(self) -> int:
        """What each simulated agent's ``StoreLook`` is given as ``watch_nodes`` (0: every other node)."""
        return self.watch_nodes or max(1, self.nodes - 1)

    @property
    def bound_s(self) -> float:
        """The bound on the whole job, its start's phases past (parent and workers alike)."""
        return SETUP_S + 60.0 * self.steps

    def worker_nodes(self, index: int) -> range:
        """Worker ``index``'s nodes: a contiguous block (node 0, the killed rank's, is worker 0's)."""
        return range(index * self.nodes // self.procs, (index + 1) * self.nodes // self.procs)


class Shared:
    """What the parent and its workers share, in memory mapped before the fork (``ctx``: a fork
    context). A worker's threads serialize their own counts with the worker's lock; readers take
    each 64-bit slot as it is."""

    def __init__(self, ctx: Any, procs: int, steps: int) -> None:
        self.procs = procs
        self.counts = ctx.RawArray("q", procs * 2 * len(KINDS))  # [worker][all, agents][kind]
        self.step_started = ctx.RawArray("d", steps + 2)  # step -> first rank's monotonic start (0: not yet)
        self.fault = ctx.RawValue("d", 0.0)  # the fault's monotonic time (0: none yet)
        self.joined = ctx.Value("i", 0)  # ranks joined after the fault (its lock: one count at a time)
        self.pids = ctx.RawArray("i", procs + 1)  # [0]: the parent
        self.pids[0] = os.getpid()
        self.go = ctx.Event()  # every worker is ready: start the agents
        self.agents_known = ctx.Event()  # every agent made its first store pass (so every key exists)
        self.ranks_go = ctx.Event()  # every agent made a pass since, reading all in one: start the ranks
        self.done = ctx.Event()  # the job is over (rank 0 finished, or a thread failed)

    def count(self, worker: int, kind: str, *, agent: bool) -> None:
        """One request of ``kind`` from ``worker`` (call under that worker's lock)."""
        base = worker * 2 * len(KINDS)
        index = KINDS.index(kind)
        self.counts[base + index] += 1
        if agent:
            self.counts[base + len(KINDS) + index] += 1

    def snapshot(self, *, agents: bool = False) -> Counter[str]:
        """Every worker's requests so far (``agents``: the node agents' only)."""
        totals: Counter[str] = Counter()
        for worker in range(self.procs):
            base = worker * 2 * len(KINDS) + (len(KINDS) if agents else 0)
            for index, kind in enumerate(KINDS):
                if value := self.counts[base + index]:
                    totals[kind] += value
        return totals

    def mark_step(self, step: int) -> None:
        if not self.step_started[step]:  # two ranks racing here write times a moment apart
            self.step_started[step] = time.monotonic()

    def step_start(self, step: int) -> float | None:
        return self.step_started[step] or None

    @property
    def fault_at(self) -> float | None:
        return self.fault.value or None

    def cpu_seconds(self) -> float:
        """The CPU time of the parent (which hosts the store) and every worker so far, in clock ticks
        (10 ms: read it over seconds, not a few steps of milliseconds)."""
        ticks = 0
        for pid in self.pids:
            if not pid:
                continue
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # a worker that already ended: its time is not counted
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / _CLOCK_TICKS


class PeerLost(RuntimeError):
    """The simulated collective vote lost a member (a real one fails with "Connection closed by peer")."""


class ProcAllReduce:
    """The collective vote's stand-in, a worker's part: per (generation, step), the MIN of its ranks'
    flags goes to the parent once all ``local`` ranks arrived (with the last arrival's time); the
    parent's answer, the MIN over every worker and the last arrival's time of all, ends the wait. A
    member's death, or the job leaving the generation (its ranks' watches cut their connections),
    fails every vote of the generation still waiting, in every worker (:meth:`break_generation`)."""

    def __init__(self, local: int, send: Callable[[tuple], None]) -> None:
        self.local = local
        self.send = send
        self.cond = threading.Condition()
        self.flags: dict[tuple[int, int], list[int]] = {}
        self.results: dict[tuple[int, int], int] = {}
        self.full_at: dict[tuple[int, int], float] = {}  # (gen, step) -> perf_counter of the last arrival
        self.broken: set[int] = set()

    def vote(self, gen: int, step: int, flag: int, timeout_s: float = 600.0) -> bytes:
        key = (gen, step)
        with self.cond:
            flags = self.flags.setdefault(key, [])
            flags.append(flag)
            if len(flags) == self.local:  # only the answer ends the others' wait (one wake-up a step)
                self.send(("arrive", gen, step, min(flags), time.perf_counter()))
            self.cond.wait_for(lambda: gen in self.broken or key in self.results, timeout_s)
            if key not in self.results:  # (a real one can also end on some ranks and fail on others)
                raise PeerLost(f"generation {gen}, step {step}: a peer left the collective")
            return b"commit" if self.results[key] == 1 else b"abandon"

    def answered(self, gen: int, step: int, flag: int, full_at: float) -> None:
        with self.cond:
            self.results[gen, step] = flag
            self.full_at[gen, step] = full_at
            self.cond.notify_all()

    def break_generation(self, gen: int, *, tell: bool = True) -> None:
        with self.cond:
            if gen in self.broken:
                return
            self.broken.add(gen)
            self.cond.notify_all()
        if tell:
            self.send(("break", gen))


class Coordinator(threading.Thread):
    """The parent's side of the workers' pipes: the collective vote's last hop, the workers'
    ``ready`` and ``final`` messages. Ends when every worker sent its final message or closed."""

    def __init__(self, conns: list[Connection]) -> None:
        super().__init__(name="coordinator", daemon=True)
        self.conns = conns
        # The job's start, phase by phase (PHASES): the workers that reached each, and all of them
        self.reached: dict[str, set[int]] = {phase: set() for phase in PHASES}
        self.all_reached: dict[str, threading.Event] = {phase: threading.Event() for phase in PHASES}
        self.finals: dict[int, dict[str, Any]] = {}
        self.lost: list[str] = []  # workers whose pipe closed before their final message
        self._arrivals: dict[tuple[int, int], list[float]] = {}  # (gen, step) -> [count, min flag, last]
        self._broken: set[int] = set()
        self._closed: set[int] = set()  # workers whose pipe refused a message (they ended)

    def wait_phase(self, phase: str, timeout_s: float) -> bool:
        """Whether every worker reached ``phase`` within ``timeout_s``."""
        self.all_reached[phase].wait(timeout_s)
        return len(self.reached[phase]) == len(self.conns)

    def run(self) -> None:
        live = list(self.conns)
        while live:
            for conn in wait(live, timeout=1.0):
                index = self.conns.index(conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    live.remove(conn)
                    if index not in self.finals:
                        self.lost.append(f"worker {index} ended without its results")
                    continue
                if msg[0] == "final":
                    self.finals[index] = msg[1]
                    live.remove(conn)
                else:
                    self._handle(index, msg)
        for event in self.all_reached.values():  # nobody waits on a phase that cannot come
            event.set()

    def _handle(self, index: int, msg: tuple) -> None:
        kind = msg[0]
        if kind in PHASES:
            self.reached[kind].add(index)
            if len(self.reached[kind]) == len(self.conns):
                self.all_reached[kind].set()
        elif kind == "arrive":
            _, gen, step, flag, at = msg
            entry = self._arrivals.setdefault((gen, step), [0, 1, 0.0])
            entry[0], entry[1], entry[2] = entry[0] + 1, min(entry[1], flag), max(entry[2], at)
            if entry[0] == len(self.conns):
                self._tell(("result", gen, step, entry[1], entry[2]))
        elif kind == "break":
            if msg[1] not in self._broken:
                self._broken.add(msg[1])
                self._tell(msg)
        else:
            raise AssertionError(f"worker {index} sent {msg!r}")

    def _tell(self, msg: tuple) -> None:
        for index, conn in enumerate(self.conns):
            if index in self.finals or index in self._closed:  # it reads no more
                continue
            try:
                conn.send(msg)
            except (BrokenPipeError, ConnectionResetError):
                # It ended (its results may still be in the pipe): run() reads them, or reports a
                # worker that ended without them
                self._closed.add(index)
