"""Many random faults in one job: survived, recoveries, lost steps, leaks, goodput, bitwise equality.

    python bench/soak.py [--faults 100] [--mtbf-steps 3] [--tier 4] [--types kill hang stall exception]
                         [--injected-by inside] [--keep] [override ...]

One ``launch.py`` job (``llama3_tiny``, 4 ranks, the default tier 4 with a spare) with
``fault=random``: ``--faults`` faults drawn by the job's own seeded schedule (exponential
arrivals, mean ``--mtbf-steps`` optimizer steps apart; each a random rank, phase and type of
``--types``), long enough for all of them, a fault budget above their number, a short
``agent.hang_timeout`` (a ``stall`` is only found by it), no disk checkpoint at tier 4. Then the
same job without faults. Printed:

- faults injected, detected, recovered (the job's own summary), generations, steps redone, and
  goodput (fault-free time over wall time);
- bitwise: every step's loss and the final weights and optimizer state against the fault-free run;
- leaks, after the job ended: processes whose command line names the run directory, batch-cache
  directories of the job under ``/dev/shm``, and from each rank's ``rank_end`` record the threads,
  TCP sockets and process groups it still held at its end (max over ranks and generations).

Extra arguments are Hydra overrides for both runs. Progress goes to stderr. Takes about
``faults x (mtbf x step time + recovery)``; ``--faults 20`` is a few minutes here.
"""

from __future__ import annotations

import argparse
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


def cache_dirs(events: list[dict]) -> list[str]:
    roots = {e["root"] for e in events if e["kind"] == "reader_started" and "root" in e}
    return sorted(r for r in roots if Path(r).exists())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--mtbf-steps", type=float, default=3.0)
    parser.add_argument("--tier", type=int, default=4)
    parser.add_argument("--types", nargs="+", default=["kill", "hang", "stall", "exception"])
    parser.add_argument("--injected-by", choices=["inside", "outside"], default="inside")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the run directories (path printed)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()

    steps = int(args.faults * args.mtbf_steps * 1.5) + 10
    common = [
        f"tier={args.tier}",
        f"trainer.max_steps={steps}",
        "trainer.enable_progress_bar=false",
        "agent.hang_timeout=6",
        "agent.recovery_timeout=120",
        "comm.init_timeout_s=60",
        *(["checkpoint.every_n_steps=0"] if args.tier == 4 else ["checkpoint.every_n_steps=5"]),
        *args.overrides,
    ]
    faulty = [
        "fault=random",
        f"fault.max_faults={args.faults}",
        f"fault.mtbf_steps={args.mtbf_steps}",
        f"fault.seed={args.seed}",
        f"fault.injected_by={args.injected_by}",
        f"fault.types=[{','.join(args.types)}]",
        f"agent.max_restarts={args.faults + 10}",
        f"agent.restart_window_s={10 * 24 * 3600}",
    ]
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="ckless-soak-"))
    run, reference = work / "soak", work / "reference"
    budget_s = 600 + steps * 10 + args.faults * 60
    code = launch(run, [*common, *faulty], budget_s)
    events = read_events(run / "events.jsonl")
    alive = leftovers(run)
    caches = cache_dirs(events)
    summary = summarize_run(run)
    code_ref = launch(reference, [*common, "fault=none"], 600 + steps * 10)

    injected = [e for e in events if e["kind"] == "fault_injected"]
    detected = [e for e in events if e["kind"] == "fault_detected"]
    ends = [e for e in events if e["kind"] == "rank_end"]
    redone = [f.steps_lost for f in summary.faults if f.steps_lost is not None]
    by_type: dict[str, int] = {}
    for e in injected:
        by_type[e["fault_type"]] = by_type.get(e["fault_type"], 0) + 1

    print(f"soak: {args.faults} random faults planned, tier {args.tier}, {steps} steps, exit code {code}")
    print(
        f"  injected {len(injected)} ({', '.join(f'{k} {v}' for k, v in sorted(by_type.items()))}), "
        f"detected by agents {len(detected)}, generations {summary.generations}"
    )
    recovered = sum(1 for f in summary.faults if f.outcome == "recovered")
    print(
        f"  recovered {recovered} of {len(summary.faults)} faults in the summary; steps redone "
        f"{sum(redone)} in all (max {max(redone, default=0)} per fault)"
    )
    if summary.goodput is not None:
        print(
            f"  goodput {summary.goodput:.3f}, wall {summary.wall_s:.0f} s, "
            f"median step {summary.step_time_s:.3f} s"
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
