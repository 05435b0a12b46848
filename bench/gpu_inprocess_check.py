"""GPU check of the in-process recovery path on CUDA with NCCL (run where a GPU is lent; not in CI).

    python bench/gpu_inprocess_check.py [--world 1]

Runs ``tests/user_trainer_script.py`` (a hand-written Trainer and module under
``InProcessRecovery``) on ``--world`` GPUs, once without a fault and once with
an exception on rank 0 in step 7: the raising rank aborts its NCCL communicator
(``recovery.sever.fail_fast``), every rank re-forms NCCL groups in-process and
reloads the step-5 checkpoint. Prints whether the final weights, AdamW state
and losses are bitwise equal, and checks tier 4's checksum and bucket packing
on CUDA tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SECRET = "test-job-secret-0123456789"  # the job store's secret, handed to the ranks
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckless_lightning.comm import JobStore  # noqa: E402
from ckless_lightning.replication import BucketLayout, checksum  # noqa: E402


def run_job(out: Path, world: int, fault_step: int) -> float:
    store = JobStore.host("127.0.0.1", 0, secret=SECRET)
    start = time.perf_counter()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "CKLESS_STORE_ADDR": "127.0.0.1",
            "CKLESS_STORE_PORT": str(store.port),
            "CKLESS_JOB_SECRET": SECRET,
            "CKLESS_GENERATION": "0",
        }
        cmd = [
            sys.executable,
            str(ROOT / "tests" / "user_trainer_script.py"),
            "--out",
            str(out),
            "--steps",
            "12",
            "--fault-step",
            str(fault_step),
            "--fault-rank",
            "0",
            "--accelerator",
            "gpu",
        ]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=1)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} GPU(s)")

    # Tier 4 transfer pieces on CUDA tensors.
    dev = torch.device("cuda")
    tensors = [
        torch.randn(1000, device=dev),
        torch.randn(7, 3, device=dev).bfloat16(),
        torch.arange(5, device=dev),
    ]
    layout = BucketLayout(tensors, bucket_bytes=2048)
    bufs = [
        torch.empty(layout.bucket_nbytes(i), dtype=torch.uint8, device=dev) for i in range(layout.num_buckets)
    ]
    for i, buf in enumerate(bufs):
        layout.pack(i, tensors, buf)
    sums = [checksum(b) for b in bufs]
    bufs[0][3] ^= 1
    print("cuda checksum detects a flipped bit:", not torch.equal(checksum(bufs[0]), sums[0]))
    bufs[0][3] ^= 1
    copies = [torch.zeros_like(t) for t in tensors]
    for i, buf in enumerate(bufs):
        layout.unpack(i, buf, copies)
    print(
        "cuda pack/unpack round trip exact:",
        all(torch.equal(a, b) for a, b in zip(tensors, copies, strict=True)),
    )

    with tempfile.TemporaryDirectory() as tmp:
        clean, faulty = Path(tmp) / "clean", Path(tmp) / "faulty"
        clean.mkdir(), faulty.mkdir()
        t_clean = run_job(clean, args.world, 0)
        t_fault = run_job(faulty, args.world, 7)
        same = True
        for rank in range(args.world):
            a = torch.load(clean / f"final_rank{rank}.pt", weights_only=False)
            b = torch.load(faulty / f"final_rank{rank}.pt", weights_only=False)
            for part in ("params", "optim"):
                for key in a[part]:
                    same &= bool(torch.equal(a[part][key].cpu(), b[part][key].cpu()))
            same &= json.loads((clean / f"losses_rank{rank}.json").read_text()) == json.loads(
                (faulty / f"losses_rank{rank}.json").read_text()
            )
            info = json.loads((faulty / f"info_rank{rank}.json").read_text())
            print(f"rank {rank}: recoveries={info['recoveries']} steps trained={info['steps_trained']}")
        print(f"clean run {t_clean:.1f} s, run with an in-process NCCL recovery {t_fault:.1f} s")
        print("bitwise equal after the in-process recovery on CUDA/NCCL:", same)


if __name__ == "__main__":
    main()
