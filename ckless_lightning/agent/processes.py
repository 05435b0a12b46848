"""Rank and spare processes of one node: start (cold or from a warm spare), stream output, stop.

Every process runs in its own session, so a stop reaches whatever it started,
and carries ``CKLESS_LAUNCHER_PID`` so that it dies with the agent
(PR_SET_PDEATHSIG, see ``ckless_lightning.runtime.contract``). Rank 0's output goes to this
console and to ``rank_logs/rank0.log``; the others' to ``rank_logs/rank<N>.log``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ckless_lightning.agent.process_state import (
    is_stopped,
    read_ready,
    reap,
    signal_session,
    start_with_ready_pipe,
)
from ckless_lightning.record.events import EventLog
from ckless_lightning.runtime.contract import RankSpec, launcher_env

if TYPE_CHECKING:
    from typing import TypeAlias

    from ckless_lightning.agent.fork_server import ForkedProcess, ForkServer

    # A warm spare: started cold (``python -m ckless_lightning.spare``) or forked by the fork server.
    Spare: TypeAlias = "subprocess.Popen[bytes] | ForkedProcess"

__all__ = ["RankProcess", "SparePool", "failure_report", "is_stopped", "reap", "signal_session"]


class RankProcess:
    """One rank's process: ``spawn`` a cold one, ``fork`` one from the fork server, or ``adopt`` a
    warm spare and assign it the rank."""

    def __init__(
        self,
        spec: RankSpec,
        proc: subprocess.Popen[bytes] | ForkedProcess,
        log_dir: Path,
        *,
        warm: bool,
        forked: bool = False,
    ) -> None:
        self.spec = spec
        self.proc = proc
        self.warm = warm
        self.forked = forked
        self.started_at = time.time()
        self.log_path = Path(log_dir) / f"rank{spec.global_rank}.log"
        self._pump = threading.Thread(target=self._copy_output, daemon=True)
        self._pump.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def spawn(cls, spec: RankSpec, command: list[str], log_dir: Path) -> RankProcess:
        env = {**launcher_env(), **spec.env(time.time())}
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        return cls(spec, proc, log_dir, warm=False)

    @classmethod
    def fork(cls, spec: RankSpec, server: ForkServer, argv: list[str], log_dir: Path) -> RankProcess | None:
        """A rank forked by ``server`` (imports already done), or None: spawn it cold instead."""
        if not server.ready():  # the wait for its imports is not the rank's: its start is the fork
            return None
        proc = server.fork({**launcher_env(), **spec.env(time.time())}, argv)
        return None if proc is None else cls(spec, proc, log_dir, warm=False, forked=True)

    @classmethod
    def adopt(cls, spec: RankSpec, spare: Spare, argv: list[str], log_dir: Path) -> RankProcess:
        assert spare.stdin is not None
        assignment = {"env": spec.env(time.time()), "argv": argv}
        try:
            spare.stdin.write((json.dumps(assignment) + "\n").encode())
            spare.stdin.close()
        except BrokenPipeError:  # it died since it was taken: its exit shows as this rank's failure
            pass
        return cls(spec, spare, log_dir, warm=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        signal_session(self.pid, signal.SIGKILL)

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; reap; also kill anything left in its session."""
        if self.proc.poll() is None and grace_s > 0:
            signal_session(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass  # it ignored SIGTERM: killed below
        if self.proc.poll() is None:
            signal_session(self.pid, signal.SIGKILL)
            reap(self.proc, f"rank {self.spec.global_rank}")
        signal_session(self.pid, signal.SIGKILL)
        self._pump.join(timeout=5)

    def failure_report(self, lines: int = 15) -> str:
        """What the agent prints of a dead rank's log: its last traceback, else its last lines that
        are not warnings or progress bars, headed by which of the two it is."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return failure_report(text, lines)

    def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        echo = self.spec.global_rank == 0
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            _copy(self.proc.stdout, log, echo)


def _copy(stream: IO[bytes], log: IO[bytes], echo: bool) -> None:
    while chunk := stream.read1(65536):  # type: ignore[attr-defined]
        log.write(chunk)
        log.flush()
        if echo:
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()


_WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: ")


def failure_report(log: str, lines: int = 15) -> str:
    """The part of a rank's log that says why it died (see :meth:`RankProcess.failure_report`).

    The last ``Traceback (most recent call last):`` to the end of the log (its last ``lines``
    lines); with none (a SIGKILL leaves none), the last ``lines`` lines once Python warnings (the
    ``file:line: XWarning:`` line and its indented source line) and progress-bar redraws (all but
    the text after a line's last carriage return) are dropped.
    """
    # split, not splitlines: splitlines also splits at the carriage returns of progress bars
    text = [line.rsplit("\r", 1)[-1] for line in log.split("\n")]
    starts = [i for i, line in enumerate(text) if line.startswith("Traceback (most recent call last)")]
    if starts:
        shown = text[starts[-1] :]
        cut = len(shown) > lines
        body = ["  ..."] * cut + shown[-lines:]
        return "Its last traceback:\n" + "\n".join(body)
    kept: list[str] = []
    skip_source = False
    for line in text:
        if _WARNING_LINE.match(line):
            skip_source = True
            continue
        if skip_source and line.startswith((" ", "\t")):
            continue
        skip_source = False
        if line.strip():
            kept.append(line)
    if not kept:
        return "Its log has no output (no traceback: a process killed by a signal leaves none)."
    return "Last lines of its log (no traceback):\n" + "\n".join(kept[-lines:])


class SparePool:
    """Warm spares: processes prepared for this job's ranks, each waiting on stdin to be handed one.

    A spare (``python -m ckless_lightning.spare --config CONFIG --ready-fd FD``) parses the job's
    config, imports the whole rank path and looks the prepared dataset up, then writes a line to
    ``FD`` (a pipe to this pool) and waits; a rank it is handed skips all of that. :meth:`take`
    hands out a ready spare first; one still preparing only if none is (it is further along
    than a new process).

    :meth:`fill` starts the pool; from then on it keeps itself at ``size``: :meth:`tend` (every
    supervision pass of the agent) drops spares that died or were stopped (a stopped one is
    killed) and starts the missing ones, those :meth:`take` handed out included. The agent lets
    spares start only while its ranks train (``tend(start=False)`` otherwise), so a new spare
    never competes for CPU with the ranks' start or with the recovery the taken spare serves (on
    2 CPU cores, a spare starting at the take delayed the survivors' join by ~0.3-0.5 s); the
    replacement of a taken spare starts once every local rank trains again (its first batch
    after the recovery). Spares are started by one background thread, one at a time, so no pass
    waits for a process to start. A spare that exited by itself (it could not start) is replaced
    after a back-off that doubles each time, up to ``max_backoff_s``. :meth:`close` kills every
    spare, including one being started.

    With a ``fork_server`` that is ready, a spare is forked from it (milliseconds, no imports of
    its own: ready at once); otherwise it is started cold as above.
    """

    def __init__(
        self,
        size: int,
        *,
        config_path: str | Path | None = None,
        events: EventLog | None = None,
        command: list[str] | None = None,
        max_backoff_s: float = 60.0,
        fork_server: ForkServer | None = None,
    ) -> None:
        """``config_path``: the job's resolved config, for every spare to prepare; ``events``: where
        ``spare_started`` / ``spare_lost`` go; ``command``: the spare's command line before
        ``--ready-fd FD`` (default ``python -m ckless_lightning.spare [--config CONFIG]``);
        ``fork_server``: fork spares from it while it is ready (needs ``config_path``)."""
        self.size = size
        self.events = events
        self.max_backoff_s = max_backoff_s
        config = ["--config", str(config_path)] if config_path is not None else []
        self._command = command or [sys.executable, "-m", "ckless_lightning.spare", *config]
        self._fork_argv = config
        self._fork_server = fork_server if config_path is not None else None
        self._lock = threading.Lock()  # guards everything below but the back-off
        self._spares: list[Spare] = []  # oldest first
        self._ready_fds: dict[int, int] = {}  # pid -> read end of its ready pipe, until it said ready
        self._ready: set[int] = set()  # pids of spares that said they are ready
        self._starting = 0  # spares being started by the background thread
        self._starter: threading.Thread | None = None
        self._active = False  # fill() was called: keep the pool at size from now on
        self._closed = False
        self._failures = 0  # spares in a row that exited by themselves
        self._not_before = 0.0  # time.monotonic() before which no replacement starts (back-off)

    def __len__(self) -> int:
        """Spares alive or being started."""
        with self._lock:
            return sum(p.poll() is None for p in self._spares) + self._starting

    @property
    def pids(self) -> list[int]:
        """Pids of the live spares, oldest first."""
        with self._lock:
            return [p.pid for p in self._spares if p.poll() is None]

    def ready_pids(self) -> list[int]:
        """Pids of the live spares that are prepared and waiting for a rank, oldest first."""
        with self._lock:
            return [p.pid for p in self._spares if p.poll() is None and self._is_ready(p)]

    def fill(self) -> None:
        """Start spares up to ``size`` (in the background), and keep the pool at ``size`` from now on."""
        self._active = True
        self.tend(start=True)

    def take(self) -> Spare | None:
        """A running spare, or None: the oldest ready one, else the oldest still preparing. Dead and
        stopped spares are dropped (a stopped one killed). Its replacement starts at the next
        ``tend(start=True)``."""
        self._drop_lost()
        with self._lock:
            ready = [p for p in self._spares if self._is_ready(p)]
            spare = ready[0] if ready else (self._spares[0] if self._spares else None)
            if spare is not None:
                self._spares.remove(spare)
                self._ready.discard(spare.pid)
                fd = self._ready_fds.pop(spare.pid, None)
                if fd is not None:
                    os.close(fd)
        if spare is not None:
            self._failures = 0
        return spare

    def tend(self, *, start: bool = True) -> None:
        """Drop spares that died or were stopped (killed); with ``start`` (and once :meth:`fill` was
        called), start the missing ones in the background. Returns at once."""
        self._drop_lost()
        if start:
            self._refill_later()

    def close(self) -> None:
        """Kill every spare, including one being started; the pool starts nothing afterwards."""
        with self._lock:
            self._closed = True
            starter = self._starter
        if starter is not None:
            starter.join()
        with self._lock:
            spares, self._spares = self._spares, []
            fds, self._ready_fds = list(self._ready_fds.values()), {}
            self._ready.clear()
        for proc in spares:
            signal_session(proc.pid, signal.SIGKILL)
            reap(proc, "a warm spare")
        for fd in fds:
            os.close(fd)

    # -- pieces ------------------------------------------------------------------------------------
    def _is_ready(self, proc: Spare) -> bool:
        """Whether ``proc`` said it is ready (reads its pipe without blocking); call with the lock."""
        if proc.pid in self._ready:
            return True
        fd = self._ready_fds.get(proc.pid)
        if fd is None:
            return False
        said = read_ready(fd)
        if said is None:
            return False
        del self._ready_fds[proc.pid]
        if said:
            self._ready.add(proc.pid)
        return said

    def _drop_lost(self) -> None:
        """Forget spares that are gone (a stopped one is killed first); note one that exited by itself."""
        with self._lock:
            spares = list(self._spares)
        lost = []
        for proc in spares:
            if proc.poll() is None and is_stopped(proc.pid):
                signal_session(proc.pid, signal.SIGKILL)
                reap(proc, "a stopped warm spare")
                lost.append((proc, "stopped"))
            elif proc.poll() is not None:
                lost.append((proc, "exited"))
        if not lost:
            return
        with self._lock:
            for proc, _ in lost:
                self._spares.remove(proc)
                self._ready.discard(proc.pid)
                fd = self._ready_fds.pop(proc.pid, None)
                if fd is not None:
                    os.close(fd)
        for proc, why in lost:
            code = proc.returncode
            if why == "exited" and code is not None and code >= 0:  # not killed: it could not start
                self._failures += 1
                backoff = min(self.max_backoff_s, 2.0 ** (self._failures - 1))
                self._not_before = time.monotonic() + backoff
            if self.events is not None:
                self.events.emit("spare_lost", pid=proc.pid, reason=why, exit_code=code)

    def _refill_later(self) -> None:
        """Start the missing spares in the background thread (if the pool is active and not backing off)."""
        with self._lock:
            if not self._active or self._closed or (self._starter is not None and self._starter.is_alive()):
                return
            missing = self.size - len(self._spares)
            if missing <= 0 or time.monotonic() < self._not_before:
                return
            self._starting = missing  # counted by len() from now on
            self._starter = threading.Thread(
                target=self._refill, args=(missing,), name="spare-refill", daemon=True
            )
            self._starter.start()

    def _refill(self, count: int) -> None:
        try:
            for _ in range(count):
                self._start_one()
        finally:
            with self._lock:
                self._starting = 0

    def _start_one(self) -> None:
        with self._lock:
            if self._closed:
                return
        if self._fork_server is not None and self._fork_server.is_ready:
            forked = self._fork_server.fork(launcher_env(), self._fork_argv, spare=True)
            if forked is not None:
                self._add(forked, None)  # prepared already (the server's imports): ready at once
                return
        proc, read_fd = start_with_ready_pipe(
            self._command,
            env=launcher_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._add(proc, read_fd)

    def _add(self, proc: Spare, read_fd: int | None) -> None:
        """Pool a spare just started: cold with the read end of its ready pipe, or forked (``None``:
        ready at once); kill it instead if :meth:`close` ran meanwhile."""
        with self._lock:
            self._starting -= 1
            closed = self._closed
            if not closed:
                self._spares.append(proc)
                if read_fd is None:
                    self._ready.add(proc.pid)
                else:
                    self._ready_fds[proc.pid] = read_fd
        if closed:
            if read_fd is not None:
                os.close(read_fd)
            signal_session(proc.pid, signal.SIGKILL)
            reap(proc, "a warm spare")
            return
        if self.events is not None:
            self.events.emit("spare_started", pid=proc.pid, **({"forked": True} if read_fd is None else {}))
