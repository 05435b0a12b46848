"""Many random faults in one job: survived, recoveries, lost steps, leaks, goodput, bitwise equality.

    python bench/soak.py [--faults 100] [--mtbf-steps 3] [--tier 4] [--types kill hang stall exception]
                         [--injected-by inside] [--chaos-mtbf-s S] [--steps N] [--keep] [override ...]

One ``launch.py`` job (``llama3_tiny``, 4 ranks, the default tier 4 with a spare) with
``fault=random``: ``--faults`` faults drawn by the job's own seeded schedule (exponential
arrivals, mean ``--mtbf-steps`` optimizer steps apart; each a random rank, phase and type of
``--types``), long enough for all of them, a fault budget above their number, a short
``agent.hang_timeout`` (a ``stall`` is only found by it), no disk checkpoint at tier 4. Then the
same job without faults. With ``--chaos-mtbf-s S`` the faults are ``fault=chaos`` instead: the agent
sends SIGKILL or SIGSTOP to a random process of the job (a rank, the warm spare, the batch-cache
reader) every S seconds on average from the start, in any phase (start-up, recoveries and process-group
formation included), with a disk checkpoint every 10 steps for a rank and its buddy lost together.
Printed:

- faults injected, detected, recovered (the job's own summary), generations, steps redone, goodput
  (productive step time over wall time, start-up and recoveries excluded) and ML goodput (steps kept
  over steps computed);
- bitwise: every step's loss and the final weights and optimizer state against the fault-free run;
- leaks, after the job ended: processes the job started (ranks, spares, readers: their pids from the
  event log) or whose command line names the run directory, batch-cache
  directories of the job under ``/dev/shm``, and from each rank's ``rank_end`` record the threads,
  TCP sockets and process groups it still held at its end (max over ranks and generations).

Extra arguments are Hydra overrides for both runs. Progress goes to stderr. Takes about
``faults x (mtbf x step time + recovery)``; ``--faults 20`` is a few minutes here.

    python bench/soak.py --seeds 20 [--first-seed 0] [--faults 10] [--chaos-mtbf-s 2] [--steps 40]
                         [--shape buddy4 | buddy3 | hsdp | mixtral] [override ...]

Many seeds instead of one long job: one fault-free reference of the shape, then one ``fault=chaos``
job per seed (``--faults`` SIGKILLs and SIGSTOPs of ranks, warm spares, the batch-cache reader and
the fork server, mean ``--chaos-mtbf-s`` seconds apart from the job's start, so in start-up,
steps, recoveries and process-group formation alike; a disk checkpoint every 5 steps for a rank
and its buddy lost together), on the tests' short sequences. One row per seed: faults that hit
(ranks / other processes), generations, exit code, bitwise equal to the reference (losses, final
weights and optimizer state), steps redone, sources a verified restore rejected, leftovers
(processes, batch-cache directories), the longest stall (the longest time the job's event log
went without a record: a wait that nothing but its timeout ended), wall time; then the totals.
Exit code 1 if any run diverged, left something behind, stalled longer than ``--max-stall-s``
or did not exit 0; such a run keeps its directory (path printed).
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from checkpoint_utils import assert_same_run  # noqa: E402

from ckless_lightning.record.events import read_events  # noqa: E402
from ckless_lightning.record.summary import summarize_run  # noqa: E402


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def launch(run_dir: Path, overrides: list[str], timeout_s: float) -> int:
    cmd = [sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", *overrides]
    progress(" ".join(cmd[2:]))
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode


def leftovers(run_dir: Path) -> list[str]:
    """Processes still alive that belong to the run (their command line names its directory)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(run_dir) in cmdline and "soak.py" not in cmdline:
            found.append(f"{proc.info['pid']}: {cmdline[:120]}")
    return found


def started_alive(events: list[dict]) -> list[str]:
    """Processes the job's agents started (ranks, spares, readers, fork servers) that are still alive."""
    pids = {pid for e in events if e["kind"] == "ranks_started" for pid in e["pids"]}
    pids |= {
        e["pid"] for e in events if e["kind"] in ("spare_started", "reader_started", "forkserver_started")
    }
    return [
        f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}" for pid in pids if psutil.pid_exists(pid)
    ]


def cache_dirs(events: list[dict]) -> list[str]:
    roots = {e["root"] for e in events if e["kind"] == "reader_started" and "root" in e}
    return sorted(r for r in roots if Path(r).exists())


# --seeds: the job shapes the CI chaos test runs too (tests/test_chaos.py)
SHAPES = {
    "buddy4": ["recipe=llama3_tiny", "replication.source=buddy"],
    "buddy3": [
        "recipe=llama3_tiny",
        "replication.source=buddy",
        "cluster.nproc_per_node=3",
        "trainer.global_batch_size=12",
    ],
    "hsdp": ["recipe=llama3_tiny", "cluster.replicate=2", "replication.source=hsdp"],
    "mixtral": ["recipe=mixtral_tiny", "replication.source=buddy"],
}
SHORT = ["data.seq_len=32", "data.max_source_bytes=2000000", "timeline=false"]


