"""The job's control plane at scale, without training: N simulated ranks against the real job store.

    python bench/control_plane.py [--ranks 8 64 256 1024] [--ranks-per-node 8] [--step-ms 100]
                                  [--steps 60] [--kill-step 45] [--tier 4] [--vote collective|wait|poll]
                                  [--beats local|store] [--join node|store] [--watch-nodes K]
                                  [--procs K] [--json PATH]

Everything that is not the model runs as the job runs it, one thread per simulated rank and per
simulated node agent, against a real ``TCPStore`` hosting the job store in this process. The nodes
are split over ``--procs`` forked worker processes (whole nodes each; default one per 8 nodes), so
that 1,024 ranks' threads do not all wait for one interpreter lock (``control_plane_sim.py``;
``control_plane_procs.py``: what crosses between the processes). The
agents start first and make their store passes; the ranks start once every agent's pass reads the
job in one request, as on a real job, whose agents run for seconds before its ranks have imported:

- each rank joins generation 0 through :class:`GenerationSession` (the join barrier; it leaves and
  joins through its node agent's :class:`JoinRelay`, or with ``--join store`` through the store), holds a
  :class:`GenerationWatch` (told the job's moves by its agent's relay, or with ``--join store`` by a
  key of its own in the store, on a second connection), and per step sleeps ``--step-ms`` (the
  step's compute), beats twice (:class:`HeartbeatCallback`, as at a batch's start and end: into its
  node's heartbeat board, or with ``--beats store`` to the store), votes
  (:class:`StepCommit`) and, at tier 4, marks the job's state recorded once a generation (a step's
  fingerprint stays with the rank and its copy: no store request),
  and reports where it is once a second, as ``WhereReporter`` does when the place changed (to its
  slot of the node's board, or with ``--beats store`` to the store);
- each node agent (``--ranks-per-node`` ranks; the agents' passes begin at phases of their own, as
  on a real job whose agents start seconds apart; each reads the beats of ``--watch-nodes`` other
  agents, ``agent.watch_nodes``, 0: of every other agent, as before 2026-12-08) looks at its node
  every ``agent.monitor_interval`` (0.1 s: the board, no request) and makes the store pass every
  ``agent.store_interval`` (1 s; :class:`StoreLook`, the node agent's own code: its beat, and its
  ranks' beats that changed, in one request after one read), at once when its :class:`MoveWatch`
  sees the generation move (which it also tells its relay); when
  one of its ranks dies, it moves the job to the next generation (``JobStore.advance_generation``)
  and starts a replacement rank (new connections; heartbeat and membership written as the agent
  does);
- one rank dies before its vote on ``--kill-step`` (its thread ends; a real rank's process would);
  the others find out in the vote, leave, and join the next generation with the replacement.

``--vote collective`` (``comm.vote=collective``, the default, as ``comm.vote=auto`` resolves without
the HSDP digest): the vote is an all-reduce on the generation's
process group, not store traffic; here a two-level rendezvous stands in for it (the MIN of each
rank's flag: 0 once its watch saw the job move): a worker's rank threads meet in memory, and the
worker and this process exchange one message each per step over a pipe. A rank's death fails its
peers' pending rendezvous, in every worker, as a closed connection fails a collective.

Not simulated: process groups (their formation through the store is torch's: gloo's full mesh
costs O(world) store requests per rank; ``bench/scale_model.py`` models it), tier 4's state
transfer, data. Requests are counted at the store's door: every client connection of the simulated
job is a ``CountingStore`` around a ``TCPStore`` client, which counts each request it sends (a
``multi_get`` of k keys is one request; a ``get`` or ``multi_get`` is two, as c10d's client sends a
``WAIT`` for its keys before it reads them: counted as ``get_wait``). The store's own host
connection is not used by the job.

Per N it prints: store requests per rank-step (steady state: from the 5th step to the one before
the fault; the ranks' own are counted in that window, the node agents' are read off their passes,
agent by agent, as requests per node and second: each agent passes once per second at a phase of
its own, and a window of a few steps would hold one pass of this agent and two of that one), the
window's mean step, requests per second at the store, the vote's latency (p50, p99: from a rank's vote to
its decision, which includes waiting for the last voter), the agent's store look (p50 time), and
for the killed rank: the time from its death to every rank having joined the next generation, and
the store requests in that window (all of the job's, per node too). The simulator shares this
machine's cores with the store: ``sim_cpu_s`` is the CPU time of this process and every worker per
wall second over the steady window (2.0 = both cores of a 2-core machine busy), so that a latency can
be read against it; ``sim_cpu_per_rank_step_s`` is the same per rank-step, and the table prints what
every rank's step end then costs the machine at once (ranks x that / cores), a floor under the
vote's latency that real nodes, each with its own CPU, do not have.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from control_plane_procs import SETUP_S, Coordinator, JobSpec, Shared  # noqa: E402
from control_plane_sim import SECRET, run_worker  # noqa: E402

from ckless_lightning.comm import JobStore  # noqa: E402
from ckless_lightning.comm.store import connect_store  # noqa: E402
from ckless_lightning.runtime.config import AgentConfig  # noqa: E402

NODES_PER_PROC = 8  # --procs' default: one worker process per 8 simulated nodes (64 ranks)
RESULTS_S = 120.0  # the bound on the workers' results once the job is over


@dataclass
class Row:
    """One simulated job's figures (``--json`` writes a list of these)."""

    ranks: int
    nodes: int
    procs: int  # the simulator's worker processes (whole nodes each)
    watch_nodes: int  # the other agents whose beats each agent's pass reads (agent.watch_nodes)
    step_ms: float
    store_requests_per_rank_step: float
    store_requests_per_s: float
    # The two halves of the steady state: what ranks send per step (the vote, beats to the store), and
    # what node agents send per second (their store pass and move watch, per agent.store_interval).
    rank_requests_per_rank_step: float
    # agents/s: read off each agent's passes (their requests over the time between them), so that a
    # window holding one pass of this agent and two of that one does not count the phase;
    # ..._counted: the window's count of the agents' requests, per node and second, for comparison
    agent_requests_per_node_s: float
    agent_requests_per_node_s_counted: float
    # The steady window's mean step (--step-ms of sleep, the vote, the simulator's load): per
    # rank-step, the agents' per-second requests count in proportion to it
    step_s: float
    requests_by_kind: dict[str, float]  # per rank-step, steady state
    vote_p50_s: float
    vote_p99_s: float
    # --vote collective, the vote's two parts (p50, p99; NaN otherwise): from a rank's vote to the last
    # rank's arrival (the ranks' skew: their steps end apart), and from that arrival to its return
    # (the simulated collective's release: every waiting thread woken, one at a time, for the interpreter)
    vote_skew_p50_s: float
    vote_skew_p99_s: float
    vote_release_p50_s: float
    vote_release_p99_s: float
    agent_look_p50_s: float
    recovery_s: float
    # --join node: from the fault to the last node agent seeing the next generation's barrier full (the
    # store's part of a recovery; what is left is each node waking its own ranks). None: --join store
    recovery_store_s: float | None
    # --join node, the same recovery's earlier marks: the fault to the last rank asking its agent to
    # join the next generation (every survivor noticed the fault, left, and the replacement started),
    # and to the first node agent seeing that barrier full (the node that filled it, at once)
    recovery_asked_s: float | None
    recovery_filled_s: float | None
    recovery_store_requests: int
    recovery_store_requests_per_node: float
    recovery_requests_by_kind: dict[str, float]  # per rank, from the fault to every rank joined
    # Of recovery_store_requests_per_node: the node agents' ordinary store passes in that window (one
    # per agent.store_interval, a recovery or not: the steady state's agents/s, paid for as long as
    # the recovery lasts); the rest is the recovery's own (moves, counts, waits, the replacement)
    recovery_pass_requests_per_node: float
    # The simulator's processes' CPU seconds (the store's host, every worker) per wall second in the
    # steady window, and from the fault to every rank joined (the simulator's own load in it)
    sim_cpu_s: float
    recovery_cpu_s: float
    # The simulator's CPU seconds per rank-step in the steady window, and the cores it ran on: every
    # rank's step ends within about ranks * sim_cpu_per_rank_step_s / cores of the first (its floor
    # for the vote's skew, which on real nodes, one CPU each, is not there)
    sim_cpu_per_rank_step_s: float
    cores: int
    connections: int

    @property
    def vote_parts_measured(self) -> bool:
        return self.vote_skew_p50_s == self.vote_skew_p50_s  # not NaN: --vote collective


