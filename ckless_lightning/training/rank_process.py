"""The life of a rank process, from its resolved config to its exit code (entry points call this).

Both the rank entry point (``python -m ckless_lightning.rank``) and a warm spare
that was handed a rank (``python -m ckless_lightning.spare``) end up in
:func:`run_rank_process`, so neither entry point imports the other.

A warm spare first calls :func:`prepare_rank`: everything of the rank path that
does not depend on the rank (the job's config parsed and validated, every module
the rank will import, the prepared dataset looked up), so that once it is handed
a rank it goes straight to joining the job's generation. The hand-over is on the
record (``rank_phase`` events ``spare_handed`` and ``spare_ready``, and
``spare_imports``: what the rank still had to import after it; see
:func:`run_rank_process`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ckless_lightning.record.events import EventLog
from ckless_lightning.recovery.device_fault import exit_on_device_fault
from ckless_lightning.runtime.config import JobConfig, load_job_config
from ckless_lightning.runtime.contract import (
    ExitCode,
    RankContext,
    UsageError,
    is_device_fault,
    is_peer_failure,
)
from ckless_lightning.training.job import train_rank
from ckless_lightning.training.script_rank import run_script

__all__ = [
    "Handover",
    "PreparedRank",
    "announce_prepared",
    "await_rank",
    "import_rank_path",
    "load_job",
    "prepare_rank",
    "run_rank_process",
    "warm_data",
]

# What the rank path imports after ``training.job`` is imported: lazily, on the first Trainer, fit,
# process group, FSDP2 sharding, checkpoint save or load, memory restore. Found by comparing
# ``sys.modules`` of ranks at the end of training (tiers 0-4, cold and from spares, rank 0 and
# others) with a prepared spare's; tests/test_spares.py fails when the list falls behind (a
# module a spare-born rank imports after its hand-over). A name that does not import (an optional
# package, another torch version) is skipped.
RANK_PATH_MODULES: tuple[str, ...] = (
    # Our packages' lazily loaded names (runtime.lazy: launch.py validates without torch); before
    # that, the packages imported these eagerly, so a spare had them before its hand-over.
    "ckless_lightning.data.corpus",
    "ckless_lightning.data.loader",
    "ckless_lightning.data.packing",
    "ckless_lightning.data.tokenizer",
    "ckless_lightning.models.init",
    "ckless_lightning.models.layers",
    "ckless_lightning.models.llama3",
    "ckless_lightning.models.mesh",
    "ckless_lightning.models.mixtral",
    "ckless_lightning.models.parallelize",
    "ckless_lightning.models.shard_dims",
    "ckless_lightning.replication.fingerprint",
    "ckless_lightning.replication.snapshots",
    "ckless_lightning.replication.transfer",
    "datasets",  # ckless_lightning.data.packing imports it where used (load_prepared: tiers 0-1)
    "encodings.latin_1",  # torch.load of a loop state holding bytes (pickle protocol 2 spells them so)
    "faulthandler",
    "multiprocessing.synchronize",
    "torchdata.stateful_dataloader",  # a user's train loader (data.positioned_loader), if installed
    "torch.distributed._tensor",
    "torch.distributed.checkpoint",  # and its imports: torch.distributed.elastic, ...
    "torch.distributed.checkpoint._fsspec_filesystem",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    "torch.distributed.tensor.experimental",
    "torch.nn.attention.flex_attention",
    "torch.numa.binding",
    "torch.profiler._cupti_monitor",
    "torch.utils._sympy.reference",
    "torch.utils.serialization.config",
)


def load_job(config_path: str | Path) -> JobConfig:
    """The resolved YAML that launch.py wrote, parsed and validated."""
    return load_job_config(config_path)


@dataclass(frozen=True)
class PreparedRank:
    """What a warm spare built before it was handed a rank (:func:`prepare_rank`)."""

    config_path: Path
    job: JobConfig
    prepare_s: float  # seconds :func:`prepare_rank` took
    modules: int  # len(sys.modules) once prepared

    def matches(self, config_path: str | Path) -> bool:
        return Path(config_path).resolve() == self.config_path


def import_rank_path() -> None:
    """Import what the rank path imports lazily (:data:`RANK_PATH_MODULES`); needs no config, so the
    fork server does it before it is told the job's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation shims of modules the rank never uses directly
        for name in RANK_PATH_MODULES:
            try:
                importlib.import_module(name)
            except ImportError:
                continue


