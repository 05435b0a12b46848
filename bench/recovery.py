"""Recovery time by tier, side by side with the torchrun baseline, and tiers 3-4's costs, from one run
of this script.

    python bench/recovery.py [--recipe llama3_tiny] [--steps 30] [--every 10] [--fault-step 25]
                             [--skip-torchrun] [--skip-two-nodes] [--node-timeout 5] [--set KEY=VALUE]
                             [--rows tier4b,tier4h]

Every fault row trains the same recipe on 4 local ranks with a checkpoint every
``--every`` steps and one SIGKILL of rank 1 in the forward of step
``--fault-step``, then reads the job's ``events.jsonl``. Rows:

- torchrun: ``torchrun --standalone --max-restarts 3`` over the same rank entry
  point and config, resuming from Lightning's last checkpoint: what a user
  would run today (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, see below);
- tier 0: our agent, all ranks restarted cold, rendezvous through rank 0;
- tier 1: the job store in the agent, process groups per generation prefix;
- tier 1 + spares: as tier 1, and the restarted ranks are warm spares (imports done);
- tier 3: in-process recovery: survivors keep their process, a warm spare
  replaces the killed rank (``agent.spares=1``), every rank reloads the last
  disk checkpoint;
- 2 nodes: spare agent / requeue: two agents of 2 ranks at tier 1, node 1's agent and ranks
  killed; a standby agent takes its place, or the job exits 75 and starts again from its
  checkpoint (``bench/two_nodes.py``; ``--skip-two-nodes`` leaves them out);
- tier 4 buddy / hsdp: no disk reload: the replaced rank's state comes from a
  peer's memory, a buddy's host copy (FSDP over 4 ranks) or its HSDP replica
  (``cluster.replicate=2``: 2 replicas x 2 shards; HSDP's losses differ from
  FSDP's, which does not matter for timing).

Columns (seconds): detect = fault to the first detection (the agent, or at
tiers 3-4 a surviving rank); restart = fault to the last new process started
(or warm spare given its rank); imports, comm init, ckpt load (model build +
state restore: checkpoint, or peers' memory at tier 4), data ready = the
slowest new rank's phase; lost = steps redone; total = fault to the first
completed step after it. torchrun's detection is the time its agent logged the
failed worker. On torch 2.13, torchrun's agent keeps one TCPStore for all
restarts and the workers' env:// rendezvous reuses its keys, so restarted gloo
workers read the previous attempt's addresses (connectFullMesh refused; a torch
bug, reproduced without this project by ``bench/torchrun_gloo_restart_repro.py``);
the row runs torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, torch's
opt-out of that sharing (rank 0 of each attempt then hosts a fresh store). A row
that still fails says why.

Then, from three more runs without a fault (tier 0, tier 3, tier 4 buddy) and
two micro-benchmarks, the figures after the table: the commit vote's share of
the step, tier 4's steady-state step-time overhead, the state digest's cost per
step (from the HSDP row's votes), the extra memory per rank
of each tier 4 source, the peer-to-peer transfer against memcpy
(``bench/p2p_transfer.py``), and tier 4 against the recovery targets. The
machine is shared and noisy: compare rows and figures of one run. ``--rows`` runs only the named
fault rows (run dir names: tier0 tier1 tier1s tier3 tier4b tier4h), no run without a fault and no
torchrun or two-node row, and prints the table and the first step after each recovery: quick
alternated pairs, e.g. ``--rows tier4b,tier4h`` with and without ``--set trainer.warm_first_step=false``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckless_lightning.record.events import EventLog, read_events
from ckless_lightning.record.loss_log import read_loss_records
from ckless_lightning.record.summary import (
    FaultRecovery,
    JobSummary,
    first_step_ratio,
    slowest_first_step,
    summarize,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from two_nodes import two_node_rows  # bench/ is not a package

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6

# (row name, run dir name, overrides): the fault rows, each passing its tier explicitly (the default is 4).
FAULT_ROWS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("tier 0", "tier0", ("tier=0",)),
    ("tier 1", "tier1", ("tier=1",)),
    ("tier 1 + 4 spares", "tier1s", ("tier=1", "agent.spares=4")),
    ("tier 3 (1 spare)", "tier3", ("tier=3", "agent.spares=1")),
    ("tier 4 buddy", "tier4b", ("tier=4", "replication.source=buddy")),
    ("tier 4 hsdp (2x2)", "tier4h", ("tier=4", "cluster.replicate=2", "replication.source=hsdp")),
)
# Runs without a fault, for the steady-state figures.
CLEAN_RUNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("clean-tier0", ("tier=0",)),
    ("clean-tier4b", ("tier=4", "replication.source=buddy")),
    ("clean-tier3", ("tier=3",)),
)


def two_node_overrides(args: argparse.Namespace) -> list[str]:
    """The two-node rows' job: node 1 lost (agent and ranks) at the fault step."""
    node_loss = ["fault=node_loss", "fault.node=1", f"fault.step={args.fault_step}"]
    return [*job_overrides(args, fault=False)[:-1], *node_loss]


