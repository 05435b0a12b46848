"""Elastic HSDP's costs by model size, side by side with a tier-4 replacement of the same rank.

    python bench/elastic.py [--dims 128 256 512] [--steps 16] [--replace-timeout 2]

For each model width (``model.dim``; ``llama3_tiny`` otherwise, HSDP 2x2 on 4 CPU ranks, gloo)
two jobs run through ``launch.py``:

- baseline: tier 4, rank 3 killed in step 4 and replaced at once (a warm spare) from its
  replica: detection + hand-over + one shard transfer;
- elastic: ``elastic.enabled``, rank 3's device lost in step 4 (``fault=slot_lost``), back after
  step 8: the job waits ``agent.replace_timeout``, shrinks to one replica, and grows back.

Printed per size: the state each rank holds, the baseline's recovery (fault -> first step), the
shrink (resize -> first step at width 2: process groups among the survivors and their own state,
nothing moves), the grow (resize -> first step at width 4: the returning replica receives its
shards) and its transfer (the slowest rank's state load), and the median step at each width (the
same global batch: twice the micro-batches per rank at width 2). The elastic job's figures exclude
the wait for a replacement (``agent.replace_timeout``), which is configuration, not cost.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def launch(run: Path, data_cache: Path, *overrides: str) -> list[dict[str, Any]]:
    command = [
        sys.executable,
        str(ROOT / "launch.py"),
        f"hydra.run.dir={run}",
        f"data.cache_dir={data_cache}",
        "data.max_source_bytes=2000000",
        "data.seq_len=32",
        "trainer.enable_progress_bar=false",
        "timeline=false",
        "tier=4",
        "cluster=local_cpu_hsdp",
        "replication.source=hsdp",
        "checkpoint.every_n_steps=0",
        *overrides,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"{run.name}: exit {result.returncode}\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]


def first_step_after(events: list[dict[str, Any]], gen: int) -> float:
    return max(
        e["t"]
        for e in events
        if e["kind"] == "rank_phase" and e["phase"] == "first_step_done" and e["gen"] == gen
    )


def slowest(events: list[dict[str, Any]], gen: int, start: str, end: str) -> float:
    phases: dict[str, dict[int, float]] = {}
    for e in events:
        if e["kind"] == "rank_phase" and e.get("gen") == gen and e["phase"] in (start, end):
            phases.setdefault(e["phase"], {}).setdefault(e["rank"], e["t"])
    ranks = phases.get(start, {}).keys() & phases.get(end, {}).keys()
    return max(phases[end][r] - phases[start][r] for r in ranks)


def step_times(run: Path, events: list[dict[str, Any]]) -> dict[int, float]:
    """Median step time at each width: consecutive loss records within one generation's width."""
    resizes = [e for e in events if e["kind"] == "elastic_resize"]
    records = [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines() if line.strip()]
    by_width: dict[int, list[float]] = {}
    for a, b in itertools.pairwise(records):
        width = 4
        for r in resizes:
            if r["t"] <= a["t"]:
                width = r["dp_size"]
        crossed = any(a["t"] < r["t"] < b["t"] for r in resizes)
        faults = any(a["t"] < e["t"] < b["t"] for e in events if e["kind"] == "fault_injected")
        if b["step"] == a["step"] + 1 and not crossed and not faults:
            by_width.setdefault(width, []).append(b["t"] - a["t"])
    return {w: statistics.median(ts) for w, ts in by_width.items()}


def plan_of(run: Path):
    """The memory plan of the run's resolved config (parameters, per-rank state bytes)."""
    from omegaconf import OmegaConf

    from ckless_lightning.runtime.config import job_config_from_dict
    from ckless_lightning.runtime.memory_plan import plan_job

    container = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"), resolve=True)
    assert isinstance(container, dict)
    return plan_job(job_config_from_dict(container))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 256, 512], help="model.dim values")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--replace-timeout", type=float, default=2.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckless-elastic-bench-") as tmp:
        base = Path(tmp)
        for dim in args.dims:
            size = (f"model.dim={dim}", f"model.ffn_dim={3 * dim}", f"trainer.max_steps={args.steps}")
            print(f"dim {dim}: baseline (tier-4 replacement) ...", file=sys.stderr, flush=True)
            kill = launch(
                base / f"kill{dim}", base / "data", *size, "fault=kill", "fault.rank=3", "fault.step=4"
            )
            print(f"dim {dim}: elastic (shrink, grow) ...", file=sys.stderr, flush=True)
            run = base / f"elastic{dim}"
            elastic = launch(
                run,
                base / "data",
                *size,
                "elastic.enabled=true",
                f"agent.replace_timeout={args.replace_timeout}",
                "fault=slot_lost",
                "fault.rank=3",
                "fault.step=4",
                "fault.return_step=8",
            )
            (injected,) = [e for e in kill if e["kind"] == "fault_injected"]
            replaced = max(
                e["gen"] for e in kill if e["kind"] == "rank_phase" and e["phase"] == "first_step_done"
            )
            shrink, grow = [e for e in elastic if e["kind"] == "elastic_resize"]
            plan = plan_of(run)
            rows.append(
                {
                    "dim": dim,
                    "params": plan.num_params,
                    "shard_mb": (plan.param_bytes + plan.optim_bytes) / 1e6,
                    "baseline_s": first_step_after(kill, replaced) - injected["t"],
                    "shrink_s": first_step_after(elastic, shrink["gen"]) - shrink["t"],
                    "grow_s": first_step_after(elastic, grow["gen"]) - grow["t"],
                    "grow_load_s": slowest(elastic, grow["gen"], "state_load_start", "state_load_done"),
                    "steps": step_times(run, elastic),
                }
            )
    print(f"HSDP 2x2, llama3_tiny shape, {args.steps} steps; seconds (elastic: without the replacement wait)")
    print("dim   params   shard MB  baseline  shrink   grow  grow load  step@4  step@2")
    for r in rows:
        steps = r["steps"]
        print(
            f"{r['dim']:<5} {r['params'] / 1e6:5.1f}M {r['shard_mb']:9.1f} {r['baseline_s']:9.2f} "
            f"{r['shrink_s']:7.2f} {r['grow_s']:6.2f} {r['grow_load_s']:10.2f}"
            f" {steps.get(4, float('nan')):7.2f} {steps.get(2, float('nan')):7.2f}"
        )


if __name__ == "__main__":
    main()
