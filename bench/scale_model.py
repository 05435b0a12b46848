"""A MODEL, NOT A MEASUREMENT: recovery time per fault and goodput per tier at 256, 2,304 and 16,384 GPUs.

    python bench/scale_model.py [--json PATH] [--measured PATH] [--scales 256 2304 16384]
                                [--tier4-source hsdp|buddy] [--<input> VALUE ...]

Standard library only; runs in milliseconds. Nothing here ran on a GPU cluster. Each input is one of:

- measured: a figure this project measured on CPU with gloo at toy scale (4 ranks, 2 cores, models of
  a few MB), taken from docs/benchmarks.md (or the team's design notes, not in this repository)
  and labelled with where;
- config: one of the project's defaults;
- assumed: a stated guess about a GPU cluster (links, filesystem, scheduler, NCCL, the store);
- published: someone else's figure (the Llama 3 report, AWS), labelled as theirs.

Every input has a flag (``--store-rps 100000``); ``--measured PATH`` reads a JSON object
``{"name": value}`` (or ``{"name": {"value": v, "origin": "..."}}``) to replace defaults, e.g. with a
recovery bench run on GPUs, or ``bench/control_plane.py --json``'s rows (the store requests per
rank-step and per recovery of its largest simulated job); flags win over the file. ``--json PATH``
writes inputs and results.

The model, per fault (one node's ranks lost at once; they are replaced in parallel):
recovery = detect + restart + imports + store + comm + load + data + the first step's extra time, and
lost work = the steps since the last checkpoint (tiers 0-3: half the interval on average; tier 4:
``tier4_lost_steps``) + half a step in flight. Failures per day scale with GPUs at the Llama 3 rate.
Goodput = (1 - lost time per day / day) x step / (step + the commit vote's store time per step).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

_RB = "README, bench/recovery.py, 2026-11-30 22:13 (4 CPU ranks, gloo, llama3_tiny)"
TIERS = (0, 1, 2, 3, 4)
SCALES = (256, 2304, 16384)
PHASES = ("detect", "restart", "imports", "store", "comm", "load", "data", "first_step")


@dataclass
class Input:
    value: float
    unit: str
    kind: str  # measured | config | assumed | published
    origin: str


def defaults() -> dict[str, Input]:
    m, a, p = "measured", "assumed", "published"
    # fmt: off
    return {
        # -- measured here (CPU, gloo, toy scale) --------------------------------------------------------
        "detect_agent_s": Input(0.40, "s", m, f"{_RB}: tier 0 'detect' (the agent sees the exit)"),
        "detect_peer_s": Input(0.08, "s", m, f"{_RB}: tier 4 buddy 'detect' (a survivor's collective)"),
        "hang_timeout_s": Input(60.0, "s", "config", "README, Timeouts: agent.hang_timeout's default"),
        "restart_agents_s": Input(0.08, "s", m, f"{_RB}: tier 1 restart 0.48 - detect 0.40"),
        "handover_s": Input(0.13, "s", m, f"{_RB}: tier 4 buddy restart 0.21 - detect 0.08 (warm spare)"),
        "import_cold_s": Input(3.4, "s", m, "team notes (not in this repo): torch + Lightning import"),
        "import_forked_s": Input(0.08, "s", m, "README, bench/startup.py, 2026-12-01: a forked rank"),
        "store_rtt_s": Input(0.000266, "s", m, f"{_RB}, figure 1: add + check on the local TCPStore"),
        "comm_t0_s": Input(1.04, "s", m, f"{_RB}: tier 0 'comm' (rendezvous through rank 0), 4 ranks"),
        "comm_t1_s": Input(0.18, "s", m, f"{_RB}: tier 1 'comm' (store in the agent), 4 ranks"),
        "comm_t3_s": Input(0.02, "s", m, f"{_RB}: tiers 3-4 'comm' (groups re-formed in-process)"),
        "ckpt_fixed_t0_s": Input(2.28, "s", m, f"{_RB}: tier 0 'ckpt load' of a 2.6 MB shard (fixed)"),
        "ckpt_fixed_t1_s": Input(2.15, "s", m, f"{_RB}: tier 1 'ckpt load' (tier 2 has no row: same)"),
        "ckpt_fixed_t3_s": Input(1.21, "s", m, f"{_RB}: tier 3 'ckpt load' (survivors reload in place)"),
        "restore_fixed_t4_s": Input(0.34, "s", m, f"{_RB}: tier 4 buddy state load (2.56 MB moved)"),
        "p2p_memcpy_ratio": Input(0.170, "", m, f"{_RB}, figure 4: bench/p2p_transfer.py, 64 MiB between 2"
                                  " gloo ranks 0.37 GB/s, memcpy 2.16 GB/s; assumed to hold for the link"),
        "data_direct_s": Input(0.008, "s", m, "README, bench/data_restart.py: first batch, loader at N"),
        "data_cache_s": Input(0.0005, "s", m, "README, bench/data_restart.py: first batch, batch cache"),
        "step_toy_s": Input(0.59, "s", m, "README, quick start demo 2026-12-01 04:18: median step"),
        "first_step_toy_s": Input(1.07, "s", m, "README, tier-4 recovery breakdown: first step after it"),
        # -- assumed (a GPU cluster) -----------------------------------------------------------------------
        "gpus_per_node": Input(8, "", a, "8-GPU nodes (H100/H200 class)"),
        "link_gbps": Input(400, "Gb/s", a, "per GPU: 400 Gb/s InfiniBand NDR, 3.2 Tb/s per node"),
        "store_rps": Input(30000, "req/s", a, "one c10d TCPStore (libuv); a quick check here served 30K"
                           " add/s to 8 clients on 2 shared cores (41K to one): a lower bound"),
        "store_trips_t0": Input(14, "/rank", a, "store requests per rank per recovery, tier 0: "
                                "rendezvous rounds + init barrier + NCCL ids (counted, not traced)"),
        "store_trips_t1": Input(8, "/rank", a, "tiers 1-2: join the running store, NCCL ids, heartbeats"),
        "store_trips_t3": Input(12, "/rank", a, "tiers 3-4: generation, join barrier, member, NCCL ids"
                                " of the default and mesh groups, watch re-arm, first vote"),
        "vote_trips": Input(3, "/rank/step", a, "tiers 3-4 commit vote: add, check, get (a lower bound:"
                            " waiting ranks poll every <= 2 ms)"),
        "heartbeat_trips": Input(2, "/rank/step", a, "heartbeats through the job store (before and "
                                 "after each batch; one micro-batch per step)"),
        "agent_rps_per_node": Input(2, "/node/s", "config", "each node agent's store pass: one read and one"
                                    " write per agent.store_interval (1 s)"),
        "nccl_init_s": Input(2.0, "s", a, "NCCL communicator init, fixed part (no multi-GPU run here)"),
        "nccl_init_per_krank_s": Input(1.0, "s/1000 ranks", a, "NCCL bootstrap grows linearly with ranks;"
                                       " the README has no comm init at 2/3/4 ranks to fit"),
        "hang_fraction": Input(0.2, "", a, "share of faults that hang (found by hang_timeout_s) rather "
                               "than kill a process; the Llama 3 report does not split them"),
        "requeue_s": Input(60, "s", a, "tier 0: the scheduler requeues the job (torchrun-like)"),
        "container_start_s": Input(60, "s", a, "tier 0: every node starts its container again"),
        "data_pipeline_s": Input(10, "s", a, "tiers 0-1: loader workers, dataset index, tokenizer"),
        "params": Input(405e9, "params", a, "Llama 3 405B-class model, the same at every scale"),
        "bytes_per_param": Input(16, "B", a, "bf16 weights + fp32 master + Adam moments, sharded over"
                                 " all GPUs"),
        "hsdp_replicas": Input(2, "", a, "tier 4 source hsdp: replicas (each GPU holds R/N of the state)"),
        "fs_read_gbs": Input(2000, "GB/s", p, "Llama 3 report: Tectonic sustains 2 TB/s (7 TB/s peak)"),
        "node_read_gbs": Input(12.5, "GB/s", a, "per node from the filesystem (a 100 Gb/s front-end NIC)"),
        "ckpt_interval_min": Input(30, "min", a, "tiers 0-3: disk checkpoint interval (save time not"
                                   " counted: the same for every tier)"),
        "tier4_lost_steps": Input(0, "steps", a, "tier 4: completed steps redone (hsdp none; buddy one"
                                  " when a fault hits an optimizer step)"),
        "tokens_per_gpu_step": Input(1024, "tokens", p, "Llama 3 report: 16M tokens/step on 16,384 GPUs"),
        "tflops_per_gpu": Input(400, "TFLOP/s", p, "Llama 3 report: 38-43% BF16 MFU on H100"),
        "interruptions": Input(419, "", p, "Llama 3 report: unexpected interruptions in 54 days"),
        "report_days": Input(54, "days", p, "Llama 3 report: the pre-training snapshot"),
        "report_gpus": Input(16384, "GPUs", p, "Llama 3 report: H100 GPUs"),
    }
    # fmt: on


# AWS's published claims (not ours): (GPUs, checkpoint-based recovery, checkpointless recovery).
AWS = (
    (256, "256", "4 min 52 s", "47 s"),
    (2304, "~2,300", "15-30 min", "under 2 min"),
)
AWS_KEYS = ("gpus", "label", "checkpoint_based", "checkpointless")
AWS_SOURCE = (
    "AWS, SageMaker HyperPod checkpointless training (blog 2025-12-16: 15-30 min -> under 2 min, up to"
    " 95% goodput on thousands of accelerators; 256 GPUs as quoted in the team's design notes)"
)


def failures_per_gpu_hour(v: dict[str, float]) -> float:
    return v["interruptions"] / (v["report_days"] * 24 * v["report_gpus"])


def step_s(v: dict[str, float]) -> float:
    """Weak scaling: the same tokens per GPU per step at every scale; 6 FLOPs per parameter-token."""
    return 6 * v["params"] * v["tokens_per_gpu_step"] / (v["tflops_per_gpu"] * 1e12)


def phases(tier: int, n: int, v: dict[str, float], source: str = "hsdp") -> dict[str, float]:
    """Seconds per phase of one recovery at tier ``tier`` on ``n`` GPUs."""
    in_process = tier >= 3
    state = v["params"] * v["bytes_per_param"]
    kill = v["detect_peer_s"] if in_process else v["detect_agent_s"]
    detect = (1 - v["hang_fraction"]) * kill + v["hang_fraction"] * v["hang_timeout_s"]
    if tier == 0:
        restart, imports = v["requeue_s"] + v["container_start_s"], v["import_cold_s"]
    elif tier <= 2:  # agents stay up; a standby node's agent forks the lost node's ranks
        restart, imports = v["restart_agents_s"], v["import_forked_s"]
    else:  # prepared warm spares take the lost ranks; survivors keep their processes
        restart, imports = v["handover_s"], 0.0
    trips = v["store_trips_t0"] if tier == 0 else v["store_trips_t1"] if tier <= 2 else v["store_trips_t3"]
    # tier 4 buddy: two gloo pair groups per rank (replication/buddy_links.py), one address read each
    gloo_gets = 2 if (tier == 4 and source == "buddy") else 0
    store = trips * v["store_rtt_s"] + (trips + gloo_gets) * n / v["store_rps"]
    fixed = v["comm_t0_s"] if tier == 0 else v["comm_t1_s"] if tier <= 2 else v["comm_t3_s"]
    comm = fixed + v["nccl_init_s"] + v["nccl_init_per_krank_s"] * n / 1000
    if tier <= 3:  # every rank reads its shard of the last checkpoint
        per_node = state / n * v["gpus_per_node"]
        read = max(state / (v["fs_read_gbs"] * 1e9), per_node / (v["node_read_gbs"] * 1e9))
        load = (
            v["ckpt_fixed_t3_s"] if tier == 3 else v["ckpt_fixed_t0_s"] if tier == 0 else v["ckpt_fixed_t1_s"]
        ) + read
    else:  # only the replaced ranks' shards move, from a replica or a buddy, all in parallel
        moved = state / n * (v["hsdp_replicas"] if source == "hsdp" else 1)
        load = v["restore_fixed_t4_s"] + moved / (v["link_gbps"] / 8 * 1e9 * v["p2p_memcpy_ratio"])
    data = v["data_pipeline_s"] + v["data_direct_s"] if tier <= 1 else v["data_cache_s"]
    first = (v["first_step_toy_s"] / v["step_toy_s"] - 1) * step_s(v)
    values = (detect, restart, imports, store, comm, load, data, first)
    return dict(zip(PHASES, values, strict=True))


def vote_s(tier: int, n: int, v: dict[str, float]) -> float:
    """Tiers 3-4: the step-commit vote through one store, per step: every rank's requests served in turn."""
    return v["vote_trips"] * (v["store_rtt_s"] + n / v["store_rps"]) if tier >= 3 else 0.0