def job_overrides(args: argparse.Namespace, *, fault: bool = True) -> list[str]:
    faults = ["fault=kill", "fault.rank=1", f"fault.step={args.fault_step}", "fault.phase=forward"]
    return [
        f"recipe={args.recipe}",
        f"trainer.max_steps={args.steps}",
        f"checkpoint.every_n_steps={args.every}",
        "trainer.enable_progress_bar=false",
        *args.set,
        *(faults if fault else ["fault=none"]),  # last: two_node_overrides drops "fault=none"
    ]


@dataclass
class Run:
    """One finished ``launch.py`` job (``error`` set if it failed) and what its logs say."""

    name: str
    run_dir: Path
    error: str | None = None

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.run_dir / "events.jsonl")

    def summary(self) -> JobSummary:
        return summarize(self.events(), read_loss_records(self.run_dir / "losses.jsonl"))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["kind"] == kind]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def launch(run_dir: Path, args: argparse.Namespace, *extra: str, fault: bool = True) -> Run:
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        f"hydra.run.dir={run_dir}",
        *job_overrides(args, fault=fault),
        *extra,
    ]
    progress(f"{run_dir.name}: {' '.join(extra)}{'' if fault else ' fault=none'}")
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        print(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}", file=sys.stderr)
        errors = [line.strip() for line in result.stderr.splitlines() if "Error" in line]
        why = errors[-1][:120] if errors else "see stderr above"
        return Run(run_dir.name, run_dir, f"failed (exit code {result.returncode}): {why}")
    return Run(run_dir.name, run_dir)


def run_ours(run_dir: Path, args: argparse.Namespace, *extra: str) -> tuple[FaultRecovery, float] | str:
    run = launch(run_dir, args, *extra)
    return run.error if run.error else only_fault(run_dir)