def prepare_rank(config_path: str | Path, *, warm_data: bool = True) -> PreparedRank:
    """Everything of the rank path that does not depend on the rank, for a warm spare to do first.

    Parses and validates the job's config (which imports the model family), imports the modules
    the rank path imports lazily (:data:`RANK_PATH_MODULES`: distributed checkpointing and what it
    pulls in, DTensor's experimental parts, ...; Lightning's Trainer and loop internals come with
    ``training.job``), and with ``warm_data`` looks the prepared dataset up, which warms its files
    and directory entries in the page cache (every rank repeats the look-up in its data module's
    ``setup``; the fork server skips it: it prepares while the launcher still prepares the data).
    Nothing here touches the job's store, ports or run directory.
    """
    started = time.perf_counter()
    path = Path(config_path).resolve()
    job = load_job(path)
    import_rank_path()
    if warm_data:
        warm_data(job)
    return PreparedRank(path, job, time.perf_counter() - started, len(sys.modules))


def warm_data(job: JobConfig) -> None:
    """Look the prepared dataset up (a cache hit: launch.py prepared it) and, when the ranks read it
    directly (no batch cache), memory-map it once: rank-independent, and it warms the page cache.
    A user's module and DataModule (``module`` / ``datamodule``) are imported instead."""
    from ckless_lightning.data import load_prepared, prepare_dataset

    user = [c.target for c in (job.module, job.datamodule) if not c.builtin]
    if user:
        from ckless_lightning.runtime.component_config import import_object

        for target in user:
            import_object(target)  # launch.py imported it already: an error here is the rank's to report
    if not job.datamodule.builtin or job.script is not None:
        return  # the user's own data
    try:
        prepared = prepare_dataset(job.data)
        if not job.data.mmap_cache:
            load_prepared(prepared.path)
    except Exception as err:  # only a warm-up: the rank reports the problem when it gets there
        print(f"spare: could not look up the prepared dataset ({err})", file=sys.stderr)


@dataclass(frozen=True)
class Handover:
    """The moment a warm spare read its rank assignment, and the modules it had imported by then."""

    t: float
    modules: frozenset[str]

    @classmethod
    def now(cls) -> Handover:
        return cls(time.time(), frozenset(sys.modules))

    def imported_since(self) -> list[str]:
        """Modules imported after the hand-over (a fully prepared spare: none)."""
        return sorted(set(sys.modules) - self.modules)


def run_rank_process(
    config_path: str | Path,
    context: RankContext,
    *,
    prepared: PreparedRank | None = None,
    handover: Handover | None = None,
) -> int:
    """Train this rank of the job in ``config_path`` (the YAML launch.py resolved); returns the exit code.

    ``prepared``: what a warm spare prepared for this config (used if it is the same file);
    ``handover``: when a warm spare was handed this rank. A spare-born rank emits ``rank_phase``
    ``spare_handed`` (t = when the spare read its assignment) and ``spare_ready`` (about to train
    the rank; ``handover_s``: seconds since the agent handed it the rank, the ``process_start``
    time; ``modules``: modules imported at the hand-over), and after training ``spare_imports``
    (``count`` and the first ``names`` of modules it imported after the hand-over).

    Tiers 3-4 end the process themselves (``os._exit``) after the final checkpoint. A collective
    failing because a peer went away is :attr:`ExitCode.PEER_FAILED` (the agent blames the peer);
    any other error propagates.
    """
    if prepared is not None and prepared.matches(config_path):
        job = prepared.job
    else:
        job = load_job(config_path)
    if handover is not None:
        _report_handover(job, context, handover)
    try:
        if job.script is not None:
            run_script(job, config_path)  # the script calls ckless_lightning.fit (train_rank)
        else:
            train_rank(job, context)
        if handover is not None:
            _report_late_imports(job, context, handover)
        if job.tier >= 3:
            _drop_process_group()
            _report_resources(job, context)
            _exit_now(ExitCode.OK)
    except UsageError as err:  # the same in every generation: the agents give the job up
        print(f"rank {context.rank}: config error: {err}", file=sys.stderr)
        return ExitCode.CONFIG
    except Exception as err:
        if is_device_fault(err):  # tiers 0-2 (tiers 3-4 end in the recovery loop)
            exit_on_device_fault(err, rank=context.rank, keep_ports=set())
        if not is_peer_failure(err):
            raise
        print(f"rank {context.rank}: a peer went away ({type(err).__name__}: {err})", file=sys.stderr)
        return ExitCode.PEER_FAILED
    return ExitCode.OK


