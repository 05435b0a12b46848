"""The agent↔rank contract: what the node agent tells a process it starts, and what comes back.

One leaf module, so that the agent, the rank and spare entry points, and the
in-process recovery loop agree on it without importing each other:

- the environment variables: torchrun's (Lightning's TorchElasticEnvironment
  reads them) plus ours (``CKLESS_*``). :meth:`RankSpec.env` is the one writer,
  :meth:`RankContext.from_env` the one reader;
- the exit codes of ``launch.py`` and of a rank process (:class:`ExitCode`,
  distinct values);
- :func:`is_peer_failure`: how a rank tells a lost peer from its own error;
- :func:`is_device_fault`: its own accelerator failed (the process must end);
- :func:`die_with_parent` / :func:`die_with_launcher`: no process outlives the agent.

Nothing here imports torch at module level: the agent process uses it.
"""

from __future__ import annotations

import ctypes
import enum
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckless_lightning.comm import JobStore
    from ckless_lightning.comm.beat_board import HeartbeatWriter

__all__ = [
    "ENV_BATCH_CACHE",
    "ENV_BEAT_BOARD",
    "ENV_GENERATION",
    "ENV_JOB_CONFIG",
    "ENV_JOB_SECRET",
    "ENV_JOB_SECRET_FILE",
    "ENV_LAUNCHER_PID",
    "ENV_SPAWN_TIME",
    "ENV_STORE_ADDR",
    "ENV_STORE_PORT",
    "NCCL_ERROR_HANDLING",
    "ExitCode",
    "RankContext",
    "RankSpec",
    "UsageError",
    "UsageTypeError",
    "die_with_launcher",
    "die_with_parent",
    "is_device_fault",
    "is_peer_failure",
    "launcher_env",
]

# Ours; torchrun's (RANK, LOCAL_RANK, WORLD_SIZE, ...) are written by RankSpec.env below.
ENV_GENERATION = "CKLESS_GENERATION"  # the job generation the process starts in
ENV_STORE_ADDR = "CKLESS_STORE_ADDR"  # the job store (node 0's agent): heartbeats, tier 1+ process groups
ENV_STORE_PORT = "CKLESS_STORE_PORT"
ENV_BEAT_BOARD = "CKLESS_BEAT_BOARD"  # the node agent's heartbeat board; the rank's slot: LOCAL_RANK
ENV_BATCH_CACHE = "CKLESS_BATCH_CACHE"  # tier 2: this node's batch cache directory
ENV_SPAWN_TIME = "CKLESS_SPAWN_TIME"  # unix time the agent started (or assigned) the process
ENV_LAUNCHER_PID = "CKLESS_LAUNCHER_PID"  # the agent's pid: die with it
# The job's store secret (ckless_lightning.comm.secret): the value, or a 0600 file holding it.
ENV_JOB_SECRET = "CKLESS_JOB_SECRET"
ENV_JOB_SECRET_FILE = "CKLESS_JOB_SECRET_FILE"
# A script's rank (python -m ckless_lightning.run): the job's resolved config, read by ckless_lightning.fit.
ENV_JOB_CONFIG = "CKLESS_JOB_CONFIG"
# Under torchrun, its restart count numbers restarts like our generations.
_TORCHRUN_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


class ExitCode(enum.IntEnum):
    """Exit codes of ``launch.py`` (the agent) and of rank processes; each value means one thing."""

    OK = 0
    ERROR = 1  # an unexpected error (a traceback says which)
    CONFIG = 2  # launch.py: bad config or data; the message names the key or the file
    DOES_NOT_FIT = 3  # launch.py: the recipe does not fit this machine (the message has the memory plan)
    PEER_FAILED = 4  # a rank: its collective failed because a peer went away (blame the peer)
    SUSPECT_STATE = 5  # a rank: its state disagreed with its replicas twice (suspect hardware): replace it
    LEFT_BEHIND = 6  # a rank: still blocked on peers in a generation the job left, after its cut: replace it
    DEVICE_FAULT = 7  # a rank: its own accelerator failed (a CUDA error poisons the process): replace it
    FAULT_BUDGET = 75  # launch.py: EX_TEMPFAIL, fault budget spent; the scheduler may requeue the job


