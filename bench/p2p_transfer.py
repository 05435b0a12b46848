"""Peer-to-peer state transfer throughput against this machine's memcpy, for the same bytes.

    python bench/p2p_transfer.py [--bytes N] [--tensors 64] [--bucket-mb 64] [--repeats 3]

Starts 2 gloo ranks on 127.0.0.1 (a TCP ``init_method`` on a free port) and
times ``ckless_lightning.replication.transfer_tensors([Transfer(0, 1)], ...)``,
the copy tier 4 uses to restore a replaced rank from a peer, for ``--tensors``
float32 tensors totalling ``--bytes`` (default 64 MiB): best of ``--repeats``,
after one untimed warm-up transfer. The time includes what the transfer does
besides moving bytes (packing into buckets, checksums on both sides, unpacking,
the final agreement all-reduce). The baseline is ``torch.empty_like(x).copy_(x)``
of the same bytes in one process (best of ``--repeats``). Throughput is bytes
moved per second (GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import socket
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

DEFAULT_BYTES = 64 * 1024 * 1024
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024

__all__ = ["P2PResult", "measure", "measure_memcpy", "measure_p2p"]


@dataclass
class P2PResult:
    nbytes: int
    tensors: int
    bucket_bytes: int
    p2p_s: float  # best transfer time (rank 0 and 1 both inside transfer_tensors)
    memcpy_s: float  # best single-process copy of the same bytes

    @property
    def p2p_gbps(self) -> float:
        return self.nbytes / self.p2p_s / 1e9

    @property
    def memcpy_gbps(self) -> float:
        return self.nbytes / self.memcpy_s / 1e9

    @property
    def ratio(self) -> float:
        """P2P throughput as a fraction of memcpy's."""
        return self.p2p_gbps / self.memcpy_gbps

    def format(self) -> str:
        mib = self.nbytes / (1 << 20)
        return "\n".join(
            [
                f"{mib:.2f} MiB in {self.tensors} float32 tensors, bucket {self.bucket_bytes >> 20} MiB:",
                f"  p2p transfer_tensors (2 gloo ranks)  {1e3 * self.p2p_s:9.2f} ms  "
                f"{self.p2p_gbps:7.2f} GB/s",
                f"  memcpy empty_like().copy_()          {1e3 * self.memcpy_s:9.2f} ms  "
                f"{self.memcpy_gbps:7.2f} GB/s",
                f"  p2p / memcpy throughput              {self.ratio:9.3f}  "
                f"(memcpy {1 / self.ratio:.1f}x faster)",
            ]
        )


def _sizes(nbytes: int, count: int) -> list[int]:
    """Element counts of ``count`` float32 tensors totalling ``nbytes`` (rounded down to 4 bytes)."""
    elements = nbytes // 4
    count = max(1, min(count, elements))
    base, extra = divmod(elements, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int, port: int, sizes: list[int], bucket_bytes: int, repeats: int, results: mp.Queue
) -> None:
    import torch.distributed as dist

    from ckless_lightning.replication import Transfer, transfer_tensors

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 0:
            tensors = [torch.arange(n, dtype=torch.float32) + i for i, n in enumerate(sizes)]
        else:
            tensors = [torch.zeros(n, dtype=torch.float32) for n in sizes]
        pairs = [Transfer(0, 1)]
        transfer_tensors(pairs, [torch.ones(8)], bucket_bytes=bucket_bytes)  # warm-up: first messages
        best = float("inf")
        for _ in range(repeats):
            if rank == 1:
                for t in tensors:
                    t.zero_()
            dist.barrier()
            start = time.perf_counter()
            ok = transfer_tensors(pairs, tensors, bucket_bytes=bucket_bytes)
            elapsed = time.perf_counter() - start
            if not ok[1]:
                raise RuntimeError("transfer_tensors: the receiver's checksum failed")
            best = min(best, elapsed)
        if rank == 1:
            for i, (t, n) in enumerate(zip(tensors, sizes, strict=True)):
                if not torch.equal(t, torch.arange(n, dtype=torch.float32) + i):
                    raise RuntimeError(f"tensor {i} arrived different from what was sent")
        # Both ranks leave the transfer at about the same time (it ends with an all-reduce);
        # report the slower one.
        results.put((rank, best))
    finally:
        dist.destroy_process_group()


def measure_p2p(
    nbytes: int = DEFAULT_BYTES,
    *,
    tensors: int = 64,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    repeats: int = 3,
    timeout_s: float = 300.0,
) -> float:
    """Best time (s) of ``transfer_tensors([Transfer(0, 1)])`` for ``nbytes`` between 2 gloo ranks."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    sizes = _sizes(nbytes, tensors)
    procs = [
        ctx.Process(target=_rank_main, args=(rank, port, sizes, bucket_bytes, repeats, results))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    times: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(times) < 2:
            try:
                rank, best = results.get(timeout=1.0)
                times[rank] = best
            except Exception:  # queue.Empty: check that both ranks still live
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    codes = [p.exitcode for p in procs]
                    raise RuntimeError(f"p2p ranks failed or timed out (exit codes {codes})") from None
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return max(times.values())


def measure_memcpy(nbytes: int = DEFAULT_BYTES, *, repeats: int = 3) -> float:
    """Best time (s) of ``torch.empty_like(x).copy_(x)`` for a float32 ``x`` of ``nbytes``."""
    x = torch.arange(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        y = torch.empty_like(x).copy_(x)
        best = min(best, time.perf_counter() - start)
        del y
    return best


def measure(
    nbytes: int = DEFAULT_BYTES,
    *,
    tensors: int = 64,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    repeats: int = 3,
) -> P2PResult:
    """P2P transfer and memcpy of the same ``nbytes`` (rounded down to whole float32 values)."""
    nbytes = nbytes // 4 * 4
    p2p = measure_p2p(nbytes, tensors=tensors, bucket_bytes=bucket_bytes, repeats=repeats)
    memcpy = measure_memcpy(nbytes, repeats=repeats)
    return P2PResult(nbytes, len(_sizes(nbytes, tensors)), bucket_bytes, p2p, memcpy)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bytes", type=int, default=DEFAULT_BYTES, help="bytes to transfer (default 64 MiB)")
    parser.add_argument("--tensors", type=int, default=64, help="how many tensors they are split into")
    parser.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_BYTES >> 20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = measure(
        args.bytes, tensors=args.tensors, bucket_bytes=args.bucket_mb << 20, repeats=args.repeats
    )
    print(result.format())


if __name__ == "__main__":
    main()