def project(v: dict[str, float], scales=SCALES, source: str = "hsdp") -> dict[int, dict]:
    step = step_s(v)
    out: dict[int, dict] = {}
    for n in scales:
        per_day = failures_per_gpu_hour(v) * n * 24
        tiers = {}
        for tier in TIERS:
            ph = phases(tier, n, v, source)
            recovery = sum(ph.values())
            lost_steps = v["ckpt_interval_min"] * 60 / 2 / step if tier <= 3 else v["tier4_lost_steps"]
            lost_work = (lost_steps + 0.5) * step
            lost_day = per_day * (recovery + lost_work)
            vote = vote_s(tier, n, v)
            up = max(0.0, 1 - lost_day / 86400)
            tiers[tier] = {
                "phases_s": ph,
                "recovery_s": recovery,
                "lost_steps": lost_steps,
                "lost_work_s": lost_work,
                "lost_per_day_s": lost_day,
                "vote_per_step_s": vote,
                "goodput": up * step / (step + vote),
                "goodput_without_vote": up,
            }
        out[n] = {
            "nodes": n / v["gpus_per_node"],
            "failures_per_day": per_day,
            "step_s": step,
            "state_per_gpu_gb": v["params"] * v["bytes_per_param"] / n / 1e9,
            "tiers": tiers,
        }
    return out