def run_torchrun(run_dir: Path, args: argparse.Namespace) -> tuple[FaultRecovery, float] | str:
    """The same job under torchrun: write the resolved config with a dry run, then start the ranks."""
    progress("torchrun --max-restarts=3 (tier=0 config)")
    # tier=0: plain ranks (rank 0 hosts the store), as torchrun expects; the default tier is 4.
    dry = [sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", *job_overrides(args)]
    dry += ["tier=0", "dry_run=true"]
    subprocess.run(dry, check=True, capture_output=True)
    log = EventLog(run_dir / "events.jsonl", source="bench")
    log.emit("job_start", tier="torchrun", world_size=4, nnodes=1)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "--max-restarts=3",
        "-m",
        "ckless_lightning.rank",
        "--config",
        str(run_dir / "config.yaml"),
    ]
    # torch 2.13's torchrun keeps one agent-hosted TCPStore for every restart, and its workers' env://
    # rendezvous uses it with the same keys each attempt: the restarted gloo workers read the previous
    # attempt's addresses (connectFullMesh refused; bench/torchrun_gloo_restart_repro.py). With the
    # store unshared, rank 0 of each attempt hosts a fresh one, as before torch 2.5.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=run_dir,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=args.torchrun_timeout)
    except subprocess.TimeoutExpired:
        _, stderr = _stop_torchrun(proc)
        return _torchrun_failure(stderr, f"no result after {args.torchrun_timeout:g} s")
    finally:
        _kill_leftovers(run_dir / "config.yaml")
    (run_dir / "torchrun.log").write_text(stderr)
    if proc.returncode:
        return _torchrun_failure(stderr, f"exit code {proc.returncode}")
    detected = _torchrun_detection(stderr)
    if detected is not None:
        t, rank, exit_code = detected
        log.emit("fault_detected", by="torchrun", rank=rank, reason="exit", exit_code=exit_code, gen=0, t=t)
    log.emit("job_end", exit_code=0)
    # torchrun numbers its restarts (TORCHELASTIC_RESTART_COUNT, our ranks' "gen") but does not
    # log them: mark generation 1 where its first process started, so the summary can split phases.
    starts = [
        e["t"]
        for e in read_events(run_dir / "events.jsonl")
        if e["kind"] == "rank_phase" and e["phase"] == "process_start" and e["gen"] == 1
    ]
    log.emit("generation", gen=1, reason="torchrun restart", t=min(starts))
    return only_fault(run_dir)


# torchrun's agent logs the first worker it found failed, e.g.
# "E1130 17:11:00.769000 3137 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9)
# local_rank: 1 (pid: 3143) of binary: ..." (local time, no year).
_TORCHRUN_FAILED = re.compile(
    r"^[EWI](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})\.(\d+) .*\] failed \(exitcode: (-?\d+)\) local_rank: (\d+)"
)


def _torchrun_detection(output: str) -> tuple[float, int, int] | None:
    """When torchrun's agent noticed the first failed worker (epoch seconds), its local rank and exit code."""
    for line in output.splitlines():
        match = _TORCHRUN_FAILED.match(line.strip())
        if match is None:
            continue
        month, day, hour, minute, sec, frac, code, rank = match.groups()
        year = time.localtime().tm_year
        stamp = time.mktime((year, int(month), int(day), int(hour), int(minute), int(sec), 0, 0, -1))
        return stamp + float(f"0.{frac}"), int(rank), int(code)
    return None


