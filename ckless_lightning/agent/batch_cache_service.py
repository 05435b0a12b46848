"""Tier 2 in the agent: the node's batch cache directory and its reader process.

The cache belongs to the job and the agent, not to a rank: it is created before
the first rank starts, outlives every rank process, and is removed when the
agent ends (normal end, fault budget, Ctrl-C, SIGTERM). The reader
(``python -m ckless_lightning.data.cache_reader``) dies with the agent
(PR_SET_PDEATHSIG) and is restarted if it dies on its own, is stopped, or makes no
progress: a step some local rank waits for (its ``want`` file) still unbuilt
``data.reader_timeout_s`` after the agent first saw it missing, counted from when
the reader said it is ready (its imports and the dataset's opening are not
progress it owes: under load they alone took longer than a short bound); a
reader not ready :data:`READER_START_S` after its start is restarted too. Ranks
wait for it.
With the node's fork server (``agent.fork_server``) the reader is forked from it, its imports
already paid (a cold reader spends ~3-5 s importing torch while the first step waits for it): the
first one once the server is ready (the ranks' start waits for that), a restarted one when the
server is ready then; cold whenever there is no ready server.
Cache directories are ``<data.mmap_cache_base>/ckless-<agent pid>-<random>``,
owner-only: two jobs on one node never share one, and a directory whose agent
pid is gone (an agent killed with SIGKILL) is removed by the next agent.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ckless_lightning.agent.fork_server import ForkedProcess, ForkServer
from ckless_lightning.agent.process_state import (
    is_stopped,
    read_ready,
    reap,
    signal_session,
    start_with_ready_pipe,
)
from ckless_lightning.data.batch_cache import create_cache_dir, remove_cache_dir, unbuilt_wanted_steps
from ckless_lightning.record.events import EventLog
from ckless_lightning.runtime.config import JobConfig
from ckless_lightning.runtime.contract import launcher_env
from ckless_lightning.runtime.faults import claim_fault

__all__ = ["READER_START_S", "BatchCacheService", "orphan_cache_dirs"]

READER_START_S = 120.0  # a reader not ready (imported, dataset open) this long after its start is restarted

_JOB_DIR = re.compile(r"^ckless-(\d+)-[0-9a-f]+$")


def orphan_cache_dirs(base: Path) -> list[Path]:
    """Cache dirs in ``base`` of jobs whose agent is gone: named as ours (``ckless-<pid>-<hex>``),
    real directories (a symlink is never followed), owned by this user, their agent pid dead."""
    found = []
    for entry in base.iterdir():
        match = _JOB_DIR.match(entry.name)
        if match is None:
            continue
        info = entry.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not _pid_alive(int(match[1])):
            found.append(entry)
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _restart_reason(stopped: bool, wedged: tuple[int, float] | None) -> str:
    """``reader_restarted``'s reason: stopped, exited, no_start (never ready) or no_progress."""
    if stopped:
        return "stopped"
    if wedged is None:
        return "exited"
    return "no_start" if wedged[0] < 0 else "no_progress"


