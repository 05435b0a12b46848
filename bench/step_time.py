"""Step time, tokens/s and peak RSS per rank of the tiny recipes at 1, 2 and 4 ranks.

    python bench/step_time.py [--steps 12] [--warmup 3] [--recipes llama3_tiny mixtral_tiny] [--ranks 1 2 4]

Each configuration is a real ``launch.py`` run (gloo on CPU here). Every rank
keeps micro_batch_size sequences per step (weak scaling: the global batch grows
with the ranks). Step time is the median over the steps after warm-up of the
slowest rank; tokens/s counts all ranks. This machine is shared and noisy:
compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_config(recipe: str, ranks: int, steps: int, warmup: int, work: Path) -> dict[str, float]:
    run_dir = work / f"{recipe}-{ranks}"
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        f"recipe={recipe}",
        f"hydra.run.dir={run_dir}",
        f"cluster.nproc_per_node={ranks}",
        f"trainer.global_batch_size={4 * ranks}",
        "data.micro_batch_size=4",
        f"trainer.max_steps={steps}",
        "trainer.enable_progress_bar=false",
        "checkpoint.every_n_steps=0",
        "checkpoint.save_final=false",
        "fault=none",
        "tier=0",  # plain training; tier 4's overhead is measured by bench/recovery.py
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "step_stats").glob("rank*.json"))]
    per_step = [max(r["step_seconds"][i] for r in records) for i in range(warmup, steps)]
    step_s = statistics.median(per_step)
    tokens = sum(r["tokens_per_step_per_rank"] for r in records)
    return {
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "peak_rss_mib": max(r["peak_rss_bytes"] for r in records) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipes", nargs="+", default=["llama3_tiny", "mixtral_tiny"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print(f"{'recipe':<14} {'ranks':>5} {'step time (s)':>14} {'tokens/s':>10} {'peak RSS/rank (MiB)':>20}")
    with tempfile.TemporaryDirectory(prefix="ckless-bench-") as tmp:
        for recipe in args.recipes:
            for ranks in args.ranks:
                row = run_config(recipe, ranks, args.steps, args.warmup, Path(tmp))
                print(
                    f"{recipe:<14} {ranks:>5} {row['step_s']:>14.3f} {row['tokens_per_s']:>10.0f} "
                    f"{row['peak_rss_mib']:>20.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
