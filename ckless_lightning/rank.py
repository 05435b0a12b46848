"""Rank entry point: ``python -m ckless_lightning.rank --config RUN_DIR/config.yaml``.

Started by the node agent (``launch.py``), by a warm spare, or unchanged by
``torchrun``: Lightning's TorchElasticEnvironment reads RANK, LOCAL_RANK,
WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT. The config is the
resolved YAML that ``launch.py`` writes into the run directory (also with
``dry_run=true``). This module is an edge: it reads the agent's variables
(CKLESS_*) here and hands them on as a :class:`RankContext`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from ckless_lightning._process import die_with_parent

__all__ = ["EXIT_PEER_FAILED", "RankContext", "die_with_launcher", "main"]

# Exit code of a rank whose collective failed because a peer went away: the agent
# then blames the peer (killed, hung or raising) rather than this rank.
EXIT_PEER_FAILED = 3
_PEER_FAILURE_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_peer_failure(err: BaseException) -> bool:
    """A communication error caused by another rank disappearing, not by this rank's own code."""
    import torch.distributed as dist

    if isinstance(err, (dist.DistNetworkError, dist.DistBackendError)):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _PEER_FAILURE_MESSAGES)


def die_with_launcher() -> None:
    """When started by the agent (CKLESS_LAUNCHER_PID), die with it, so no rank outlives its job."""
    launcher = os.environ.get("CKLESS_LAUNCHER_PID")
    if launcher is not None:
        die_with_parent(int(launcher))


@dataclass(frozen=True)
class RankContext:
    """What the agent tells a rank beyond torchrun's variables."""

    rank: int
    generation: int
    spawn_time: float
    store_addr: str | None = None  # the agent's job store (heartbeats; tier 1 process groups)
    store_port: int | None = None
    agent_pid: int | None = None
    batch_cache: str | None = None  # tier 2: this node's batch cache directory

    @classmethod
    def from_env(cls, env: dict[str, str]) -> RankContext:
        # Under torchrun, TORCHELASTIC_RESTART_COUNT numbers its restarts like our generations.
        generation = env.get("CKLESS_GENERATION", env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        store_port = env.get("CKLESS_STORE_PORT")
        agent_pid = env.get("CKLESS_LAUNCHER_PID")
        return cls(
            rank=int(env.get("RANK", "0")),
            generation=int(generation),
            spawn_time=float(env.get("CKLESS_SPAWN_TIME", time.time())),
            store_addr=env.get("CKLESS_STORE_ADDR"),
            store_port=int(store_port) if store_port else None,
            agent_pid=int(agent_pid) if agent_pid else None,
            batch_cache=env.get("CKLESS_BATCH_CACHE"),
        )


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
    from pathlib import Path

    import psutil
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend

    from ckless_lightning.events import EventLog

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckless_lightning.rank", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved job config written by launch.py")
    args = parser.parse_args(argv)
    die_with_launcher()
    context = RankContext.from_env(dict(os.environ))

    from omegaconf import OmegaConf

    from ckless_lightning.config import job_config_from_dict
    from ckless_lightning.training import fit

    container = OmegaConf.to_container(OmegaConf.load(args.config), resolve=True)
    assert isinstance(container, dict)
    job = job_config_from_dict(container)
    try:
        fit(job, context)
        if job.tier >= 3:
            _drop_process_group()
            _report_resources(job, context)
            _exit_now(0)
    except Exception as err:
        if not is_peer_failure(err):
            raise
        print(f"rank {context.rank}: a peer went away ({type(err).__name__}: {err})", file=sys.stderr)
        return EXIT_PEER_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