class BatchCacheService:
    """Owns this node's batch cache when ``data.mmap_cache`` is on; otherwise does nothing."""

    def __init__(
        self,
        job: JobConfig,
        prepared_path: Path | None,
        local_ranks: list[int],
        events: EventLog,
        start_step: int,
        fork_server: ForkServer | None = None,
    ) -> None:
        self.enabled = job.data.mmap_cache
        assert prepared_path is not None or not self.enabled, "the batch cache reads a prepared dataset"
        self.job = job
        self.base = Path(job.data.mmap_cache_base)
        self.prepared_path = prepared_path
        self.local_ranks = local_ranks
        self.events = events
        self.start_step = start_step * job.accumulate_grad_batches
        self.job_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.root: Path | None = None
        self.reader: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.fork_server = fork_server
        self._pending_since: float | None = None  # monotonic time the first reader was due
        self.max_steps = job.trainer.max_steps * job.accumulate_grad_batches
        self._owed_since: float | None = None  # monotonic time the reader first owed a wanted step
        self._ready_fd: int | None = None  # read end of the reader's ready pipe, until it said ready
        self._started_mono = 0.0  # time.monotonic() the running reader was started
        node = job.cluster.node_rank
        self._stall = [s for s in job.fault_specs() if s.fault_type == "reader_stall" and s.node == node]

    def start(self) -> None:
        if not self.enabled:
            return
        self._remove_orphans()
        self.root = create_cache_dir(self.base, self.job_id, self.job.cluster.node_rank)
        self._pending_since = time.monotonic()
        self._start_due_reader()

    def keep_running(self) -> None:
        """Called from the agent's monitor loop: start the first reader once it is due (see
        :meth:`_start_due_reader`); restart the reader if it died, was stopped, or owes a wanted step
        for longer than ``data.reader_timeout_s`` (wedged while running).

        Ranks waiting on the cache carry on once the new reader fills it (it follows their
        ``want`` files, so it resumes where they are).
        """
        if self._pending_since is not None:
            self._start_due_reader()
        if self.reader is None:
            return
        stopped = self.reader.poll() is None and is_stopped(self.reader.pid)
        wedged = None if stopped or self.reader.poll() is not None else self._wedged_on()
        if stopped or wedged is not None:
            signal_session(self.reader.pid, signal.SIGKILL)
            reap(self.reader, "the batch-cache reader")
        if (code := self.reader.poll()) is not None:
            reason = _restart_reason(stopped, wedged)
            self.events.emit(
                "reader_restarted",
                node=self.job.cluster.node_rank,
                exit_code=code,
                stopped=stopped,
                reason=reason,
                **({"owed_step": wedged[0], "owed_s": round(wedged[1], 3)} if wedged else {}),
            )
            if wedged is not None and wedged[0] < 0:
                how = f"was not ready {wedged[1]:.1f} s after its start (killed it)"
            elif wedged is not None:
                how = f"left step {wedged[0]} unbuilt for {wedged[1]:.1f} s (killed it)"
            else:
                how = "was stopped (killed it)" if stopped else f"exited with {code}"
            print(f"[agent] batch cache reader {how}; restarting it", file=sys.stderr)
            self._start_reader()

    def _start_due_reader(self) -> None:
        """Start the first reader: forked once the fork server is ready; while a server is still
        importing (the ranks' start waits for it), later, but never after :data:`READER_START_S`
        from :meth:`start`; cold at once without a server."""
        assert self._pending_since is not None
        server = self.fork_server
        waited = time.monotonic() - self._pending_since
        if server is not None and not server.is_ready and server.is_starting and waited < READER_START_S:
            return
        self._pending_since = None
        self._start_reader()

    def _wedged_on(self) -> tuple[int, float] | None:
        """(step, seconds) if the reader has owed a step a rank waits for longer than its bound, or
        (-1, seconds) if it has not said it is ready :data:`READER_START_S` after its start."""
        assert self.root is not None
        if not self._said_ready():
            waited = time.monotonic() - self._started_mono
            return (-1, waited) if waited > READER_START_S else None
        owed = unbuilt_wanted_steps(self.root, len(self.local_ranks), self.max_steps)
        if not owed:
            self._owed_since = None
            return None
        now = time.monotonic()
        if self._owed_since is None:
            self._owed_since = now
        waited = now - self._owed_since
        return (owed[0], waited) if waited > self.job.data.reader_timeout_s else None

    def _said_ready(self) -> bool:
        """Whether the running reader said it is ready (reads its pipe without blocking)."""
        fd = self._ready_fd
        if fd is None:
            return True
        said = read_ready(fd)
        if said is None:
            return False
        self._ready_fd = None  # read_ready closed it
        return said  # False: it exited before it was ready (keep_running restarts it)

    def _close_ready_fd(self) -> None:
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None

    def close(self) -> None:
        self._close_ready_fd()
        if self.reader is not None:
            signal_session(self.reader.pid, signal.SIGKILL)
            reap(self.reader, "the batch-cache reader")
            self.reader = None
        if self.root is not None:
            remove_cache_dir(self.base, self.job_id)
            self.root = None

    def _start_reader(self) -> None:
        assert self.root is not None
        data = self.job.data
        args = [  # the reader's arguments, cold or forked
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
            "--accumulate",
            str(self.job.accumulate_grad_batches),
            "--parent-pid",
            str(os.getpid()),
            "--events",
            str(Path(self.job.run_dir) / "events.jsonl"),
        ]
        stall = self._stall.pop() if self._stall else None
        if stall is not None and claim_fault(Path(self.job.run_dir) / "faults", stall):
            # the batch of optimizer step N (1-based) is loader step (N - 1) x accumulation
            args += ["--stall-at-step", str((stall.step - 1) * self.job.accumulate_grad_batches)]
        log_path = Path(self.job.run_dir) / "rank_logs" / f"cache_reader.node{self.job.cluster.node_rank}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._close_ready_fd()
        forked = self._fork_reader(args, log_path)
        if forked is not None:
            self.reader, read_fd = forked
        else:
            command = [sys.executable, "-m", "ckless_lightning.data.cache_reader", *args]
            with log_path.open("ab") as log:
                self.reader, read_fd = start_with_ready_pipe(
                    command, env=launcher_env(), stdout=log, stderr=subprocess.STDOUT
                )
        self._ready_fd = read_fd
        self._started_mono = time.monotonic()
        self._owed_since = None  # its data.reader_timeout_s starts once it is ready
        self.events.emit(
            "reader_started",
            node=self.job.cluster.node_rank,
            pid=self.reader.pid,
            root=str(self.root),
            forked=forked is not None,
        )

    def _fork_reader(self, argv: list[str], log_path: Path) -> tuple[ForkedProcess, int] | None:
        """The reader forked from a ready fork server, and the read end of its ready pipe; None
        (start it cold) without a ready server or when the fork fails (the server is replaced)."""
        server = self.fork_server
        if server is None or not server.is_ready:
            return None
        proc = server.fork(launcher_env(), argv, reader_log=log_path, ready_wait_s=0.0)
        if proc is None:
            return None
        assert proc.stdout is not None
        read_fd = os.dup(proc.stdout.fileno())
        proc.stdout.close()
        proc.stdout = None
        return proc, read_fd

    def _remove_orphans(self) -> None:
        """Remove cache dirs of jobs whose agent is gone (killed with SIGKILL, so it could not clean up)."""
        if not self.base.is_dir():
            return
        for entry in orphan_cache_dirs(self.base):
            remove_cache_dir(self.base, entry.name.removeprefix("ckless-"))
            self.events.emit("cache_orphan_removed", path=str(entry))