def _stop_torchrun(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM torchrun (it stops its workers), SIGKILL after a grace period; returns its output."""
    proc.terminate()
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def _kill_leftovers(config: Path) -> None:
    """SIGKILL rank processes of this torchrun job that outlived it (torchrun starts each worker in a
    session of its own, so a killed torchrun orphans them): exactly those run with ``--config config``."""
    import psutil

    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "ckless_lightning.rank" in cmdline and str(config) in cmdline:
            with contextlib.suppress(psutil.Error):
                process.kill()


def _torchrun_failure(output: str, how: str) -> str:
    """Why torchrun did not recover, in one line (its restarted workers' first error)."""
    errors = [line.strip() for line in output.splitlines() if "Error:" in line and "peer" not in line]
    return f"did not recover ({how}): {errors[0][:150] if errors else 'see its output'}"


def only_fault(run_dir: Path) -> tuple[FaultRecovery, float]:
    """The run's one fault, and the time from it to the last process of generation 1 started
    (at tiers 3-4: the warm spare given the killed rank's place; survivors keep their process)."""
    events = read_events(run_dir / "events.jsonl")
    summary = summarize(events, read_loss_records(run_dir / "losses.jsonl"))
    assert len(summary.faults) == 1, f"{run_dir}: expected one fault, got {len(summary.faults)}"
    fault = summary.faults[0]
    starts = [
        e["t"]
        for e in events
        if e["kind"] == "rank_phase" and e["phase"] == "process_start" and e["gen"] == 1
    ]
    return fault, max(starts) - fault.t_fault


def fmt(value: float | None) -> str:
    return f"{value:9.2f}" if value is not None else f"{'-':>9}"


def table(rows: list[tuple[str, tuple[FaultRecovery, float] | str]]) -> list[str]:
    header = ("setup", "detect", "restart", "imports", "comm", "ckpt load", "data", "lost", "total")
    out = [f"{header[0]:<24}" + "".join(f"{h:>10}" for h in header[1:])]
    for name, row in rows:
        if isinstance(row, str):
            out.append(f"{name:<24} {row}")
            continue
        f, restart = row
        cells = (f.detection_s, restart, f.imports_s, f.comm_init_s, f.state_load_s, f.data_ready_s)
        lost = f"{f.steps_lost:>10}" if f.steps_lost is not None else f"{'-':>10}"
        out.append(f"{name:<24}" + "".join(f" {fmt(c)}" for c in cells) + lost + f" {fmt(f.total_s)}")
    return out


# --- figures -------------------------------------------------------------------------------------------
FIRST_STEP_TARGET = 1.3  # issue #33: tiers 3-4's first step after a recovery, in median steps


def figure_first_step(runs: dict[str, Run]) -> list[str]:
    """Per fault row: the first step after the recovery (the last rank's first batch -> every rank's
    first step done) against the run's median step."""
    out = ["first step after the recovery / median step (target <= 1.3 at tiers 3-4):"]
    for name, key, _extra in FAULT_ROWS:
        run = runs.get(key)
        if run is None or run.error:
            out.append(f"   {name:<20} n/a: {run.error if run else 'not run'}")
            continue
        summary = run.summary()
        ratio = first_step_ratio(summary)
        if ratio is None:
            out.append(f"   {name:<20} n/a: no first step after the fault, or no median step")
            continue
        first = slowest_first_step(summary)
        target = ""
        if key.startswith(("tier3", "tier4")):
            target = " (met)" if ratio <= FIRST_STEP_TARGET else " (not met)"
        out.append(f"   {name:<20} {first:.3f} s / {summary.step_time_s:.3f} s = {ratio:.2f}{target}")
    return out


def per_step(run: Run, seconds: str, count: str) -> float | None:
    """Mean over ranks of ``commit_votes[seconds] / commit_votes[count]`` (seconds per step per rank)."""
    values = [e[seconds] / e[count] for e in run.of("commit_votes") if e.get(count)]
    return statistics.fmean(values) if values else None


def pct(part: float, whole: float) -> str:
    share = 100 * part / whole
    return f"{share:.1f}%" if share >= 1 else f"{share:.3f}%"


def store_round_trip(n: int = 1000) -> tuple[float, float]:
    """Seconds per ``add`` + ``check`` pair, and per ``add`` + ``compare_set`` pair (the last voter's
    uncontended vote), on a local c10d TCPStore through a client connection, as a rank talks to the
    job store; best of 3 rounds of ``n``."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False)
    add_check = add_cas = float("inf")
    for attempt in range(3):
        start = time.perf_counter()
        for i in range(n):
            client.add(f"vote/{attempt}/{i}", 1)
            client.check([f"decision/{attempt}/{i}"])
        add_check = min(add_check, (time.perf_counter() - start) / n)
        start = time.perf_counter()
        for i in range(n):
            client.add(f"cas-vote/{attempt}/{i}", 1)
            client.compare_set(f"cas-decision/{attempt}/{i}", "", "commit")
        add_cas = min(add_cas, (time.perf_counter() - start) / n)
    del client, server
    return add_check, add_cas


def figure_vote(t0: Run, t3: Run) -> list[str]:
    out = ["1. Commit vote, no fault (tier 3, fault=none):"]
    if t3.error:
        return [*out, f"   n/a: tier 3 {t3.error}"]
    step = t3.summary().step_time_s
    vote = per_step(t3, "vote_s", "votes")
    if step is None or vote is None:
        return [*out, "   n/a: no median step or no commit_votes events"]
    out.append(
        f"   vote (incl. waiting for the slowest rank)  {1e3 * vote:8.2f} ms per step per rank = "
        f"{pct(vote, step)} of tier 3's median step ({step:.3f} s)"
    )
    add_check, add_cas = store_round_trip()
    out.append(
        f"   store round trip alone (local TCPStore)    {1e3 * add_check:8.3f} ms per add + check "
        f"= {pct(add_check, step)}; {1e3 * add_cas:.3f} ms per add + compare_set (the last voter)"
    )
    base = None if t0.error else t0.summary().step_time_s
    if base is not None:
        out.append(
            f"   median step tier 3 / tier 0 (no fault)     {step:.3f} / {base:.3f} s = {step / base:.3f}"
        )
    return out


def figure_overhead(t0: Run, t4: Run) -> list[str]:
    out = ["2. Tier 4 (buddy) steady-state overhead against tier 0, no fault:"]
    if t0.error or t4.error:
        return [*out, f"   n/a: {t0.error or t4.error}"]
    base, step = t0.summary().step_time_s, t4.summary().step_time_s
    if base is None or step is None:
        return [*out, "   n/a: no median step"]
    out.append(
        f"   median step  tier 0 {base:.3f} s, tier 4 {step:.3f} s: ratio {step / base:.3f} "
        f"({100 * (step / base - 1):+.1f}%)"
    )
    vote = per_step(t4, "vote_s", "votes")
    snap = per_step(t4, "snapshot_s", "snapshots")
    snaps = [e["snapshots"] for e in t4.of("commit_votes")]
    if vote is not None and snap is not None:
        out.append(
            f"   accounted per step and rank: vote {1e3 * vote:.2f} ms + snapshot {1e3 * snap:.2f} ms "
            f"({min(snaps)}-{max(snaps)} snapshots per rank)"
        )
        out.append(
            "   (a snapshot: Lightning's loop state dumped and pickled, the own host copy, the previous buddy"
            " exchange settled and the next one started)"
        )
        out.append(
            f"   = {1e3 * (vote + snap):.2f} ms = {pct(vote + snap, base)} of tier 0's step "
            "(the buddy exchange itself runs async, overlapped with the next step)"
        )
    return out


def figure_digest(t0: Run, hsdp: Run) -> list[str]:
    """The state digest's cost per step (the HSDP run: the only one with replicas to compare)."""
    every = None if hsdp.error else _resolved(hsdp, "replication", "digest_every")
    out = [f"2b. State digest in the commit vote (tier 4 hsdp 2x2, replication.digest_every={every}):"]
    if t0.error or hsdp.error:
        return [*out, f"   n/a: {t0.error or hsdp.error}"]
    base, digest = t0.summary().step_time_s, per_step(hsdp, "digest_s", "digests")
    if base is None or digest is None:
        return [*out, "   n/a: no median step or no digests (replication.digest_every=0?)"]
    count = sum(e["digests"] for e in hsdp.of("commit_votes"))
    out.append(
        f"   {1e3 * digest:.3f} ms per step per rank ({count} digests) = {pct(digest, base)} of tier 0's "
        f"median step ({base:.3f} s); target <= 1%"
    )
    return out


def plan_of(run: Run) -> Any:
    """``memory_plan.plan_job`` of the run's resolved config (per-rank shard sizes)."""
    from omegaconf import OmegaConf

    from ckless_lightning.runtime.config import job_config_from_dict
    from ckless_lightning.runtime.memory_plan import plan_job

    container = OmegaConf.to_container(OmegaConf.load(run.run_dir / "config.yaml"), resolve=True)
    assert isinstance(container, dict)
    return plan_job(job_config_from_dict(container))


def peak_rss(run: Run) -> int | None:
    stats = (run.run_dir / "step_stats").glob("rank*.json")
    values = [json.loads(p.read_text())["peak_rss_bytes"] for p in stats]
    return max(values) if values else None


def figure_memory(buddy: Run, hsdp: Run, clean0: Run, clean4: Run) -> tuple[list[str], int | None]:
    """The memory figure, and the per-rank state bytes (one snapshot's tensors) for the P2P figure."""
    out = ["3. Extra resident memory per rank, by tier 4 source:"]
    state_bytes = None
    if buddy.error:
        out.append(f"   buddy: n/a ({buddy.error})")
    else:
        votes = buddy.of("commit_votes")
        host = max(e["host_copy_bytes"] for e in votes)
        loop = int(float(_resolved(buddy, "replication", "loop_capacity_mb")) * (1 << 20))
        state_bytes = host // 4 - loop
        plan = plan_of(buddy)
        planned = plan.param_bytes + plan.optim_bytes
        out.append(
            f"   buddy: {host / MB:.2f} MB host copies = 4 slots (2 own, double-buffered + 2 held for the "
            f"ward) x ({state_bytes / MB:.3f} MB state + {loop / MB:.2f} MB loop area)"
        )
        out.append(
            f"          the state per slot: {state_bytes:,} B; plan (params + AdamW moments, mesh "
            f"{plan.mesh[0]}x{plan.mesh[1]}, {plan.num_params:,} params): {planned:,} B "
            f"(+{state_bytes - planned} B: per-parameter step counters)"
        )
        out.append(
            f"          = {host / planned:.1f}x the rank's params + moments "
            f"({4 * state_bytes / planned:.1f}x without the loop areas)"
        )
    if hsdp.error or buddy.error:
        out.append(f"   hsdp:  n/a ({hsdp.error or buddy.error})")
    else:
        host = max((e["host_copy_bytes"] for e in hsdp.of("commit_votes")), default=0)
        fsdp, hs = plan_of(buddy), plan_of(hsdp)
        out.append(
            f"   hsdp:  {host} B host copies (none by design); each rank holds 1/{hs.mesh[1]} instead of "
            f"1/{fsdp.mesh[0] * fsdp.mesh[1]} of the model: params + grads + moments "
            f"{hs.total_bytes / MB:.3f} MB instead of {fsdp.total_bytes / MB:.3f} MB"
        )
        out.append(
            f"          = +{(hs.total_bytes - fsdp.total_bytes) / MB:.3f} MB per rank "
            f"({hs.total_bytes / fsdp.total_bytes:.1f}x), and the gradient all-reduce across replicas"
        )
    rss0, rss4 = peak_rss(clean0), peak_rss(clean4)
    if rss0 and rss4:
        out.append(
            f"   measured peak RSS (max over ranks, no fault): tier 0 {rss0 / MB:.0f} MB, tier 4 buddy "
            f"{rss4 / MB:.0f} MB ({(rss4 - rss0) / MB:+.0f} MB; process noise is larger than the copies here)"
        )
    return out, state_bytes


def _resolved(run: Run, section: str, key: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.load(run.run_dir / "config.yaml")[section][key]


def figure_p2p(state_bytes: int | None, buddy_row: tuple[FaultRecovery, float] | str) -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from p2p_transfer import measure

    out = ["4. P2P state transfer (bench/p2p_transfer.py: transfer_tensors, 2 gloo ranks, best of 3) "]
    out[0] += "against memcpy (torch.empty_like(x).copy_(x), best of 3), same bytes:"
    sizes = [64 << 20] if state_bytes is None else [state_bytes, 64 << 20]
    for nbytes in sizes:
        progress(f"p2p transfer of {nbytes:,} bytes")
        try:
            result = measure(nbytes)
        except Exception as err:  # report and go on: the other figures stand
            out.append(f"   {nbytes:,} B: failed: {err}")
            continue
        label = "per-rank state" if nbytes == state_bytes else "64 MiB"
        out.append(
            f"   {label:>14} {nbytes / MB:8.2f} MB: p2p {result.p2p_gbps:6.2f} GB/s "
            f"({1e3 * result.p2p_s:7.2f} ms), memcpy {result.memcpy_gbps:6.2f} GB/s "
            f"({1e3 * result.memcpy_s:6.2f} ms): p2p/memcpy {result.ratio:.3f}"
        )
        if nbytes == state_bytes and not isinstance(buddy_row, str) and buddy_row[0].state_load_s:
            load = buddy_row[0].state_load_s
            out.append(
                f"   {'':>14} tier 4 buddy's whole 'ckpt load' phase above: {load:.2f} s; this transfer "
                f"is {pct(result.p2p_s, load)} of it"
            )
    return out


def figure_targets(
    rows: dict[str, tuple[FaultRecovery, float] | str], runs: dict[str, Run], torchrun_ran: bool
) -> list[str]:
    out = ["5. Targets: tier 4 recovers in <= 1/10 of the baseline's time, and loses no step:"]
    torchrun = rows.get("torchrun --max-restarts")
    if not isinstance(torchrun, str) and torchrun is not None and torchrun[0].total_s:
        base_name, base = "torchrun", torchrun[0]
    else:
        why = "its row above" if torchrun_ran else "--skip-torchrun"
        out.append(
            f"   torchrun does not recover on this stack ({why}); the baseline is tier 0 instead "
            "(torchrun done right: fresh rendezvous per generation, same cold restart)"
        )
        tier0 = rows.get("tier 0")
        if isinstance(tier0, str) or tier0 is None or tier0[0].total_s is None:
            return [*out, f"   n/a: tier 0 {tier0}"]
        base_name, base = "tier 0", tier0[0]
    assert base.total_s is not None
    for name, key in (("tier 4 buddy", "tier4b"), ("tier 4 hsdp (2x2)", "tier4h")):
        row = rows.get(name)
        if isinstance(row, str) or row is None or row[0].total_s is None:
            out.append(f"   {name}: n/a ({row})")
            continue
        f, restart = row
        assert f.total_s is not None
        met = "met" if f.total_s <= base.total_s / 10 else "not met"
        out.append(
            f"   {name:<18} total {f.total_s:5.2f} s vs {base_name} {base.total_s:5.2f} s / 10 = "
            f"{base.total_s / 10:4.2f} s: {f.total_s / base.total_s:.2f} of the baseline ({met})"
        )
        phases = (restart, f.imports_s, f.comm_init_s, f.state_load_s, f.data_ready_s)
        out.append(
            f"   {'':<18} where it goes: to the spare given its rank {restart:.2f}, its imports "
            f"{f.imports_s or 0:.2f}, comm {f.comm_init_s or 0:.2f}, state load {f.state_load_s or 0:.2f}, "
            f"first batch {f.data_ready_s or 0:.2f}, the rest (first step after it, gaps) "
            f"{f.total_s - sum(p or 0 for p in phases):.2f}"
        )
        restores = [e for e in runs[key].of("memory_restore") if e.get("rank") == 0]
        how = "; ".join(
            f"{e['reason']}, sources {e.get('sources')}, rollback {e.get('rollback')}"
            + (f", fell back to {e['fallback']}" if e.get("fallback") or e.get("step") is None else "")
            for e in restores
        )
        ok = f.steps_lost == 0 and all(e.get("step") is not None for e in restores) and restores
        out.append(
            f"   {'':<18} steps lost {f.steps_lost} ({'ok' if ok else 'NOT 0'}): {how or 'no memory_restore'}"
        )
        if key == "tier4b" and any(e.get("rollback") for e in restores):
            out.append(
                f"   {'':<18} (the buddy held no complete copy of step {(f.fault_step or 1) - 1}: "
                "its exchange runs async, overlapped with the next step, and was still in flight when the "
                "rank died; replication.every_n_steps=1 bounds the loss at 1 step)"
            )
    return out


def main_rows(args: argparse.Namespace, keys: list[str]) -> None:
    """``--rows``: the named fault rows only, their table and their first step after the recovery."""
    started = time.monotonic()
    rows: list[tuple[str, tuple[FaultRecovery, float] | str]] = []
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="ckless-recovery-") as tmp:
        for name, key, extra in FAULT_ROWS:
            if key in keys:
                run = runs[key] = launch(Path(tmp) / key, args, *extra)
                rows.append((name, run.error if run.error else only_fault(run.run_dir)))
        first = figure_first_step(runs)
    print("\n".join(table(rows)))
    print(
        f"\n{args.recipe}, {_ranks(args.set)} ranks, SIGKILL of rank 1 in the forward of step "
        f"{args.fault_step}; --set {args.set}"
    )
    print("\n".join(line for line in first if "not run" not in line))
    print(f"\n({time.monotonic() - started:.0f} s for this script)")


def _ranks(overrides: list[str]) -> str:
    """The fault rows' ranks per node as the overrides leave them (the recipe's 4 unless set)."""
    nproc = [o.split("=", 1)[1] for o in overrides if o.startswith("cluster.nproc_per_node=")]
    return nproc[-1] if nproc else "4"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="llama3_tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--fault-step", type=int, default=25)
    parser.add_argument("--torchrun-timeout", type=float, default=180.0)
    parser.add_argument("--skip-torchrun", action="store_true", help="leave the torchrun row out (~90 s)")
    parser.add_argument("--skip-two-nodes", action="store_true", help="leave the two-node rows out (~2 min)")
    parser.add_argument(
        "--node-timeout", type=float, default=5.0, help="agent.node_timeout of the two-node rows"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every job (repeatable), e.g. trainer.warm_first_step=false",
    )
    parser.add_argument(
        "--rows",
        default="",
        help="only these fault rows, comma-separated run dir names (e.g. tier4b,tier4h); no figures but "
        "the first step after each recovery",
    )
    args = parser.parse_args()
    rows_only = [r for r in args.rows.split(",") if r]
    unknown = set(rows_only) - {key for _, key, _ in FAULT_ROWS}
    if unknown:
        parser.error(f"--rows: unknown {sorted(unknown)}; known: {[key for _, key, _ in FAULT_ROWS]}")
    if rows_only:
        main_rows(args, rows_only)
        return

    started = time.monotonic()
    rows: list[tuple[str, tuple[FaultRecovery, float] | str]] = []
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="ckless-recovery-") as tmp:
        work = Path(tmp)
        if not args.skip_torchrun:
            rows.append(("torchrun --max-restarts", run_torchrun(work / "torchrun", args)))
        for name, key, extra in FAULT_ROWS:
            run = runs[key] = launch(work / key, args, *extra)
            rows.append((name, run.error if run.error else only_fault(run.run_dir)))
        if not args.skip_two_nodes:
            rows.extend(two_node_rows(work, two_node_overrides(args), node_timeout=args.node_timeout))
        for key, extra in CLEAN_RUNS:
            runs[key] = launch(work / key, args, *extra, fault=False)

        by_name = dict(rows)
        memory, state_bytes = figure_memory(
            runs["tier4b"], runs["tier4h"], runs["clean-tier0"], runs["clean-tier4b"]
        )
        figures = [
            figure_first_step(runs),
            figure_vote(runs["clean-tier0"], runs["clean-tier3"]),
            figure_overhead(runs["clean-tier0"], runs["clean-tier4b"]),
            figure_digest(runs["clean-tier0"], runs["tier4h"]),
            memory,
            figure_p2p(state_bytes, by_name.get("tier 4 buddy", "n/a")),
            figure_targets(by_name, runs, not args.skip_torchrun),
        ]

    print("\n".join(table(rows)))
    print(
        f"\n{args.recipe}, {_ranks(args.set)} ranks, checkpoint every {args.every} steps, SIGKILL of rank 1 "
        f"in the forward of step {args.fault_step}; seconds. {args.steps} steps per run; runs without a "
        "fault: tier 0, tier 4 buddy, tier 3."
    )
    if not args.skip_two_nodes:
        print(
            "2 nodes: 2 agents x 2 ranks at tier 1 (bench/two_nodes.py), node 1's agent and ranks "
            f"SIGKILLed at step {args.fault_step}, agent.node_timeout={args.node_timeout:g} s; a standby "
            "agent takes node 1, or node 0 exits 75 and both agents start again, resuming from the "
            "checkpoint (the scheduler's own requeue latency not included)."
        )
    for lines in figures:
        print()
        print("\n".join(lines))
    print(f"\n({time.monotonic() - started:.0f} s for this script; ratios compare runs of this one run.)")


if __name__ == "__main__":
    main()