def risks(v: dict[str, float], scales=SCALES) -> list[str]:
    """The single store's load as built, and what it implies at each scale."""
    step = step_s(v)
    lines = [
        "One c10d TCPStore (node 0's agent) serves every rank, serially; at store_rps "
        f"{v['store_rps']:,.0f} req/s:",
        f"{'GPUs':>7} {'recovery trips':>15} {'vote/step':>10} {'vote % step':>12} {'rps for 1%':>12}"
        f" {'heartbeat load':>15} {'buddy pairs':>12}",
    ]
    for n in scales:
        trips = v["store_trips_t3"] * n / v["store_rps"]
        vote = vote_s(3, n, v)
        need = v["vote_trips"] * n / (0.01 * step)
        nodes = n / v["gpus_per_node"]
        beats = (v["heartbeat_trips"] * n / step + v["agent_rps_per_node"] * nodes) / v["store_rps"]
        pairs = 4 * n / v["store_rps"]  # two pair groups a rank: an address written and read for each
        lines.append(
            f"{n:>7,} {trips:>14.2f}s {vote:>9.3f}s {100 * vote / step:>11.1f}% {need:>12,.0f}"
            f" {100 * beats:>14.1f}% {pairs:>11.2f}s"
        )
    lines += [
        "  recovery trips: store_trips_t3 x ranks / store_rps. vote: vote_trips x ranks / store_rps per step"
        " (tiers 3-4; the ranks",
        "  leave the clipping all-reduce together, so their adds arrive as a burst). rps for 1%: the rate one"
        " store would need to",
        "  keep the vote under 1% of a step. heartbeat load: the store's busy share from heartbeats and"
        " the agents' store passes. buddy pairs: tier 4's",
        "  buddy source forms two gloo groups of two ranks per rank each generation"
        " (replication/buddy_links.py, in three",
        "  rounds whatever the world): 4N store requests, 4N/store_rps per recovery (it was a world-size"
        " gloo mesh: N(N-1) reads).",
    ]
    return lines


