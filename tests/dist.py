"""Run a function on N gloo ranks in spawned processes, for multi-rank tests on CPU.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in
every rank with the default process group initialised, and returns the ranks'
return values in rank order. ``fn`` and ``args`` must be picklable (define
``fn`` at module level), and so must the return values. Every child is joined,
and killed if need be, before ``run_ranks`` returns or raises.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankError", "free_port", "run_ranks"]


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message carries its traceback or exit code."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    """Rank entry point: run ``fn``, write ``("ok", value)`` or ``("error", traceback)`` to a file."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        result: tuple[str, Any, float] = ("ok", fn(rank, world_size, *args), time.time())
    except BaseException:
        result = ("error", traceback.format_exc(), time.time())
    try:
        payload = pickle.dumps(result)
    except Exception:
        message = f"return value of rank {rank} is not picklable:\n{traceback.format_exc()}"
        result = ("error", message, time.time())
        payload = pickle.dumps(result)
    # Write the result before tearing down, so a teardown problem cannot hide it.
    tmp_path = os.path.join(out_dir, f"rank{rank}.tmp")
    with open(tmp_path, "wb") as f:
        f.write(payload)
    os.replace(tmp_path, os.path.join(out_dir, f"rank{rank}.pkl"))  # atomic: the parent never reads half
    if result[0] == "error":
        os._exit(1)  # peers may be blocked in a collective with us; the parent kills them
    # Tear down only once every rank is done: a rank that left first once aborted a peer still
    # finishing its last collective under load ("terminate called without an active exception").
    # A peer that never comes is the parent's timeout to handle (it kills every rank).
    dist.barrier()
    # Then end without destructors: once, under load, a rank aborted (SIGABRT) after its result was
    # written, in the teardown of a test's FSDP2 and DeviceMesh groups at interpreter exit; what a
    # rank returns is already on disk, and the parent judges by it and by the exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _read_result(out_dir: str, rank: int) -> tuple[str, Any, float] | None:
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results by rank.

    Raises ``RankError`` with the first failing rank's traceback (the other
    ranks, likely stuck in a collective, are killed), or on ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size={world_size} must be >= 1.")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="run_ranks_") as out_dir:
        try:
            for rank in range(world_size):
                proc = ctx.Process(
                    target=_child, args=(fn, rank, world_size, port, out_dir, args), daemon=True
                )
                proc.start()
                procs.append(proc)
            deadline = time.monotonic() + timeout
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    _raise_first_failure(out_dir, procs)
                if time.monotonic() > deadline:
                    raise RankError(f"run_ranks: {world_size} ranks did not finish within {timeout} s.")
                time.sleep(0.05)
            results = [_read_result(out_dir, rank) for rank in range(world_size)]
            if any(p.exitcode != 0 for p in procs) or any(r is None or r[0] != "ok" for r in results):
                _raise_first_failure(out_dir, procs)
            return [r[1] for r in results]  # type: ignore[index]
        finally:
            _stop_all(procs)


def _raise_first_failure(out_dir: str, procs: list[Any], grace: float = 1.0) -> None:
    """Raise for the rank that failed first: its peers then fail too, with secondary errors."""
    time.sleep(grace)  # let the peers' secondary errors land so that timestamps decide
    errors = []
    for rank in range(len(procs)):
        result = _read_result(out_dir, rank)
        if result is not None and result[0] == "error":
            errors.append((result[2], rank, result[1]))
    if errors:
        _, rank, tb = min(errors)
        others = sorted(r for _, r, _ in errors if r != rank)
        also = f" (ranks {others} failed after it)" if others else ""
        raise RankError(f"rank {rank} raised{also}:\n{tb}")
    dead = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode not in (None, 0)}
    raise RankError(f"ranks exited without a result (rank: exit code): {dead}")


def _stop_all(procs: list[Any]) -> None:
    """Terminate, then kill, then join every process we started."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