def longest_stall(events: list[dict]) -> float:
    """The longest time between two consecutive records of the event log (0 with fewer than two)."""
    times = sorted(float(e["t"]) for e in events)
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def seed_rows(args: argparse.Namespace) -> int:
    """``--seeds``: one chaos job per seed against one reference; a row per seed. Returns the exit code."""
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="ckless-soak-seeds-"))
    common = [
        "tier=4",
        f"trainer.max_steps={args.steps or 40}",
        "trainer.enable_progress_bar=false",
        "agent.hang_timeout=6",
        "agent.recovery_timeout=120",
        "comm.init_timeout_s=60",
        "checkpoint.every_n_steps=5",
        f"data.cache_dir={work / 'data'}",
        *SHORT,
        *SHAPES[args.shape],
        *args.overrides,
    ]
    steps = args.steps or 40
    reference = work / "reference"
    if launch(reference, [*common, "fault=none"], 600 + steps * 10) != 0:
        print(f"the fault-free reference failed: see {reference}.log")
        return 1
    mtbf = args.chaos_mtbf_s or 2.0
    print(
        f"chaos soak, {args.shape} ({' '.join(SHAPES[args.shape])}), {steps} steps, up to {args.faults} "
        f"faults per run, mean {mtbf:g} s apart, {time.strftime('%Y-%m-%d')}"
    )
    header = f"{'seed':>4} {'faults':>9} {'gens':>4} {'exit':>4} {'bitwise':>8} {'redone':>6} "
    print(header + f"{'rejected':>8} {'leftovers':>9} {'stall s':>7} {'wall s':>7}")
    bad = 0
    totals = {"faults": 0, "divergent": 0, "leftovers": 0, "rejected": 0, "stalled": 0}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        run = work / f"seed{seed}"
        chaos = [
            "fault=chaos",
            f"fault.mtbf_s={mtbf}",
            f"fault.max_faults={args.faults}",
            f"fault.seed={seed}",
            f"agent.max_restarts={args.faults * 3 + 10}",
        ]
        code = launch(run, [*common, *chaos], 900 + steps * 10)
        events = read_events(run / "events.jsonl") if (run / "events.jsonl").exists() else []
        left = sorted(set(leftovers(run)) | set(started_alive(events))) + cache_dirs(events)
        ranks = sum(1 for e in events if e["kind"] == "fault_injected")
        others = sum(1 for e in events if e["kind"] == "process_fault_injected")
        rejected = sum(1 for e in events if e["kind"] == "restore_rejected")
        summary = summarize_run(run)
        stall = longest_stall(events)
        equal: bool | None = None
        if code == 0:
            try:
                assert_same_run(run, reference, work, steps)
                equal = True
            except AssertionError:
                equal = False
        verdict = {True: "equal", False: "DIFFERS", None: "-"}[equal]
        print(
            f"{seed:>4} {f'{ranks}/{others}':>9} {summary.generations:>4} {code:>4} {verdict:>8} "
            f"{summary.steps_lost:>6} {rejected:>8} {len(left):>9} {stall:>7.1f} {summary.wall_s or 0:>7.1f}",
            flush=True,
        )
        for item in left:
            print(f"     left: {item}")
        totals["faults"] += ranks + others
        totals["divergent"] += equal is False
        totals["leftovers"] += len(left)
        totals["rejected"] += rejected
        totals["stalled"] += stall > args.max_stall_s
        if code != 0 or equal is not True or left or stall > args.max_stall_s:
            bad += 1
            print(f"     kept: {run} (log {run}.log)")
        else:
            subprocess.run(["rm", "-rf", str(run)], check=False)
    print(
        f"{args.seeds} runs, {totals['faults']} faults, {totals['divergent']} divergent, "
        f"{totals['leftovers']} leftovers, {totals['stalled']} stalled over {args.max_stall_s:g} s, "
        f"{totals['rejected']} sources rejected by verification, "
        f"{bad} runs not clean ({time.monotonic() - started:.0f} s)"
    )
    if not bad and not args.keep:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 1 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=None, help="one chaos job per seed (see above)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--max-stall-s", type=float, default=60.0, help="with --seeds: a longer stall fails")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="buddy4", help="with --seeds")
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--mtbf-steps", type=float, default=3.0)
    parser.add_argument("--tier", type=int, default=4)
    parser.add_argument("--types", nargs="+", default=["kill", "hang", "stall", "exception"])
    parser.add_argument("--injected-by", choices=["inside", "outside"], default="inside")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chaos-mtbf-s", type=float, default=None, help="fault=chaos, S seconds apart")
    parser.add_argument(
        "--steps", type=int, default=None, help="trainer.max_steps (default: from the faults)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directories (path printed)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()
    if args.seeds is not None:
        if args.faults == parser.get_default("faults"):
            args.faults = 10
        sys.exit(seed_rows(args))

    chaos = args.chaos_mtbf_s is not None
    if args.steps is not None:
        steps = args.steps
    elif chaos:  # ~0.5 s per step here, and each fault costs a recovery
        steps = int(args.faults * args.chaos_mtbf_s / 0.5) + 20
    else:
        steps = int(args.faults * args.mtbf_steps * 1.5) + 10
    every = 10 if chaos else 0 if args.tier == 4 else 5
    common = [
        f"tier={args.tier}",
        f"trainer.max_steps={steps}",
        "trainer.enable_progress_bar=false",
        "agent.hang_timeout=6",
        "agent.recovery_timeout=120",
        "comm.init_timeout_s=60",
        f"checkpoint.every_n_steps={every}",
        *args.overrides,
    ]
    if chaos:
        kind = ["fault=chaos", f"fault.mtbf_s={args.chaos_mtbf_s}"]
    else:
        kind = [
            "fault=random",
            f"fault.mtbf_steps={args.mtbf_steps}",
            f"fault.injected_by={args.injected_by}",
            f"fault.types=[{','.join(args.types)}]",
        ]
    faulty = [
        *kind,
        f"fault.max_faults={args.faults}",
        f"fault.seed={args.seed}",
        f"agent.max_restarts={args.faults + 10}",
        f"agent.restart_window_s={10 * 24 * 3600}",
    ]
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="ckless-soak-"))
    run, reference = work / "soak", work / "reference"
    budget_s = 600 + steps * 10 + args.faults * 60
    code = launch(run, [*common, *faulty], budget_s)
    events = read_events(run / "events.jsonl")
    alive = sorted(set(leftovers(run)) | set(started_alive(events)))
    caches = cache_dirs(events)
    summary = summarize_run(run)
    code_ref = launch(reference, [*common, "fault=none"], 600 + steps * 10)

    injected = [e for e in events if e["kind"] == "fault_injected"]
    others = [e for e in events if e["kind"] == "process_fault_injected"]
    detected = [e for e in events if e["kind"] == "fault_detected"]
    ends = [e for e in events if e["kind"] == "rank_end"]
    redone = [f.steps_lost for f in summary.faults if f.steps_lost is not None]
    by_type: dict[str, int] = {}
    for e in injected:
        by_type[e["fault_type"]] = by_type.get(e["fault_type"], 0) + 1

    for e in others:
        key = f"{e['target']} {e['signal']}"
        by_type[key] = by_type.get(key, 0) + 1
    how = f"chaos (mean {args.chaos_mtbf_s:g} s apart)" if chaos else "random"
    print(f"soak: {args.faults} {how} faults planned, tier {args.tier}, {steps} steps, exit code {code}")
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(by_type.items()))
    print(
        f"  injected {len(injected) + len(others)} ({kinds}), "
        f"on ranks {len(injected)}, detected by agents {len(detected)}, generations {summary.generations}"
    )
    recovered = sum(1 for f in summary.faults if f.outcome == "recovered")
    print(
        f"  recovered {recovered} of {len(summary.faults)} faults in the summary (the others superseded by "
        f"or handled in a later recovery); steps redone {summary.steps_lost} in all "
        f"(max {max(redone, default=0)} in a fault's row)"
    )
    if summary.goodput is not None:
        print(
            f"  goodput {summary.goodput:.3f}, ML goodput {summary.ml_goodput:.3f}, "
            f"wall {summary.wall_s:.0f} s, median step {summary.step_time_s:.3f} s"
        )
    if summary.giveup_reason:
        print(f"  gave up: {summary.giveup_reason}")
    if code == 0 and code_ref == 0:
        try:
            assert_same_run(run, reference, work, steps)
            print("  bitwise: every loss, final weights and optimizer state equal to the fault-free run")
        except AssertionError as err:
            print(f"  bitwise: DIFFERENT from the fault-free run: {str(err)[:300]}")
    else:
        print(f"  bitwise: not compared (exit codes {code} and {code_ref})")
    print(f"  leaked processes: {len(alive)}{': ' + '; '.join(alive) if alive else ''}")
    print(f"  leaked batch-cache directories: {len(caches)}{': ' + ', '.join(caches) if caches else ''}")
    if ends:

        def worst(key: str) -> int:
            return max(int(e.get(key) or 0) for e in ends)

        print(
            f"  at each rank's end (max over {len(ends)} rank ends): threads {worst('threads')}, "
            f"TCP sockets {worst('tcp_sockets')}, process groups {worst('process_groups')}"
        )
    print(
        f"({time.monotonic() - started:.0f} s; "
        f"runs in {work if args.keep else 'a removed temporary directory'})"
    )
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    main()