def fmt_s(seconds: float) -> str:
    for limit, unit, size in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds / 86400:.1f} days"


def report(v: dict[str, float], inputs: dict[str, Input], results: dict[int, dict], source: str) -> str:
    out = [
        "SCALE MODEL - projected, NOT measured. Measured inputs come from CPU/gloo runs at toy scale"
        " (4 ranks, 2 cores);",
        "assumed inputs are guesses about a GPU cluster; published ones are others' figures. Override any"
        " with a flag or --measured.",
        "",
        f"{'input':<22} {'value':>12} {'unit':<13} {'kind':<9} origin",
    ]
    for name, item in inputs.items():
        out.append(f"{name:<22} {v[name]:>12.6g} {item.unit:<13} {item.kind:<9} {item.origin}")
    rate = failures_per_gpu_hour(v)
    out += [
        "",
        f"derived: {rate:.3e} failures per GPU-hour = {v['interruptions']:.0f} / ({v['report_days']:.0f}"
        f" days x 24 h x {v['report_gpus']:,.0f} GPUs); one per node every"
        f" {1 / (rate * v['gpus_per_node']) / 24:.0f} days",
        f"derived: step {step_s(v):.2f} s = 6 x params x tokens_per_gpu_step / tflops_per_gpu (weak scaling);"
        f" first step after a recovery x{v['first_step_toy_s'] / v['step_toy_s']:.2f} (measured ratio)",
        f"tier 4 source: {source} (the transfer runs at link x p2p_memcpy_ratio ="
        f" {v['link_gbps'] / 8 * v['p2p_memcpy_ratio']:.1f} GB/s per GPU)",
    ]
    head = " ".join(f"{p.replace('first_step', '1st step'):>8}" for p in PHASES)
    for n, r in results.items():
        per_day = r["failures_per_day"]
        out += [
            "",
            f"{n:,} GPUs ({r['nodes']:,.0f} nodes): {per_day:.2f} failures/day (one every"
            f" {fmt_s(86400 / per_day)}), state {r['state_per_gpu_gb']:.2f} GB/GPU,"
            f" step {r['step_s']:.2f} s",
            f"tier {head} | {'recovery':>9} {'lost work':>10} {'lost/day':>9} {'vote/step':>9} {'goodput':>8}"
            f" {'no vote':>8}",
        ]
        for tier, t in r["tiers"].items():
            cells = " ".join(f"{t['phases_s'][p]:>8.2f}" for p in PHASES)
            out.append(
                f"{tier:>4} {cells} | {fmt_s(t['recovery_s']):>9} {fmt_s(t['lost_work_s']):>10}"
                f" {fmt_s(t['lost_per_day_s']):>9} {t['vote_per_step_s']:>8.3f}s {100 * t['goodput']:>7.2f}%"
                f" {100 * t['goodput_without_vote']:>7.2f}%"
            )
        for gpus, label, before, after in AWS:
            if gpus == n:
                out.append(
                    f"AWS PUBLISHED (their claim, not our measurement): {label} GPUs, checkpoint-based"
                    f" {before} -> checkpointless {after}"
                )
    out += ["", f"AWS source: {AWS_SOURCE}", "", *risks(v, tuple(results))]
    out += [
        "",
        "Columns (seconds): detect (kill: agent or peer; hangs: hang_timeout_s, weighted by hang_fraction),"
        " restart (tier 0: requeue +",
        "container start; 1-2: agents restart ranks; 3-4: warm spare hand-over), imports, store (round trips"
        " + serial store time), comm",
        "(measured fixed part + NCCL init), load (checkpoint read, or tier 4's shard transfer), data (first"
        " batch), first_step (the first",
        "step's time beyond a normal step). recovery = their sum; lost work = steps redone + half a step in"
        " flight; goodput counts",
        "recoveries, lost work and the vote (no vote: without it); not checkpoint saves, spare capacity or"
        " stragglers.",
    ]
    return "\n".join(out)