class UsageError(ValueError):
    """A mistake in how the job uses the product, found in a rank (a script's ``fit`` arguments, a
    module whose parameters are not sharded, a loader without a position): the same in every
    generation, so it is not a fault to recover. The rank exits :attr:`ExitCode.CONFIG` and the
    agents give the job up with that code; the message names what to change."""


class UsageTypeError(UsageError, TypeError):
    """A :class:`UsageError` about the type of something given (also a TypeError, as such errors are)."""


@dataclass(frozen=True)
class RankSpec:
    """What the agent tells a rank process: its place in the job and where the job's stores are."""

    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int  # tier 0: rank 0's rendezvous port; tier 1+: unused by the process group
    generation: int
    store_addr: str
    store_port: int
    store_secret: str = field(repr=False, default="")  # the job store's secret
    batch_cache: str | None = None  # tier 2: the node's batch cache directory
    beat_board: str | None = None  # the node's heartbeat board (None: beat to the store)

    def env(self, spawn_time: float) -> dict[str, str]:
        """The process's variables: torchrun's plus ours. The one writer of the contract."""
        return {
            "RANK": str(self.global_rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            ENV_GENERATION: str(self.generation),
            ENV_STORE_ADDR: self.store_addr,
            ENV_STORE_PORT: str(self.store_port),
            ENV_JOB_SECRET: self.store_secret,
            ENV_SPAWN_TIME: f"{spawn_time:.6f}",
            **({ENV_BATCH_CACHE: self.batch_cache} if self.batch_cache else {}),
            **({ENV_BEAT_BOARD: self.beat_board} if self.beat_board else {}),
        }


# NCCL: on a communicator error or timeout, torch's watchdog only aborts the communicator (2,
# "CleanUpOnly"); the blocked call raises in the rank, which recovers in-process (tiers 3-4) or
# exits for the agent (tiers 0-2). torch's default (3) tears the process down, survivors included.
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def launcher_env() -> dict[str, str]:
    """The environment of every process the agent starts: this one's, unbuffered, with the agent's pid,
    and :data:`NCCL_ERROR_HANDLING` unless the user set those variables."""
    return {**NCCL_ERROR_HANDLING, **os.environ, "PYTHONUNBUFFERED": "1", ENV_LAUNCHER_PID: str(os.getpid())}


@dataclass(frozen=True)
class RankContext:
    """What a rank knows of the agent, beyond torchrun's variables. The one reader of the contract."""

    rank: int
    generation: int
    spawn_time: float
    world_size: int = 1
    store_addr: str | None = None  # the agent's job store (heartbeats; tier 1+ process groups)
    store_port: int | None = None
    store_secret: str = field(repr=False, default="")  # the job store's (CKLESS_JOB_SECRET)
    agent_pid: int | None = None
    batch_cache: str | None = None  # tier 2: this node's batch cache directory
    local_rank: int = 0
    beat_board: str | None = None  # the node agent's heartbeat board (None: beat to the store)

    @property
    def has_store(self) -> bool:
        return self.store_addr is not None and self.store_port is not None

    def beats(self, store: JobStore) -> HeartbeatWriter:
        """Where this rank's heartbeats go: its slot of the node agent's board (``comm/beat_board.py``),
        or ``store`` (a :class:`~ckless_lightning.comm.JobStore`) when the agent gave none
        (``agent.local_beats=false``). Either has ``set_rank_heartbeat(rank, beat)``.

        Raises :class:`UsageError` when the board cannot be opened, with the setting that avoids it.
        """
        if self.beat_board is None:
            return store
        from ckless_lightning.comm.beat_board import BeatBoard, BoardBeats

        try:
            board = BeatBoard.open(self.beat_board)
        except OSError as err:
            raise UsageError(
                f"rank {self.rank} cannot open its node agent's heartbeat board {self.beat_board} ({err}); "
                "set agent.local_beats=false to beat through the job store instead"
            ) from err
        return BoardBeats(board, rank=self.rank, slot=self.local_rank)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankContext:
        """Read the variables (``os.environ`` by default); absent ones mean "not started by an agent"."""
        env = os.environ if env is None else env
        generation = env.get(ENV_GENERATION, env.get(_TORCHRUN_RESTART_COUNT, "0"))
        store_port = env.get(ENV_STORE_PORT)
        agent_pid = env.get(ENV_LAUNCHER_PID)
        return cls(
            rank=int(env.get("RANK", "0")),
            generation=int(generation),
            spawn_time=float(env.get(ENV_SPAWN_TIME, time.time())),
            world_size=int(env.get("WORLD_SIZE", "1")),
            store_addr=env.get(ENV_STORE_ADDR),
            store_port=int(store_port) if store_port else None,
            store_secret=env.get(ENV_JOB_SECRET, ""),
            agent_pid=int(agent_pid) if agent_pid else None,
            batch_cache=env.get(ENV_BATCH_CACHE),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            beat_board=env.get(ENV_BEAT_BOARD),
        )


# "Connection refused": a peer gone before gloo connected to it, or this rank's own generation watch
# resetting a connection gloo would not let go of (``recovery/sever.py``'s ``unstick``).
_PEER_FAILURE_MESSAGES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
)
# What CUDA and NCCL say when this process's own device failed (the error is sticky: the context is
# unusable). Not out-of-memory, which leaves the context usable.
_DEVICE_FAULT_MESSAGES = (
    "CUDA error",
    "unhandled cuda error",
    "illegal memory access",
    "ECC error",
    "device-side assert",
    "CUBLAS_STATUS_EXECUTION_FAILED",
)
_CAUSE_DEPTH = 8  # how far along __cause__ / __context__ a device error is looked for


