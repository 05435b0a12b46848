"""Time to a restarted rank's first batch, and node memory for batches, with and without the batch cache.

    python bench/data_restart.py [--steps 10 100 1000] [--prefetch 8] [--lookback 4] [--repeats 1]
                                 [--cache-dir DIR]

Data: ``llama3_tiny``'s (the first 8 MB of the built-in corpus, seq_len 128, micro-batch 4),
4 data-parallel ranks on one node; the "restarted" rank is dp rank 1. ``--cache-dir`` keeps
the prepared dataset between runs (default: a temporary directory, prepared afresh).

Each cell is measured in a fresh ``python`` subprocess that imports what it needs, so import
cost is included, and reported apart from the time to the first batch:

- ``replay``: the baseline of a non-resumable loader (torchrun / plain Lightning
  ``DataLoader``): rebuild the pipeline (``load_prepared``) and iterate the loader from step 0
  up to N, taking batch N. A lower bound for a real replay: no workers, no collate.
- ``direct``: our pure-function loader (tiers 0-1): ``StepBatchLoader`` started at N.
- ``cache``: tier 2: the node's reader (``python -m ckless_lightning.data.cache_reader``, one
  process, running throughout) has filled the window around N; the rank only requests N and
  memory-maps its micro-batch.

Columns: ``import s`` is the wall time of the subprocess's imports, ``first s`` the wall time
from then until it holds batch N (the three methods' batches are checked to be identical).
The peak RSS line is the subprocesses' peak resident memory (max over steps). The memory line
compares the node's batches held as 4 ranks x ``prefetch`` steps of per-rank tensors (one
copy per rank, summed) with the cache's entry files for the window (``prefetch + lookback``
steps of all 4 ranks, int32 ids, counted once for the node).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DP_SIZE, DP_RANK, MBS, SEQ_LEN, SEED = 4, 1, 4, 128, 1234
METHODS = ("replay", "direct", "cache")
KEYS = ("import_s", "first_s", "rss_mib")

CHILD = r"""
import hashlib, json, resource, sys, time
from pathlib import Path
t0 = time.perf_counter()
mode, a = sys.argv[1], json.loads(sys.argv[2])
if mode == "cache":
    from ckless_lightning.data.batch_cache import BatchCacheLayout, BatchCacheReader
else:
    from ckless_lightning.data import StepBatchLoader, load_prepared
t1 = time.perf_counter()
step = a["step"]
if mode == "cache":
    layout = BatchCacheLayout(Path(a["root"]), tuple(a["dp_ranks"]), a["mbs"], a["row_len"], a["tag"])
    reader = BatchCacheReader(layout)
    reader.request(step, a["local"])
    batch = reader.wait_read(step, a["local"], timeout_s=120)
else:
    kw = dict(seed=a["seed"], micro_batch_size=a["mbs"], dp_rank=a["dp_rank"], dp_size=a["dp_size"])
    loader = StepBatchLoader(load_prepared(a["prepared"]), start_step=0 if mode == "replay" else step, **kw)
    for batch in loader:
        if batch["step"] == step:
            break