def load_measured(path: Path, inputs: dict[str, Input]) -> None:
    data = json.loads(path.read_text())
    if isinstance(data, list):  # bench/control_plane.py --json: the simulated jobs' rows
        data = control_plane_inputs(data, path)
    for name, entry in data.items():
        if name not in inputs:
            raise SystemExit(f"--measured {path}: unknown input {name!r} (known: {', '.join(inputs)})")
        value, origin = (entry["value"], entry.get("origin")) if isinstance(entry, dict) else (entry, None)
        inputs[name].value = float(value)
        inputs[name].kind = "measured"
        inputs[name].origin = f"--measured {path}" + (f": {origin}" if origin else "")


def control_plane_inputs(rows: list[dict], path: Path) -> dict[str, dict]:
    """The store inputs measured by ``bench/control_plane.py`` on its largest simulated job: the
    ranks' store requests per rank and step (the vote; heartbeats and fingerprints where they go to
    the store: all of them in ``vote_trips``, so ``heartbeat_trips`` is 0), the node agents' per node
    and second (their store passes: store load, not on the step's path; rows written before
    2026-12-07 have no split, so every request counts per rank-step there), and a recovery's
    requests per rank."""
    if not rows or not all("store_requests_per_rank_step" in row for row in rows):
        raise SystemExit(f"--measured {path}: not a bench/control_plane.py --json file (a list of rows)")
    row = max(rows, key=lambda r: r["ranks"])
    where = f"bench/control_plane.py, {row['ranks']} simulated ranks, {row['step_ms']:g} ms steps"
    if "rank_requests_per_rank_step" not in row:
        split = {
            "vote_trips": {
                "value": row["store_requests_per_rank_step"],
                "origin": f"{where}: every store request per rank-step (heartbeats and agents included)",
            },
            "agent_rps_per_node": {"value": 0, "origin": f"{where}: counted in vote_trips"},
        }
    else:
        split = {
            "vote_trips": {
                "value": row["rank_requests_per_rank_step"],
                "origin": f"{where}: the ranks' store requests per rank-step",
            },
            "agent_rps_per_node": {
                "value": row["agent_requests_per_node_s"],
                "origin": f"{where}: the node agents' store requests per node and second",
            },
        }
    return {
        **split,
        "heartbeat_trips": {"value": 0, "origin": f"{where}: counted in vote_trips"},
        "store_trips_t3": {
            "value": row["recovery_store_requests"] / row["ranks"],
            "origin": f"{where}: a recovery's store requests (no process groups) per rank",
        },
    }