def announce_prepared(prepared: PreparedRank, started: float) -> None:
    """``spare_prepared`` {pid, start_s, prepare_s, modules}: this spare is prepared and waits for a
    rank (``start_s``: seconds since ``started``, its start, imports included; ``prepare_s``: of
    which preparing; ``modules``: how many are imported)."""
    EventLog(os.path.join(prepared.job.run_dir, "events.jsonl"), source=f"spare{os.getpid()}").emit(
        "spare_prepared",
        pid=os.getpid(),
        start_s=round(time.time() - started, 6),
        prepare_s=round(prepared.prepare_s, 6),
        modules=prepared.modules,
    )


def await_rank(prepared: PreparedRank | None, stdin: IO[str]) -> int:
    """Block on ``stdin`` for the rank assignment (one JSON line), then become that rank; 0 when
    ``stdin`` closes first. The path of every warm spare, cold (``python -m ckless_lightning.spare``)
    or forked by the fork server."""
    line = stdin.readline()
    handover = Handover.now()
    if not line:
        return 0
    assignment = json.loads(line)
    os.environ.update(assignment["env"])  # the agent's variables for the rank (RankSpec.env)
    return run_rank_process(
        _assigned_config(assignment["argv"]), RankContext.from_env(), prepared=prepared, handover=handover
    )


def _assigned_config(argv: list[str]) -> str:
    """The ``--config PATH`` of a rank assignment's ``argv`` (``python -m ckless_lightning.rank``'s)."""
    parser = argparse.ArgumentParser(prog="rank assignment")
    parser.add_argument("--config", required=True)
    return parser.parse_args(argv).config


def _events(job: JobConfig, context: RankContext) -> EventLog:
    return EventLog(Path(job.run_dir) / "events.jsonl", source=f"rank{context.rank}")


def _report_handover(job: JobConfig, context: RankContext, handover: Handover) -> None:
    events = _events(job, context)
    phase = {"rank": context.rank, "gen": context.generation, "step": None}
    events.emit("rank_phase", **phase, phase="spare_handed", t=handover.t)
    now = time.time()
    events.emit(
        "rank_phase",
        **phase,
        phase="spare_ready",
        t=now,
        handover_s=round(now - context.spawn_time, 6),
        modules=len(handover.modules),
    )


# A spare_imports record lists module names up to this many characters (records stay small).
_NAMES_CHARS = 2000


def _report_late_imports(job: JobConfig, context: RankContext, handover: Handover) -> None:
    late = handover.imported_since()
    names: list[str] = []
    size = 0
    for name in late:
        size += len(name) + 4
        if size > _NAMES_CHARS:
            break
        names.append(name)
    _events(job, context).emit(
        "spare_imports", rank=context.rank, gen=context.generation, count=len(late), names=names
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


def _describe_connection(connection: Any) -> str:
    """``"local_port->remote_host:port STATE"`` of one psutil connection (what a leak check names)."""
    remote = f"{connection.raddr.ip}:{connection.raddr.port}" if connection.raddr else "-"
    return f"{connection.laddr.port}->{remote} {connection.status}"


def _report_resources(job: Any, context: RankContext) -> None:
    """``rank_end`` event: this process's threads, TCP sockets and live process-group objects after
    training (leak checks)."""
    import gc

    import psutil
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend

    gc.collect()
    sockets = psutil.Process().net_connections(kind="tcp")
    _events(job, context).emit(
        "rank_end",
        rank=context.rank,
        pid=os.getpid(),
        threads=len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
        tcp_sockets=len(sockets),
        tcp_states=sorted(c.status for c in sockets),
        tcp_peers=sorted(_describe_connection(c) for c in sockets),
        thread_names=sorted(t.name for t in threading.enumerate()),
        process_groups=_count_objects((dist.ProcessGroup, Backend)),
    )
