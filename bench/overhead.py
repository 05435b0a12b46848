"""Tier 3-4's steady-state cost against tier 0: the default job without a fault, runs interleaved.

    python bench/overhead.py [--repeats 3] [--steps 80] [--warmup 5] [--ranks 4] [override ...]

Five configurations of ``launch.py``'s default job (``llama3_tiny``, 4 sequences of 128 tokens
per rank and step, gloo, no disk checkpoint, no fault), each ``--repeats`` times, interleaved
(tier 0, tier 3, tier 4 buddy, tier 0 HSDP, tier 4 HSDP, tier 0, ...) so that the drift of a
shared machine hits them alike:

- tier 0 on the FSDP mesh against tier 3 (the commit vote) and tier 4 with buddy copies;
- tier 0 on the HSDP mesh (replicate 2) against tier 4 with HSDP replicas (same mesh, same compute).

Per run and rank, from ``step_stats/rank<N>.json``: the wall time from one step's end to the
next and the rank's CPU time over it (all its threads; where ranks share cores, CPU time is what
a step costs), medians over the steady steps, then the mean over ranks; per configuration, the
median over repeats. Steady: after ``--warmup`` steps and after the spare is ready (tiers 3-4
start one after the first step; its imports take seconds of these shared cores, once). Also,
from ``commit_votes``, what tiers 3-4 account per step and rank (vote, snapshot, the wait for the
buddy exchange). Printed: a table and the ratios. Extra arguments are Hydra overrides for every run.

Progress goes to stderr, the table to stdout. Compare rows of one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckless_lightning.record.events import read_events  # noqa: E402

HSDP = ("cluster.replicate=2", "replication.source=hsdp")
CONFIGS = {
    "tier 0": ("tier=0",),
    "tier 3": ("tier=3",),
    "tier 4 buddy": ("tier=4", "replication.source=buddy"),
    "tier 0 hsdp": ("tier=0", "cluster.replicate=2"),
    "tier 4 hsdp": ("tier=4", *HSDP),
}
SETTLE_S = 1.0
MIN_INTERVALS = 10
PAIRS = (("tier 3", "tier 0"), ("tier 4 buddy", "tier 0"), ("tier 4 hsdp", "tier 0 hsdp"))


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_once(run_dir: Path, config: tuple[str, ...], args: argparse.Namespace) -> dict[str, float]:
    """One job; its per-step wall and CPU seconds (rank mean of medians) and tier 4's accounts."""
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={args.steps}",
        f"cluster.nproc_per_node={args.ranks}",
        f"trainer.global_batch_size={4 * args.ranks}",
        "trainer.enable_progress_bar=false",
        "checkpoint.every_n_steps=0",
        "checkpoint.save_final=false",
        "fault=none",
        *config,
        *args.overrides,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "step_stats").glob("rank*.json"))]
    events = read_events(run_dir / "events.jsonl")
    # A spare imports for seconds after the first step (a one-time cost on these shared cores):
    # steady state starts once it is ready.
    ready = max((e["t"] for e in events if e["kind"] == "spare_prepared"), default=0.0) + SETTLE_S
    kept = [
        [i for i, t in enumerate(r["interval_end_times"]) if i >= args.warmup and t > ready] for r in ranks
    ]
    if not ranks or any(len(k) < MIN_INTERVALS for k in kept):
        raise RuntimeError(f"{run_dir}: fewer than {MIN_INTERVALS} steady steps recorded; raise --steps")
    figures = {
        key: statistics.mean(
            statistics.median(r[name][i] for i in k) for r, k in zip(ranks, kept, strict=True)
        )
        for key, name in (("wall_s", "interval_seconds"), ("cpu_s", "interval_cpu_seconds"))
    }
    votes = [e for e in events if e["kind"] == "commit_votes"]
    for key in ("vote_s", "vote_cpu_s", "snapshot_s", "snapshot_cpu_s", "exchange_wait_s"):
        count = "votes" if key.startswith("vote") else "snapshots"
        per_rank = [e[key] / e[count] for e in votes if e.get(key) is not None and e.get(count)]
        if per_rank:
            figures[key] = statistics.mean(per_rank)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4, help="ranks (one node), 4 sequences each per step")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=5, help="step intervals left out at the start")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    started = time.monotonic()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="ckless-overhead-") as tmp:
        for i in range(args.repeats):
            for name, config in CONFIGS.items():
                progress(f"{name}, run {i + 1}/{args.repeats}")
                results[name].append(run_once(Path(tmp) / f"{name.replace(' ', '-')}-{i}", config, args))

    def med(name: str, key: str) -> float | None:
        values = [r[key] for r in results[name] if key in r]
        return statistics.median(values) if values else None

    keys = ("wall_s", "cpu_s", "vote_s", "vote_cpu_s", "snapshot_s", "snapshot_cpu_s", "exchange_wait_s")
    widths = (14, 7, 7, 7, 9, 9, 7)

    def row(first: str, cells: list[str]) -> str:
        return f"{first:<14} " + " ".join(f"{t:>{w}}" for t, w in zip(cells, widths, strict=True))

    print(row("", ["per step (ms):", "", "vote", "vote", "snapshot", "snapshot", "buddy"]))
    print(row("configuration", ["wall", "CPU", "wall", "CPU", "wall", "CPU", "wait"]))
    for name in CONFIGS:
        print(row(name, [f"{1e3 * v:.2f}" if (v := med(name, k)) is not None else "-" for k in keys]))
    print()
    for tier4, tier0 in PAIRS:
        base_wall, base_cpu = med(tier0, "wall_s"), med(tier0, "cpu_s")
        wall, cpu = med(tier4, "wall_s"), med(tier4, "cpu_s")
        assert base_wall and base_cpu and wall and cpu
        own = sum(med(tier4, k) or 0.0 for k in ("vote_cpu_s", "snapshot_cpu_s"))
        print(
            f"{tier4} / {tier0}: wall {wall / base_wall:.3f} ({100 * (wall / base_wall - 1):+.1f}%), "
            f"CPU {cpu / base_cpu:.3f} ({100 * (cpu / base_cpu - 1):+.1f}%); "
            f"its own CPU per step (vote + snapshot) {1e3 * own:.2f} ms = {100 * own / base_cpu:.1f}% "
            f"of {tier0}'s"
        )
    print(
        f"\n(medians of {args.repeats} interleaved runs of {args.steps} steps each, the first {args.warmup} "
        f"step intervals left out, and those before the spare was ready; vote, snapshot, buddy wait: "
        f"tiers 3-4's own accounts per step and rank, CPU: the rank's main thread; "
        f"{time.monotonic() - started:.0f} s for this script.)"
    )


if __name__ == "__main__":
    main()