def _store_phase(
    barrier_full: dict[int, list[tuple[int, float]]], fault_at: float, *, first: bool = False
) -> float:
    """From the fault to the last node agent (``first``: the first) seeing the barrier of the
    generation every rank joined after it open full (--join node)."""
    last = max(gen for times in barrier_full.values() for gen, _ in times)
    seen = [t for times in barrier_full.values() for gen, t in times if gen == last]
    return (min(seen) if first else max(seen)) - fault_at


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def simulate(
    world: int,
    *,
    per_node: int,
    step_ms: float,
    steps: int,
    kill_step: int,
    tier: int,
    procs: int | None = None,
    blocking_vote: bool = True,
    local_beats: bool = True,
    collective_vote: bool = False,
    node_join: bool = True,
    watch_nodes: int = AgentConfig().watch_nodes,
) -> Row:
    """Run one simulated job of ``world`` ranks to its end, its nodes split over ``procs`` worker
    processes (None: one per ``NODES_PER_PROC`` nodes); its figures."""
    if world % per_node:
        raise SystemExit(f"--ranks {world} is not a multiple of --ranks-per-node {per_node}")
    if not 6 < kill_step < steps:
        raise SystemExit(f"--kill-step {kill_step} must be in 7..{steps - 1} (a steady window before it)")
    nodes = world // per_node
    procs = min(nodes, procs if procs is not None else -(-nodes // NODES_PER_PROC))
    host = connect_store("127.0.0.1", 0, is_master=True)
    JobStore(host, secret=SECRET).open_job()  # as JobStore.host does
    spec = JobSpec(
        world,
        per_node,
        step_ms / 1000.0,
        steps,
        kill_step,
        tier,
        port=host.port,
        procs=procs,
        blocking_vote=blocking_vote,
        collective_vote=collective_vote,
        local_beats=local_beats,
        node_join=node_join and local_beats,
        watch_nodes=watch_nodes,
    )
    ctx = mp.get_context("fork")  # the workers share what this process imported and mapped
    shared = Shared(ctx, procs, steps)
    pipes = [ctx.Pipe() for _ in range(procs)]
    workers = [
        ctx.Process(
            target=run_worker, args=(spec, i, shared, pipes[i][1]), name=f"sim-worker{i}", daemon=True
        )
        for i in range(procs)
    ]
    for worker in workers:
        worker.start()
    for _, child_end in pipes:
        child_end.close()
    coordinator = Coordinator([parent_end for parent_end, _ in pipes])
    coordinator.start()
    try:
        if not coordinator.wait_phase("ready", SETUP_S):
            shared.done.set()
            coordinator.join(RESULTS_S)
            raise SystemExit(f"{world} ranks: set-up failed: " + "; ".join(_errors(coordinator)[:3]))
        shared.go.set()
        for phase, then, what in (
            ("agents_up", shared.agents_known, "made its first store pass"),
            ("agents_steady", shared.ranks_go, "made a store pass after every agent's first"),
        ):
            if not coordinator.wait_phase(phase, SETUP_S):
                raise SystemExit(f"{world} ranks: not every node agent {what} within {SETUP_S:.0f} s")
            then.set()
        window = _watch_window(shared, steady_from=5, steady_to=kill_step - 1, bound_s=spec.bound_s)
        coordinator.join(RESULTS_S)
    finally:
        shared.done.set()
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():  # a worker past its bounds: the row below says so
                worker.kill()
                worker.join(timeout=5)
    if errors := _errors(coordinator):
        raise SystemExit(f"{world} ranks: " + "; ".join(errors[:3]))
    return _row(spec, window, coordinator.finals, shared)


def _watch_window(shared: Shared, *, steady_from: int, steady_to: int, bound_s: float) -> dict[str, Any]:
    """Until the job is over (at most ``bound_s``): the requests and CPU time at the first start of
    step ``steady_from`` and of the step after ``steady_to`` (the steady window)."""
    window: dict[str, Any] = {}
    deadline = time.monotonic() + bound_s
    while not shared.done.wait(0.01):
        if time.monotonic() > deadline:
            raise SystemExit(f"the simulated job did not end within {bound_s:.0f} s")
        if "start" not in window and (at := shared.step_start(steady_from)) is not None:
            window.update(
                start=at,
                cpu=shared.cpu_seconds(),
                counts=shared.snapshot(),
                agents=shared.snapshot(agents=True),
            )
        if "end" not in window and (at := shared.step_start(steady_to + 1)) is not None:
            # The agents' count before the whole (the start reads them after): requests counted
            # between two reads go to the ranks, so the ranks' share is never read below its count
            agents_end = shared.snapshot(agents=True)
            window.update(
                end=at, cpu_end=shared.cpu_seconds(), counts_end=shared.snapshot(), agents_end=agents_end
            )
    if "end" not in window:
        raise SystemExit(f"the simulated job ended before step {steady_to + 1}")
    return window


def _pass_rate(passes: list[tuple[int, float, float, int]], since: float, until: float) -> float | None:
    """The node agents' ordinary passes' store requests per node and second: per agent, those of its
    passes begun in [``since``, ``until``) but the last, over the time from its first to its last;
    the mean over the agents with two passes there (None: none has)."""
    by_node: dict[int, list[tuple[float, int]]] = {}
    for node, start, _, requests in passes:
        if since <= start < until:
            by_node.setdefault(node, []).append((start, requests))
    rates = []
    for node_passes in by_node.values():
        node_passes.sort()
        if len(node_passes) >= 2 and (span := node_passes[-1][0] - node_passes[0][0]) > 0:
            rates.append(sum(n for _, n in node_passes[:-1]) / span)
    return sum(rates) / len(rates) if rates else None


def _errors(coordinator: Coordinator) -> list[str]:
    return [e for _, final in sorted(coordinator.finals.items()) for e in final["errors"]] + coordinator.lost


def _row(spec: JobSpec, window: dict[str, Any], finals: dict[int, dict[str, Any]], shared: Shared) -> Row:
    """The figures, from the steady window's counts and every worker's results."""

    def merged(key: str) -> Any:
        parts = [final[key] for _, final in sorted(finals.items())]
        if isinstance(parts[0], list):
            return [x for part in parts for x in part]
        return {k: v for part in parts for k, v in part.items()}

    fault = next(f["fault"] for f in finals.values() if f["fault"] is not None)
    recovered = next(f["recovered"] for f in finals.values() if f["recovered"] is not None)
    fault_at = shared.fault_at
    assert fault_at is not None
    votes, parts, joined = merged("votes"), merged("vote_parts"), merged("joined_after_fault")
    barrier_full: dict[int, list[tuple[int, float]]] = merged("barrier_full")
    recovered_at = max(joined.values())
    wall = window["end"] - window["start"]
    rank_steps = spec.world * (spec.kill_step - 5)  # steps 5 .. kill_step - 1
    steady: Counter[str] = window["counts_end"] - window["counts"]
    by_agents = sum((window["agents_end"] - window["agents"]).values())
    by_ranks = sum(steady.values()) - by_agents
    # The agents pass once per agent.store_interval (1 s), each at a phase of its own; a window of a
    # few steps holds one pass of this agent and two of that one. Their rate is read off their passes
    # from the window's start to the fault, agent by agent (requests over the time between a first
    # and a last pass); only without two passes of any agent in that time, off the window's count.
    agents_per_node_s = _pass_rate(merged("passes"), window["start"], fault_at)
    if agents_per_node_s is None:
        agents_per_node_s = by_agents / (spec.nodes * wall)
    total = by_ranks + agents_per_node_s * spec.nodes * wall
    recovery_counts: Counter[str] = recovered[0] - fault[0]
    recovery_requests = sum(recovery_counts.values())
    steady_votes = [s for t, s in votes if window["start"] <= t <= window["end"]]
    steady_parts = [(a, b) for t, a, b in parts if window["start"] <= t <= window["end"]]
    return Row(
        ranks=spec.world,
        nodes=spec.nodes,
        procs=spec.procs,
        watch_nodes=min(spec.agent_watch_nodes, spec.nodes - 1),
        step_ms=spec.step_s * 1000.0,
        store_requests_per_rank_step=total / rank_steps,
        store_requests_per_s=total / wall,
        rank_requests_per_rank_step=by_ranks / rank_steps,
        agent_requests_per_node_s=agents_per_node_s,
        agent_requests_per_node_s_counted=by_agents / (spec.nodes * wall),
        step_s=wall / (spec.kill_step - 5),
        requests_by_kind={k: v / rank_steps for k, v in sorted(steady.items())},
        vote_p50_s=_percentile(steady_votes, 0.5),
        vote_p99_s=_percentile(steady_votes, 0.99),
        vote_skew_p50_s=_percentile([a for a, _ in steady_parts], 0.5),
        vote_skew_p99_s=_percentile([a for a, _ in steady_parts], 0.99),
        vote_release_p50_s=_percentile([b for _, b in steady_parts], 0.5),
        vote_release_p99_s=_percentile([b for _, b in steady_parts], 0.99),
        agent_look_p50_s=_percentile(merged("looks"), 0.5),
        recovery_s=recovered_at - fault_at,
        recovery_store_s=_store_phase(barrier_full, fault_at) if spec.node_join else None,
        recovery_asked_s=max(merged("asked_at").values()) - fault_at if spec.node_join else None,
        recovery_filled_s=_store_phase(barrier_full, fault_at, first=True) if spec.node_join else None,
        recovery_store_requests=recovery_requests,
        recovery_store_requests_per_node=recovery_requests / spec.nodes,
        recovery_requests_by_kind={k: v / spec.world for k, v in sorted(recovery_counts.items())},
        recovery_pass_requests_per_node=sum(
            n for _, _, t, n in merged("passes") if fault_at <= t <= recovered_at
        )
        / spec.nodes,
        sim_cpu_s=(window["cpu_end"] - window["cpu"]) / wall,
        recovery_cpu_s=(recovered[1] - fault[1]) / (recovered_at - fault_at),
        sim_cpu_per_rank_step_s=(window["cpu_end"] - window["cpu"]) / rank_steps,
        cores=len(os.sched_getaffinity(0)),
        connections=sum(f["connections"] for f in finals.values()),
    )


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument(
        "--procs",
        type=int,
        help=f"worker processes the simulated nodes are split over (default: one per {NODES_PER_PROC} nodes)",
    )
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-step", type=int, default=45)
    parser.add_argument("--tier", type=int, choices=(3, 4), default=4)
    parser.add_argument(
        "--watch-nodes",
        type=int,
        default=AgentConfig().watch_nodes,
        help="agent.watch_nodes: how many other agents' beats each agent reads (0: every other "
        "agent's, the design before 2026-12-08)",
    )
    parser.add_argument(
        "--vote",
        choices=("wait", "poll", "collective"),
        default="collective",
        help="the step vote: an all-reduce (comm.vote=collective, what comm.vote=auto is without the "
        "HSDP digest; the default); or through the store, a waiting voter blocked in it "
        "(comm.vote=store) or polling it (before)",
    )
    parser.add_argument(
        "--beats",
        choices=("local", "store"),
        default="local",
        help="where ranks beat: their node agent's board, published once per pass (today), or the store",
    )
    parser.add_argument(
        "--join",
        choices=("node", "store"),
        default="node",
        help="how ranks join a generation: through their node agent's relay (today; needs --beats "
        "local) or each through the store (before)",
    )
    parser.add_argument("--json", type=Path, help="write the rows here (a JSON list)")
    args = parser.parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # three connections per rank, both ends here
    threading.stack_size(256 * 1024)  # thousands of threads
    rows = []
    for world in args.ranks:
        print(
            f"simulating {world} ranks ({world // args.ranks_per_node} nodes) ...",
            file=sys.stderr,
            flush=True,
        )
        row = simulate(
            world,
            per_node=args.ranks_per_node,
            step_ms=args.step_ms,
            steps=args.steps,
            kill_step=args.kill_step,
            tier=args.tier,
            procs=args.procs,
            blocking_vote=args.vote != "poll",
            local_beats=args.beats == "local",
            collective_vote=args.vote == "collective",
            node_join=args.join == "node",
            watch_nodes=args.watch_nodes,
        )
        rows.append(row)
        print(
            f"  {row.store_requests_per_rank_step:.2f} requests per rank-step, "
            f"vote p99 {row.vote_p99_s * 1000:.1f} ms, recovery {row.recovery_s:.2f} s",
            file=sys.stderr,
        )
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return rows


def _table(rows: list[Row]) -> str:
    head = (
        f"{'ranks':>6} {'nodes':>5} {'step':>6} {'req/rank-step':>13} {'ranks':>6} {'agents/s':>8} "
        f"{'req/s':>7} "
        f"{'vote p50':>9} {'vote p99':>9} "
        f"{'look p50':>9} {'recovery':>9} {'of it store':>11} {'rec. req':>9} {'req/node':>9} {'passes':>7} "
        f"{'sim cpu':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.ranks:>6} {r.nodes:>5} {r.step_s * 1e3:>4.0f}ms {r.store_requests_per_rank_step:>13.3f} "
            f"{r.rank_requests_per_rank_step:>6.3f} {r.agent_requests_per_node_s:>8.2f} "
            f"{r.store_requests_per_s:>7.0f} {r.vote_p50_s * 1e3:>7.1f}ms {r.vote_p99_s * 1e3:>7.1f}ms "
            f"{r.agent_look_p50_s * 1e3:>7.2f}ms {r.recovery_s:>8.2f}s {_seconds(r.recovery_store_s):>11} "
            f"{r.recovery_store_requests:>9} "
            f"{r.recovery_store_requests_per_node:>9.1f} {r.recovery_pass_requests_per_node:>7.1f} "
            f"{r.sim_cpu_s:>8.2f}"
        )
    lines.append(
        "(step: the steady window's mean step; req/rank-step: every request; of them, 'ranks': the ranks' own"
        " per rank-step, 'agents/s': the node agents' per node and second (read off each agent's passes:"
        " they come once per agent.store_interval, so per rank-step they cost agents/s x step / ranks per"
        " node); 'of it store': the fault to the last node agent seeing the next"
        " barrier full, the rest is each node waking its ranks; 'req/node': a recovery's store requests"
        " per node, all of the job's from the fault to every rank joined; 'passes': of them, the node"
        " agents' ordinary store passes meanwhile, one per agent.store_interval, a recovery or not)"
    )
    kinds = sorted({k for r in rows for k in r.requests_by_kind})
    lines.append("")
    lines.append("requests per rank-step by kind: " + ", ".join(kinds))
    for r in rows:
        lines.append(f"{r.ranks:>6}: " + "  ".join(f"{k} {r.requests_by_kind.get(k, 0):.2f}" for k in kinds))
    lines.append("")
    lines.append(
        "the recovery, from the fault (--join node): every rank asked its agent to join -> the barrier"
        " filled -> the last node agent saw it -> every rank joined; the simulator's CPU meanwhile"
        " (CPU seconds per wall second, every process of it)"
    )
    for r in rows:
        lines.append(
            f"{r.ranks:>6}: asked {_seconds(r.recovery_asked_s)}  filled {_seconds(r.recovery_filled_s)}  "
            f"last agent {_seconds(r.recovery_store_s)}  joined {r.recovery_s:.2f}s  "
            f"cpu {r.recovery_cpu_s:.2f}"
        )
    if any(r.vote_parts_measured for r in rows):
        lines.append("")
        lines.append(
            "the collective vote's parts (p50 / p99): the vote -> the last rank's arrival (the ranks'"
            " skew), that arrival -> the vote's return (the release: messages, threads woken)"
        )
        for r in rows:
            lines.append(
                f"{r.ranks:>6}: skew {r.vote_skew_p50_s * 1e3:.1f} / {r.vote_skew_p99_s * 1e3:.1f} ms  "
                f"release {r.vote_release_p50_s * 1e3:.1f} / {r.vote_release_p99_s * 1e3:.1f} ms"
            )
    lines.append("")
    lines.append(
        "the simulator's own load: its CPU per rank-step in the steady window, and what every rank's"
        " step end costs the machine's cores at once (ranks x that / cores: a floor under the vote's"
        " skew that real nodes, each with its own CPU, do not have)"
    )
    for r in rows:
        floor = r.ranks * r.sim_cpu_per_rank_step_s / r.cores
        lines.append(
            f"{r.ranks:>6}: {r.sim_cpu_per_rank_step_s * 1e6:.0f} us per rank-step, {r.procs} worker"
            f" process(es) on {r.cores} cores: {floor * 1e3:.1f} ms per step end"
        )
    kinds = sorted({k for r in rows for k in r.recovery_requests_by_kind})
    lines.append("")
    lines.append("recovery store requests per rank by kind: " + ", ".join(kinds))
    for r in rows:
        by_kind = r.recovery_requests_by_kind
        lines.append(f"{r.ranks:>6}: " + "  ".join(f"{k} {by_kind.get(k, 0):.2f}" for k in kinds))
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # c10d looks up the name of every client socket's address (for its messages); the address is
    # IPv4-mapped IPv6, which /etc/hosts does not name, so each connect asks DNS. A resolver that
    # drops a burst of such queries stalls the connect for its timeout (5 s per ~50 connections on
    # the machine this was written on): 1 s, one try, keeps thousands of connections quick.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    main()
    # Threads of the last job still blocked in the store's C++ calls would abort the interpreter's
    # shutdown (std::terminate); everything is printed and written by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
