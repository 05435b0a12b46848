"""What one GPU can check of the GPU path, in one run of a few minutes (run where a GPU is lent; never in CI).

    python bench/gpu_check.py [--mb 256] [--json PATH]

NCCL refuses two ranks on one GPU, so a multi-rank CUDA run needs more than one; this script checks,
on one GPU and in one process unless said otherwise, the pieces of the GPU path that one GPU can
run, each on real CUDA tensors through the project's own code:

1. state: a model on CUDA with ``AdamW(foreach=True)`` after two steps: its state spans devices
   (each ``step`` counter stays on the CPU);
2. tier 4's record: the host copy of that state (``SnapshotCopies.record``, pinned memory, one fused
   copy) and its fingerprint against the fingerprint of the live state (CUDA sums): equal;
   the copy's bandwidth against a device-to-device copy of the same bytes;
3. tier 4's restore: a step later, the live state restored from the host copy through the
   transfer's buckets (``BucketLayout.pack``, ``checksum`` on the device, ``unpack``), checked
   against the recorded fingerprint (``verify``'s comparison); peak device memory of the restore
   against the steady state's;
4. the HSDP state digest of the spanning state against the digest of its host copy: equal;
5. the vote's device wait (``torch.accelerator.synchronize``) and ``where.cuda_busy`` while a
   kernel runs and after;
6. an NCCL world of one, aborted (``recovery.sever.fail_fast``) and formed again in the same
   process, with an all-reduce before and after;
7. a child forked from a process that imported what the fork server imports (CUDA not initialized
   there) uses CUDA;
8. a real device-side fault in a child process (an out-of-bounds index): the error type, and that
   ``is_device_fault`` calls it the rank's own fault.

Each check prints one line, ``ok`` or ``FAILED`` with what it saw; the exit status is the number of
failed checks. ``--json`` writes the figures. Without CUDA it says so and exits 0 (nothing to
check): a CPU machine runs the CPU tests instead (``pytest -k "device or cuda or accelerator or nccl"``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

WIDTH = 1024  # of the check's model (Linear layers)
RESULTS: dict[str, Any] = {}
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok    ' if ok else 'FAILED'} {name}: {detail}", flush=True)
    RESULTS[name] = {"ok": ok, "detail": detail}
    if not ok:
        FAILED.append(name)


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn`` (synchronized)."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    model(torch.randn(8, WIDTH, device=device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def spanning_state(
    mb: int, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    from ckless_lightning.replication.state import local_state_tensors

    layers = max(1, mb * (1 << 20) // (3 * 4 * WIDTH * WIDTH))  # params + two moments, fp32
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for _ in range(2):
        train_step(model, optimizer, device)
    return model, optimizer, local_state_tensors(model, [optimizer])


def _device_copy_seconds(state: list[torch.Tensor], device: torch.device) -> float:
    """A device-to-device copy of the same tensors (the baseline of the record's bandwidth)."""
    scratch = [torch.empty_like(t) for t in state]
    return timed(lambda: torch._foreach_copy_(scratch, state), device)


def check_record_restore_digest(mb: int, device: torch.device) -> None:
    from ckless_lightning.recovery.digest import StateDigest
    from ckless_lightning.replication import BucketLayout, SnapshotCopies, checksum
    from ckless_lightning.replication.fingerprint import TensorSums

    model, optimizer, state = spanning_state(mb, device)
    devices = sorted({str(t.device) for t in state})
    nbytes = sum(t.numel() * t.element_size() for t in state)
    check(
        "1 state spans devices",
        devices == sorted({"cpu", str(state[0].device)}),
        f"{len(state)} tensors on {devices}, {nbytes / 1e6:.0f} MB",
    )

    copies = SnapshotCopies(rank=0, world_size=1, source="buddy")
    recorded = copies.record(1, b"loop state", state, gen=0)
    live = TensorSums(state).fingerprint()
    check(
        "2 host copy fingerprint = live CUDA fingerprint",
        recorded.tensors == live,
        f"{recorded.tensors} / {live}",
    )
    d2h = timed(lambda: copies.record(1, b"loop state", state, gen=0), device)
    d2d = _device_copy_seconds(state, device)
    RESULTS["record_GBps"], RESULTS["d2d_copy_GBps"] = nbytes / d2h / 1e9, nbytes / d2d / 1e9
    check(
        "2 record bandwidth",
        True,
        f"record (copy to pinned host memory + fingerprint) {nbytes / d2h / 1e9:.1f} GB/s, "
        f"device-to-device copy {nbytes / d2d / 1e9:.1f} GB/s",
    )

    digest = StateDigest(4)
    host_copy = [t.detach().cpu() for t in state]
    same = all(digest.of(state, p) == StateDigest(4).of(host_copy, p) for p in range(4))
    check("4 digest of spanning state = digest of its host copy", same, "4 parts compared")

    train_step(model, optimizer, device)  # the live state moves on: the restore must bring step 1 back
    synchronize(device)
    on_cuda = device.type == "cuda"
    steady = torch.cuda.max_memory_allocated() if on_cuda else 0
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    own = copies.own_copy(1)
    layout = BucketLayout(state, bucket_bytes=64 << 20)
    start = time.perf_counter()
    largest = max(layout.bucket_nbytes(i) for i in range(layout.num_buckets))
    buf = torch.zeros(largest, dtype=torch.uint8, device=device)  # zeros: the padding is summed too
    on_host = torch.zeros(largest, dtype=torch.uint8)
    sums_agree = True
    for i in range(layout.num_buckets):
        n = layout.bucket_nbytes(i)
        layout.pack(i, own.buffer.views, buf[:n])  # host copy -> device bucket
        layout.pack(i, own.buffer.views, on_host[:n])
        sums_agree &= torch.equal(checksum(buf[:n]).cpu(), checksum(on_host[:n]))  # device vs host sums
        layout.unpack(i, buf[:n], state)  # device bucket -> live tensors on both devices
    synchronize(device)
    restore_s = time.perf_counter() - start
    restored = TensorSums(state).fingerprint()
    peak = torch.cuda.max_memory_allocated() if on_cuda else 0
    RESULTS.update(restore_s=restore_s, steady_peak_bytes=steady, restore_peak_bytes=peak)
    check(
        "3 restore from the host copy through buckets",
        restored == recorded.tensors and sums_agree,
        f"fingerprint {'matches' if restored == recorded.tensors else 'DIFFERS'}, "
        f"{layout.num_buckets} buckets (device checksums {'=' if sums_agree else '!='} host ones), "
        f"{restore_s:.3f} s; device memory peak {peak / 2**20:.0f} MiB in the restore against "
        f"{steady / 2**20:.0f} MiB in a step",
    )


def check_device_wait() -> None:
    from ckless_lightning.recovery.where import cuda_busy

    busy = cuda_busy(torch.cuda.current_device())
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU cycles, queued
    during = busy()
    start = time.perf_counter()
    torch.accelerator.synchronize(torch.device("cuda", torch.cuda.current_device()))
    waited = time.perf_counter() - start
    after = busy()
    check(
        "5 device wait and cuda_busy",
        during and not after and waited > 0.05,
        f"busy {during} -> {after}, waited {waited:.2f} s",
    )


def check_nccl_abort_and_reform() -> None:
    import torch.distributed as dist

    from ckless_lightning.recovery.sever import fail_fast

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    times = []
    ok = True
    for generation in range(2):
        start = time.perf_counter()
        prefixed = dist.PrefixStore(f"gen{generation}", store)
        dist.init_process_group(
            "nccl", store=prefixed, rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        ok &= bool((x == 1).all())
        times.append(time.perf_counter() - start)
        if generation == 0:
            fail_fast(keep_ports={store.port})
            ok &= not dist.is_initialized()
        else:
            dist.destroy_process_group()
    check(
        "6 NCCL abort and re-form in process",
        ok,
        f"formed in {times[0]:.2f} s, re-formed in {times[1]:.2f} s",
    )


_FORKED_CHILD = """
import os, sys, torch
import lightning.pytorch
from ckless_lightning.training.rank_process import import_rank_path
import_rank_path()  # what the fork server imports before it forks ranks (forkserver.py)
assert not torch.cuda.is_initialized(), "CUDA initialized before the fork"
pid = os.fork()
if pid == 0:
    x = torch.ones(1 << 20, device="cuda").sum().item()
    os._exit(0 if x == 1 << 20 else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""

_FAULT_CHILD = """
import torch
from ckless_lightning.runtime.contract import is_device_fault, is_peer_failure
x = torch.zeros(4, device="cuda")
try:
    x[torch.tensor([10], device="cuda")] = 1.0
    torch.cuda.synchronize()
except Exception as err:
    print(type(err).__name__, is_device_fault(err), is_peer_failure(err))
"""


def check_children() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    forked = subprocess.run(
        [sys.executable, "-c", _FORKED_CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    check(
        "7 a forked child uses CUDA",
        forked.returncode == 0,
        f"exit {forked.returncode} {forked.stderr.strip()[-200:]}",
    )
    fault = subprocess.run(
        [sys.executable, "-c", _FAULT_CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    words = fault.stdout.split()
    check(
        "8 a device-side fault is the rank's own",
        len(words) == 3 and words[1:] == ["True", "False"],
        f"{fault.stdout.strip() or fault.stderr.strip()[-200:]}",
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mb", type=int, default=256, help="state size of the model for checks 1-4 (MB, fp32)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (run the CPU tests instead:")
        print("  pytest -k 'device or cuda or accelerator or nccl')")
        return 0
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')} torch {torch.__version__}, {torch.cuda.get_device_name()}",
        flush=True,
    )
    steps: list[tuple[str, Callable[[], None]]] = [
        (
            "1-4 record, restore, digest",
            lambda: check_record_restore_digest(args.mb, torch.device("cuda", 0)),
        ),
        ("5 device wait", check_device_wait),
        ("6 NCCL abort and re-form", check_nccl_abort_and_reform),
        ("7-8 children", check_children),
    ]
    for name, step in steps:
        try:
            step()
        except Exception as err:  # one check's crash is that check's failure; the others still run
            check(name, False, f"{type(err).__name__}: {err}")
    print(f"{len(RESULTS) - len(FAILED)} ok, {len(FAILED)} failed")
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=1, default=str))
    return len(FAILED)


if __name__ == "__main__":
    sys.exit(main())
