"""The life of a rank process, from its resolved config to its exit code (entry points call this).

Both the rank entry point (``python -m ckless_lightning.rank``) and a warm spare
that was handed a rank (``python -m ckless_lightning.spare``) end up in
:func:`run_rank_process`, so neither entry point imports the other.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ckless_lightning.runtime.config import job_config_from_dict
from ckless_lightning.runtime.contract import ExitCode, RankContext, is_peer_failure
from ckless_lightning.training.job import train_rank

__all__ = ["run_rank_process"]


def run_rank_process(config_path: str | Path, context: RankContext) -> int:
    """Train this rank of the job in ``config_path`` (the YAML launch.py resolved); returns the exit code.

    Tiers 3-4 end the process themselves (``os._exit``) after the final checkpoint. A collective
    failing because a peer went away is :attr:`ExitCode.PEER_FAILED` (the agent blames the peer);
    any other error propagates.
    """
    container = OmegaConf.to_container(OmegaConf.load(config_path), resolve=True)
    assert isinstance(container, dict)
    job = job_config_from_dict(container)
    try:
        train_rank(job, context)
        if job.tier >= 3:
            _drop_process_group()
            _report_resources(job, context)
            _exit_now(ExitCode.OK)
    except Exception as err:
        if not is_peer_failure(err):
            raise
        print(f"rank {context.rank}: a peer went away ({type(err).__name__}: {err})", file=sys.stderr)
        return ExitCode.PEER_FAILED
    return ExitCode.OK


def _drop_process_group() -> None:
    """Tiers 3-4: destroy the last generation's group before exit (this process may have held several;
    leaving one to interpreter shutdown was seen to end in std::terminate)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _exit_now(code: int) -> None:
    """End the process without interpreter teardown (tiers 3-4, after everything is saved).

    A process that went through several generations was seen, once in many runs,
    to hang in interpreter shutdown after training had finished and every
    process group was destroyed (C++ destructors of torch.distributed objects of
    earlier generations). Nothing is left to run: flush and leave.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _count_objects(types: tuple[type, ...]) -> int:
    """Live Python objects of ``types`` (isinstance on every object wakes torch's deprecation shims)."""
    import gc
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sum(isinstance(o, types) for o in gc.get_objects())


def _report_resources(job: Any, context: RankContext) -> None:
    """``rank_end`` event: this process's threads, TCP sockets and live process-group objects after
    training (leak checks)."""
    import gc

    import psutil
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend

    from ckless_lightning.record.events import EventLog

    gc.collect()
    sockets = psutil.Process().net_connections(kind="tcp")
    EventLog(Path(job.run_dir) / "events.jsonl", source=f"rank{context.rank}").emit(
        "rank_end",
        rank=context.rank,
        pid=os.getpid(),
        threads=len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
        tcp_sockets=len(sockets),
        tcp_states=sorted(c.status for c in sockets),
        process_groups=_count_objects((dist.ProcessGroup, Backend)),
    )
