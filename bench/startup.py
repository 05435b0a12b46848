"""Start-up of the default job with the fork server against without it, runs interleaved.

    python bench/startup.py [--repeats 3] [--steps 3] [--tier 4] [override ...]

``launch.py``'s default job (tier 4, ``llama3_tiny`` on 4 CPU ranks) without its demo fault, for
``--steps`` steps, ``--repeats`` times with ``agent.fork_server=false`` (every rank a cold
``python -m ckless_lightning.rank``: each imports torch, Lightning and the project) and with
``agent.fork_server=true`` (one process imports them once and forks the ranks), alternating so
that the drift of a shared machine hits both alike. Per run, from ``events.jsonl``:

- start-up: the job's start (``job_start``) -> the first completed step of generation 0;
- of which: -> the ranks started (cold: at once; forked: when the fork server was ready), and
  process start -> imports done (the slowest rank);
- before it: ``launch.py`` started -> the job's start (config, memory plan, data preparation);
- the command's wall time (``launch.py`` started -> exited).

Printed: the median per configuration and the ratio fork server / cold. Progress goes to
stderr, the table to stdout. Extra arguments are Hydra overrides for every run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckless_lightning.record.events import read_events  # noqa: E402

CONFIGS = {"cold ranks": ("agent.fork_server=false",), "fork server": ("agent.fork_server=true",)}
FIGURES = ("launcher_s", "startup_s", "ranks_started_s", "imports_s", "command_s")


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_once(run_dir: Path, config: tuple[str, ...], args: argparse.Namespace) -> dict[str, float]:
    """One job; its start-up figures in seconds."""
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        f"hydra.run.dir={run_dir}",
        f"tier={args.tier}",
        f"trainer.max_steps={args.steps}",
        "trainer.enable_progress_bar=false",
        "checkpoint.every_n_steps=0",
        "checkpoint.save_final=false",
        "fault=none",
        *config,
        *args.overrides,
    ]
    started = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True)
    command_s = time.time() - started
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    events = read_events(run_dir / "events.jsonl")
    (job_start,) = [e["t"] for e in events if e["kind"] == "job_start"]
    gen0 = [e for e in events if e["kind"] == "rank_phase" and e["gen"] == 0]
    first_step = min(e["t"] for e in gen0 if e["phase"] == "first_step_done")
    ranks_started = min(e["t"] for e in events if e["kind"] == "ranks_started" and e["gen"] == 0)
    spawned = {e["rank"]: e["t"] for e in gen0 if e["phase"] == "process_start"}
    imported = {e["rank"]: e["t"] for e in gen0 if e["phase"] == "imports_done"}
    return {
        "launcher_s": job_start - started,
        "startup_s": first_step - job_start,
        "ranks_started_s": ranks_started - job_start,
        "imports_s": max(imported[r] - spawned[r] for r in imported),
        "command_s": command_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tier", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()

    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="ckless_startup_") as tmp:
        for repeat in range(args.repeats):
            for name, config in CONFIGS.items():
                progress(f"{name}, run {repeat + 1}/{args.repeats}")
                figures = run_once(Path(tmp) / f"{name.replace(' ', '_')}_{repeat}", config, args)
                progress("  " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
                results[name].append(figures)

    medians = {
        name: {k: statistics.median(r[k] for r in runs) for k in FIGURES} for name, runs in results.items()
    }
    print(f"\nstart-up of the default job (tier {args.tier}, {args.steps} steps, medians of {args.repeats})")
    print(f"{'':14}" + "".join(f"{k:>16}" for k in FIGURES))
    for name, figures in medians.items():
        print(f"{name:14}" + "".join(f"{figures[k]:>16.2f}" for k in FIGURES))
    cold, forked = medians["cold ranks"], medians["fork server"]
    print(f"{'ratio':14}" + "".join(f"{forked[k] / cold[k]:>16.2f}" for k in FIGURES))
    print("launcher_s: launch.py started -> job start; startup_s: job start -> first step;")
    print("ranks_started_s: job start -> ranks started;")
    print("imports_s: the slowest rank's process start -> imports done; command_s: launch.py's wall time")


if __name__ == "__main__":
    main()
