"""What a network partition costs: nodes in network namespaces cut off and healed, per scenario.

    sudo python bench/partitions.py [--scenarios none short node store-one peers-one store-all] [--tier 4]
        [--steps 16] [--json PATH]

Needs root, iproute2 and the test extra (it runs the tests' harness, tests/netns.py and
tests/partition_job.py): a two-node job (2 ranks per node) on a standalone store, every node and
the store in a network namespace of its own, ``agent.node_timeout=6`` (``agent.fence_after`` 3 s).
Links are cut at step 7:

- ``none``: no cut (the baseline: the median step);
- ``short``: node 1 cut off from everything for 1 s (below every timeout);
- ``node``: node 1 cut off from everything until a standby took it over (plus 1 s), then healed;
- ``store-one``: node 1 cut off from the store only (it still reaches its peers), same;
- ``peers-one``: node 1 cut off from its peers only (it still reaches the store), same: the agents'
  probes decide (``agent.probe_after`` = ``hang_timeout / 4`` = 5 s of silence);
- ``store-all``: the store cut off from every node for 20 s (past fence and give-up).

Per scenario: detection (cut to the fence of the cut-off node), the job moving on (cut to its next
generation), time to the first step after the cut, steps redone, the median step (the baseline), and
what the cut-off node did (its agent's decisions, and when a give-up came).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' netns harness

from netns import NetnsCluster, netns_unavailable
from partition_job import PartitionJob

SCENARIOS = ("none", "short", "node", "store-one", "peers-one", "store-all")
CUT_AT_STEP = 7
_DECISIONS = ("fenced", "unfenced", "agent_replaced", "store_lost")


def run_scenario(name: str, *, tier: int, steps: int, data_cache: Path, scratch: Path) -> dict:
    standby = name in ("node", "store-one", "peers-one")
    with NetnsCluster(3) as cluster:
        job = PartitionJob(cluster, scratch / name, data_cache, f"trainer.max_steps={steps}")
        try:
            job.start_nodes(standby=standby, tier=tier)
            cut_at = None
            if name != "none":
                job.wait_for_step(CUT_AT_STEP)
                cut_at = time.time()
                if name == "short":
                    cluster.cut(1)
                    time.sleep(1.0)
                    cluster.heal(1)
                elif name == "store-all":
                    cluster.cut_store()
                    time.sleep(20.0)
                    cluster.heal_store()
                else:
                    links = {"peers": name != "store-one", "store": name != "peers-one"}
                    cluster.cut(1, **links)
                    job.wait_for_event("generation", timeout=120, gen=1)
                    time.sleep(1.0)
                    cluster.heal(1, **links)
            codes = job.finish(timeout=300)
        finally:
            job.close()
    return summarize(name, job, cut_at, codes)


def summarize(name: str, job: PartitionJob, cut_at: float | None, codes: dict[str, int]) -> dict:
    rows = [json.loads(line) for line in (job.run / "losses.jsonl").open()] if job.run.exists() else []
    times = [r["t"] for r in rows]
    step_s = statistics.median(b - a for a, b in itertools.pairwise(times)) if len(times) > 2 else None
    row: dict = {"scenario": name, "exit_codes": codes, "median_step_s": step_s, "steps_redone": 0}
    row["steps_redone"] = len(rows) - len({r["step"] for r in rows})
    if cut_at is None:
        return row
    fenced = [e for e in job.events("fenced") if e["t"] > cut_at]
    gave_up = [e for e in job.events("store_lost") if e["t"] > cut_at]
    moved = [e for e in job.events("generation") if e["t"] > cut_at]
    after = [t for t in times if t > cut_at]
    row.update(
        fenced_nodes=sorted({e["node"] for e in fenced}),
        detect_s=round(min(e["t"] for e in fenced) - cut_at, 2) if fenced else None,
        moved_on_s=round(min(e["t"] for e in moved) - cut_at, 2) if moved else None,
        first_step_after_s=round(after[0] - cut_at, 2) if after else None,
        gave_up_s=round(max(e["t"] for e in gave_up) - cut_at, 2) if gave_up else None,
        cut_off_node=[  # node 1's agent's own decisions (a standby that takes node 1 over is agent1 too)
            e["kind"] for e in job.events_from("agent1") if e["t"] > cut_at and e["kind"] in _DECISIONS
        ],
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--tier", type=int, default=4, choices=(1, 3, 4))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    why = netns_unavailable()
    if why is not None:
        print(f"bench/partitions.py: {why}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="ckless-partitions-"))
    data_cache = Path(os.environ.get("CKLESS_BENCH_DATA", scratch / "data_cache"))
    data_cache.mkdir(parents=True, exist_ok=True)
    print(
        f"tier {args.tier}, {args.steps} steps, 2 nodes x 2 ranks, cut at step {CUT_AT_STEP}; "
        f"runs in {scratch}"
    )
    rows = []
    for name in args.scenarios:
        print(f"[{name}] running ...", flush=True)
        row = run_scenario(name, tier=args.tier, steps=args.steps, data_cache=data_cache, scratch=scratch)
        rows.append(row)
        print(f"[{name}] {json.dumps(row)}", flush=True)
    header = (
        f"{'scenario':<10} {'detect':>7} {'moved on':>9} {'1st step':>9} {'redone':>7} {'step':>6}"
        "  cut-off node"
    )
    print("\n" + header)
    for r in rows:
        step = f"{r['median_step_s']:.2f}" if r["median_step_s"] else "-"
        print(
            f"{r['scenario']:<10} {_s(r.get('detect_s')):>7} {_s(r.get('moved_on_s')):>9} "
            f"{_s(r.get('first_step_after_s')):>9} {r['steps_redone']:>7} {step:>6}  "
            f"exits {r['exit_codes']}; {' > '.join(r.get('cut_off_node', []))}"
            + (f" (exit 75 {r['gave_up_s']:.1f} s after the cut)" if r.get("gave_up_s") else "")
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


if __name__ == "__main__":
    raise SystemExit(main())