def is_device_fault(err: BaseException) -> bool:
    """This rank's own accelerator failed (``torch.AcceleratorError``, or CUDA's or NCCL's words for
    it, also as the cause of another error): its CUDA context is poisoned, so the process must
    end (:class:`ExitCode` ``DEVICE_FAULT``), never train on."""
    import torch

    seen: BaseException | None = err
    for _ in range(_CAUSE_DEPTH):
        if seen is None:
            return False
        if isinstance(seen, torch.AcceleratorError):
            return True
        if isinstance(seen, RuntimeError) and not isinstance(seen, torch.OutOfMemoryError):
            if any(m in str(seen) for m in _DEVICE_FAULT_MESSAGES):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def is_peer_failure(err: BaseException) -> bool:
    """A communication error caused by another rank disappearing, not by this rank's own code (nor
    by its own device: NCCL reports this rank's CUDA error as a backend error too)."""
    import torch.distributed as dist

    if is_device_fault(err):
        return False
    if isinstance(err, (dist.DistNetworkError, dist.DistBackendError)):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _PEER_FAILURE_MESSAGES)


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Get SIGKILL when ``parent_pid`` (our parent) dies; exit now if it is already gone.

    Called first thing in processes the agent starts (ranks, spares, the batch
    cache reader). Linux PR_SET_PDEATHSIG; a no-op elsewhere.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        sys.exit(f"the parent process {parent_pid} exited before this process started")


def die_with_launcher(env: Mapping[str, str] | None = None) -> None:
    """When started by the agent (``CKLESS_LAUNCHER_PID``), die with it, so no rank outlives its job."""
    launcher = (os.environ if env is None else env).get(ENV_LAUNCHER_PID)
    if launcher is not None:
        die_with_parent(int(launcher))