def main(argv: list[str] | None = None) -> dict:
    inputs = defaults()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="also write inputs and results here")
    parser.add_argument(
        "--measured",
        type=Path,
        help="JSON {name: value} replacing default inputs, or bench/control_plane.py's --json rows",
    )
    parser.add_argument("--scales", type=int, nargs="+", default=list(SCALES))
    parser.add_argument("--tier4-source", choices=("hsdp", "buddy"), default="hsdp")
    for name, item in inputs.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=float,
            default=None,
            help=f"{item.kind}, default {item.value:g} {item.unit}: {item.origin}",
        )
    args = parser.parse_args(argv)
    if args.measured:
        load_measured(args.measured, inputs)
    for name, item in inputs.items():
        if getattr(args, name) is not None:
            item.value, item.origin = getattr(args, name), f"--{name.replace('_', '-')} (command line)"
    v = {name: float(item.value) for name, item in inputs.items()}
    results = project(v, tuple(args.scales), args.tier4_source)
    print(report(v, inputs, results, args.tier4_source))
    doc = {
        "note": "a model, not a measurement: measured inputs are CPU/gloo toy-scale figures; see 'kind'",
        "tier4_source": args.tier4_source,
        "inputs": {name: asdict(item) for name, item in inputs.items()},
        "derived": {"failures_per_gpu_hour": failures_per_gpu_hour(v), "step_s": step_s(v)},
        "scales": {
            str(n): {**r, "tiers": {str(t): x for t, x in r["tiers"].items()}} for n, r in results.items()
        },
        "aws_published": {"source": AWS_SOURCE, "claims": [dict(zip(AWS_KEYS, c, strict=True)) for c in AWS]},
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