t2 = time.perf_counter()
digest = hashlib.sha256(batch["input_ids"].numpy().tobytes() + batch["sample_ids"].numpy().tobytes())
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"import_s": t1 - t0, "first_s": t2 - t1, "digest": digest.hexdigest(), "rss_mib": rss}))
"""


def measure(mode: str, args: dict) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, json.dumps(args)], cwd=ROOT, capture_output=True, text=True
    )
    if result.returncode:
        raise RuntimeError(f"{mode} at step {args['step']} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def wait_window(layout, steps: range, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(layout.entry_path(s).exists() for s in steps):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the cache reader did not fill steps {steps.start}..{steps.stop - 1} in {layout.root}"
            )
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", nargs="+", type=int, default=[10, 100, 1000])
    parser.add_argument("--prefetch", type=int, default=8)
    parser.add_argument("--lookback", type=int, default=4)
    parser.add_argument("--cache-dir", default=None, help="prepared-data cache dir (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=1, help="subprocesses per cell; the median is shown")
    opts = parser.parse_args()

    import datasets

    from ckless_lightning.data import DataConfig, StepBatchLoader, load_prepared, prepare_dataset
    from ckless_lightning.data.batch_cache import (
        BatchCacheLayout,
        BatchCacheReader,
        create_cache_dir,
        remove_cache_dir,
        source_tag,
    )

    datasets.disable_progress_bars()
    work = Path(tempfile.mkdtemp(prefix="data_restart-"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    job_id = f"bench-{os.getpid()}"
    reader_proc: subprocess.Popen | None = None
    try:
        started = time.perf_counter()
        cfg = DataConfig(
            max_source_bytes=8_000_000,
            seq_len=SEQ_LEN,
            micro_batch_size=MBS,
            cache_dir=opts.cache_dir or str(work),
        )
        prepared = prepare_dataset(cfg)
        print(
            f"prepared {prepared.num_samples} samples in {time.perf_counter() - started:.1f}s "
            f"at {prepared.path}"
        )
        dataset = load_prepared(prepared.path)
        loaders = [
            StepBatchLoader(dataset, seed=SEED, micro_batch_size=MBS, dp_rank=r, dp_size=DP_SIZE)
            for r in range(4)
        ]
        root = create_cache_dir(shm, job_id, 0)
        layout = BatchCacheLayout(
            root, tuple(range(DP_SIZE)), MBS, SEQ_LEN + 1, source_tag(prepared.path, SEED, DP_SIZE, MBS)
        )
        cmd = [sys.executable, "-m", "ckless_lightning.data.cache_reader", "--prepared", str(prepared.path)]
        cmd += ["--root", str(root), "--dp-ranks", ",".join(map(str, layout.dp_ranks)), "--seed", str(SEED)]
        cmd += ["--dp-size", str(DP_SIZE), "--micro-batch-size", str(MBS), "--prefetch", str(opts.prefetch)]
        cmd += ["--lookback", str(opts.lookback), "--start-step", str(opts.steps[0])]
        reader_proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
        base = {
            "prepared": str(prepared.path),
            "seed": SEED,
            "mbs": MBS,
            "dp_rank": DP_RANK,
            "dp_size": DP_SIZE,
        }
        base |= {"root": str(root), "dp_ranks": list(layout.dp_ranks), "row_len": SEQ_LEN + 1}
        base |= {"tag": layout.source_tag, "local": layout.dp_ranks.index(DP_RANK)}
        consumers = BatchCacheReader(layout)
        rows, window_bytes = [], 0
        for step in opts.steps:
            # the node's consumers walk up to N, as a run that reached N did: the reader's window follows
            # them and keeps `lookback` steps behind them
            window = range(max(0, step - opts.lookback), step + opts.prefetch)
            for s in range(window.start, step + 1):
                for i in range(layout.n_ranks):
                    consumers.request(s, i)
                wait_window(layout, range(s, s + 1))
            wait_window(layout, window)
            window_bytes = sum(layout.entry_path(s).stat().st_size for s in window)
            runs = {m: [measure(m, {**base, "step": step}) for _ in range(opts.repeats)] for m in METHODS}
            digests = {r["digest"] for rs in runs.values() for r in rs}
            if len(digests) != 1:
                raise RuntimeError(f"step {step}: the methods returned different batches: {runs}")
            results = {m: {k: statistics.median(r[k] for r in rs) for k in KEYS} for m, rs in runs.items()}
            rows.append((step, results))

        print(
            f"\nrestarted dp rank {DP_RANK} of {DP_SIZE}; seconds, median of {opts.repeats} fresh "
            "subprocess(es) per cell; the three methods' batches are identical"
        )
        header = f"{'step':>6} | " + " | ".join(f"{m + ' import':>13} {m + ' first':>12}" for m in METHODS)
        print(header)
        print("-" * len(header))
        for step, results in rows:
            cells = " | ".join(
                f"{results[m]['import_s']:>13.2f} {results[m]['first_s']:>12.4f}" for m in METHODS
            )
            print(f"{step:>6} | {cells}")
        rss = {m: max(r[m]["rss_mib"] for _, r in rows) for m in METHODS}
        print("peak RSS MiB: " + ", ".join(f"{m} {rss[m]:.0f}" for m in METHODS))

        per_step = [
            loaders[r].batch(opts.steps[-1] + k) for r in range(DP_SIZE) for k in range(opts.prefetch)
        ]
        per_rank = sum(b["input_ids"].nbytes + b["sample_ids"].nbytes for b in per_step)
        print(
            f"node memory for batches: per-rank copies {DP_SIZE} ranks x {opts.prefetch} steps = "
            f"{per_rank / 1024:.1f} KiB; batch cache {len(window)} entries (prefetch {opts.prefetch} + "
            f"lookback {opts.lookback}, all {DP_SIZE} ranks) = {window_bytes / 1024:.1f} KiB, "
            "one copy for the node"
        )
    finally:
        if reader_proc is not None and reader_proc.poll() is None:
            reader_proc.send_signal(signal.SIGTERM)
            try:
                reader_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                reader_proc.kill()
                reader_proc.wait()
        remove_cache_dir(shm, job_id)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
