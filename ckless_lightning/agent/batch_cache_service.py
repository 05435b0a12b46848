"""Tier 2 in the agent: the node's batch cache directory and its reader process.

The cache belongs to the job and the agent, not to a rank: it is created before
the first rank starts, outlives every rank process, and is removed when the
agent ends (normal end, fault budget, Ctrl-C, SIGTERM). The reader
(``python -m ckless_lightning.data.cache_reader``) dies with the agent
(PR_SET_PDEATHSIG) and is restarted if it dies on its own; ranks wait for it.
Cache directories are ``<data.mmap_cache_base>/ckless-<agent pid>-<random>``,
owner-only: two jobs on one node never share one, and a directory whose agent
pid is gone (an agent killed with SIGKILL) is removed by the next agent.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from ckless_lightning.agent.processes import is_stopped, signal_session
from ckless_lightning.data.batch_cache import create_cache_dir, remove_cache_dir
from ckless_lightning.record.events import EventLog
from ckless_lightning.runtime.config import JobConfig
from ckless_lightning.runtime.contract import launcher_env

__all__ = ["BatchCacheService"]

_JOB_DIR = re.compile(r"^ckless-(\d+)-[0-9a-f]+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BatchCacheService:
    """Owns this node's batch cache when ``data.mmap_cache`` is on; otherwise does nothing."""

    def __init__(
        self, job: JobConfig, prepared_path: Path, local_ranks: list[int], events: EventLog, start_step: int
    ) -> None:
        self.enabled = job.data.mmap_cache
        self.job = job
        self.base = Path(job.data.mmap_cache_base)
        self.prepared_path = prepared_path
        self.local_ranks = local_ranks
        self.events = events
        self.start_step = start_step * job.accumulate_grad_batches
        self.job_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.root: Path | None = None
        self.reader: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if not self.enabled:
            return
        self._remove_orphans()
        self.root = create_cache_dir(self.base, self.job_id, self.job.cluster.node_rank)
        self._start_reader()

    def keep_running(self) -> None:
        """Called from the agent's monitor loop: restart the reader if it died or was stopped.

        Ranks waiting on the cache carry on once the new reader fills it (it follows their
        ``want`` files, so it resumes where they are).
        """
        if self.reader is None:
            return
        stopped = self.reader.poll() is None and is_stopped(self.reader.pid)
        if stopped:
            signal_session(self.reader.pid, signal.SIGKILL)
            self.reader.wait()
        if (code := self.reader.poll()) is not None:
            self.events.emit(
                "reader_restarted", node=self.job.cluster.node_rank, exit_code=code, stopped=stopped
            )
            how = "was stopped (killed it)" if stopped else f"exited with {code}"
            print(f"[agent] batch cache reader {how}; restarting it", file=sys.stderr)
            self._start_reader()

    def close(self) -> None:
        if self.reader is not None:
            signal_session(self.reader.pid, signal.SIGKILL)
            self.reader.wait()
            self.reader = None
        if self.root is not None:
            remove_cache_dir(self.base, self.job_id)
            self.root = None

    def _start_reader(self) -> None:
        assert self.root is not None
        data = self.job.data
        command = [
            sys.executable,
            "-m",
            "ckless_lightning.data.cache_reader",
            "--prepared",
            str(self.prepared_path),
            "--root",
            str(self.root),
            "--dp-ranks",
            ",".join(map(str, self.local_ranks)),
            "--dp-size",
            str(self.job.cluster.world_size),
            "--micro-batch-size",
            str(data.micro_batch_size),
            "--seed",
            str(data.seed),
            "--prefetch",
            str(data.prefetch),
            "--lookback",
            str(data.lookback),
            "--start-step",
            str(self.start_step),
            "--max-steps",
            str(self.job.trainer.max_steps * self.job.accumulate_grad_batches),
            "--parent-pid",
            str(os.getpid()),
        ]
        log_path = Path(self.job.run_dir) / "rank_logs" / f"cache_reader.node{self.job.cluster.node_rank}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self.reader = subprocess.Popen(
                command, env=launcher_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.events.emit(
            "reader_started", node=self.job.cluster.node_rank, pid=self.reader.pid, root=str(self.root)
        )

    def _remove_orphans(self) -> None:
        """Remove cache dirs of jobs whose agent is gone (killed with SIGKILL, so it could not clean up)."""
        if not self.base.is_dir():
            return
        for entry in self.base.iterdir():
            match = _JOB_DIR.match(entry.name)
            if (
                match
                and entry.is_dir()
                and entry.stat().st_uid == os.getuid()
                and not _pid_alive(int(match[1]))
            ):
                job_id = entry.name.removeprefix("ckless-")
                remove_cache_dir(self.base, job_id)
                self.events.emit("cache_orphan_removed", path=str(entry))
