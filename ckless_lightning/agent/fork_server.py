"""The agent's side of the fork server (:mod:`ckless_lightning.forkserver`): start it, fork ranks, watch it.

:class:`ForkServer` starts the server beside the agent's other work, and :meth:`ForkServer.fork`
asks it for a rank process; the rank is re-parented to the agent (a child subreaper), so
:class:`ForkedProcess` reaps it and reads its exit status like a ``subprocess.Popen``. Every
wait is bounded: a server that is not ready by :data:`READY_WAIT_S`, does not answer within
:data:`REPLY_WAIT_S`, died or was stopped is killed, the rank is started cold by the caller
(``fork`` returns None), and :meth:`ForkServer.tend` starts a new server (``forkserver_lost``,
``forkserver_started`` events). Linux only (the subreaper); elsewhere ``fork`` returns None.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from ckless_lightning.agent.process_state import is_stopped, reap, signal_session
from ckless_lightning.record.events import EventLog
from ckless_lightning.record.faults import how_it_ended
from ckless_lightning.runtime.contract import launcher_env

__all__ = ["MAX_BACKOFF_S", "READY_WAIT_S", "REPLY_WAIT_S", "ForkServer", "ForkedProcess"]

READY_WAIT_S = 120.0  # longest wait for the server's imports at a rank start; then the rank starts cold
REPLY_WAIT_S = 10.0  # longest wait for a fork's answer (a fork takes milliseconds)
MAX_BACKOFF_S = 60.0  # longest pause before replacing a server lost several times in a row
_MAX_MESSAGE = 1 << 16
_EXIT_REAP_S = 2.0  # a server that closed its socket is exiting: how long to wait to learn how
_PR_SET_CHILD_SUBREAPER = 36
_GONE = 1  # the exit code given a forked rank that is not this process's child (its status is lost)


def _set_subreaper(on: bool) -> bool:
    """Make this process adopt its orphaned descendants (the forked ranks); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


def _say_go(fd: int) -> bool:
    """Tell a forked rank to run; False if it is gone already (its exit status tells the agent)."""
    try:
        os.write(fd, b"go\n")
    except BrokenPipeError:
        return False
    return True


class ForkedProcess:
    """A rank forked by the fork server and re-parented to this process: what
    :class:`~ckless_lightning.agent.processes.RankProcess` needs of a ``subprocess.Popen``."""

    def __init__(self, pid: int, stdout: IO[bytes], stdin: IO[bytes] | None = None) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.stdin: IO[bytes] | None = stdin  # a spare's: its go pipe, for the rank assignment
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (negative: the signal that killed it), or None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not re-parented to us (it quit at once, see forkserver.py)
                self.returncode = _GONE
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit (at most ``timeout`` seconds: ``subprocess.TimeoutExpired`` after)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        return code


class ForkServer:
    """One fork server for this node's ranks (``agent.fork_server``).

    :meth:`start` (returns at once; the server imports in the background: ``launch.py`` calls it
    as early as it can), :meth:`prepare` (the job's resolved config and where events go: the
    server prepares the rank path for it), :meth:`fork` (a rank process, or None: start it cold),
    :meth:`tend` (every supervision pass: replace a server that died or was stopped; a new one is
    told the config at once), :meth:`close`.
    """

    def __init__(self, log_path: str | Path) -> None:
        self.log_path = Path(log_path)
        self.config_path: str | None = None
        self.events: EventLog | None = None
        self._lock = threading.Lock()  # one request at a time
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0  # time.time() the running server was started
        self._sock: socket.socket | None = None
        self._ready = False
        self._closed = False  # the server closed its socket (it is exiting)
        self._gave_up = False  # the server could not prepare: every rank starts cold from now on
        self._subreaper = False
        self._wanted = False  # start() was called: tend() keeps a server running
        self._losses = 0  # servers lost in a row (reset once one is ready)
        self._not_before = 0.0  # time.monotonic() before which tend() starts no new server

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs (a chaos target)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the server (it imports in the background) if none runs."""
        with self._lock:
            self._wanted = True
            self._start()

    def prepare(self, config_path: str | Path, events: EventLog) -> None:
        """Tell the server (and every later one) the job's resolved config; returns at once."""
        with self._lock:
            self.config_path = str(config_path)
            self.events = events
            if self._proc is not None:
                self._emit("forkserver_started", pid=self._proc.pid, t=self._started_at)
                self._send_prepare()

    def ready(self, wait_s: float = READY_WAIT_S) -> bool:
        """Whether the server can fork now: waits up to ``wait_s`` for its imports (False: it is not
        running, could not prepare, or was lost meanwhile)."""
        with self._lock:
            return self._proc is not None and self._sock is not None and self._wait_ready(wait_s)

    @property
    def is_ready(self) -> bool:
        """Whether the server is prepared and can fork now (never waits)."""
        with self._lock:
            return self._ready and self._proc is not None and self._proc.poll() is None

    @property
    def is_starting(self) -> bool:
        """Whether a server runs that may still say ready (its imports in progress; never waits)."""
        with self._lock:
            proc = self._proc
            return not self._ready and not self._gave_up and proc is not None and proc.poll() is None

    def fork(
        self,
        env: dict[str, str],
        argv: list[str],
        *,
        spare: bool = False,
        reader_log: Path | None = None,
        ready_wait_s: float = READY_WAIT_S,
    ) -> ForkedProcess | None:
        """A rank process with ``env`` and ``argv`` (``--config PATH``), its output on a new pipe;
        None when the server cannot give one within the bounds (start the rank cold). Call
        :meth:`ready` first when ``env`` holds the time of the start (the wait comes before it).
        With ``spare``, a warm spare instead: its ``stdin`` takes the rank assignment. With
        ``reader_log``, the batch-cache reader (``argv``: its arguments), its output in that file
        and its ``stdout`` the read end of its ready pipe (see :func:`~.process_state.read_ready`)."""
        assert not (spare and reader_log is not None)
        with self._lock:
            if self._proc is None or self._sock is None or not self._wait_ready(ready_wait_s):
                return None
            out_read, out_write = os.pipe()
            go_read, go_write = os.pipe()
            keep_go = False
            try:
                request = {
                    "env": env,
                    "argv": argv,
                    "cwd": os.getcwd(),
                    **({"role": "spare"} if spare else {}),
                    **({"role": "reader", "log": str(reader_log)} if reader_log is not None else {}),
                }
                socket.send_fds(self._sock, [json.dumps(request).encode()], [out_write, go_read])
                reply = self._receive(REPLY_WAIT_S)
            except OSError as err:
                reply = {"error": f"{type(err).__name__}: {err}"}
            finally:
                os.close(out_write)
                os.close(go_read)
            try:
                if reply is None or "pid" not in reply:
                    os.close(out_read)
                    self._lose(self._why("no answer") if reply is None else str(reply.get("error")))
                    return None  # a rank forked all the same reads end-of-file on its go pipe and quits
                _say_go(go_write)
                keep_go = spare
            finally:
                if not keep_go:
                    os.close(go_write)
            stdin = os.fdopen(go_write, "wb") if keep_go else None
            return ForkedProcess(int(reply["pid"]), os.fdopen(out_read, "rb"), stdin)

    def tend(self) -> None:
        """Replace a server that died or was stopped (killed first), after a back-off that doubles
        with each loss in a row (up to :data:`MAX_BACKOFF_S`); returns at once."""
        with self._lock:
            if self._gave_up or not self._wanted:
                return
            proc = self._proc
            if proc is not None:
                if proc.poll() is None and not is_stopped(proc.pid):
                    return
                self._lose(self._why("lost"))
            if time.monotonic() >= self._not_before:
                self._start()

    def close(self) -> None:
        """Stop the server (closing its socket ends it; killed besides) and stop adopting orphans."""
        with self._lock:
            self._stop()
            self._gave_up = True
            if self._subreaper:
                _set_subreaper(False)
                self._subreaper = False

    # -- pieces (call with the lock) ---------------------------------------------------------
    def _start(self) -> None:
        if self._gave_up or self._proc is not None:
            return
        if not self._subreaper:
            self._subreaper = _set_subreaper(True)
            if not self._subreaper:
                self._gave_up = True
                return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            try:
                self._proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "ckless_lightning.forkserver",
                        "--socket-fd",
                        str(theirs.fileno()),
                    ],
                    env=launcher_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=(theirs.fileno(),),
                )
            finally:
                theirs.close()
        self._sock = ours
        self._ready = False
        self._started_at = time.time()
        self._closed = False
        if self.config_path is not None:
            self._emit("forkserver_started", pid=self._proc.pid)
            self._send_prepare()

    def _send_prepare(self) -> None:
        assert self._sock is not None
        try:
            self._sock.sendall(json.dumps({"prepare": self.config_path}).encode())
        except OSError as err:  # it died already: the next fork or tend() notices
            self._emit("forkserver_lost", pid=self.pid, reason=f"{type(err).__name__}: {err}")

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, **fields)

    def _wait_ready(self, wait_s: float) -> bool:
        if self._ready:
            return True
        if self.config_path is None:
            return False  # not told the config yet: nothing to fork for
        said = self._receive(wait_s)
        if said is None:
            waited = time.time() - self._started_at
            self._lose(self._why(f"not ready within {wait_s:.0f} s ({waited:.1f} s since its start)"))
            return False
        if "ready" not in said:
            self._lose(f"could not prepare: {said.get('failed')}")
            self._gave_up = True  # the same config would fail again: cold ranks report the error
            return False
        self._ready = True
        self._losses = 0
        self._emit(
            "forkserver_ready",
            pid=said["ready"],
            start_s=said.get("start_s"),
            prepare_s=said.get("prepare_s"),
            modules=said.get("modules"),
        )
        return True

    def _receive(self, wait_s: float) -> dict[str, Any] | None:
        """The server's next message; None if it sent none within ``wait_s`` or closed the socket.
        A stopped server is noticed at once rather than at the end of the wait."""
        assert self._sock is not None and self._proc is not None
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._proc.poll() is not None or is_stopped(self._proc.pid):
                return None
            readable, _, _ = select.select([self._sock], [], [], min(left, 0.2))
            if readable:
                try:
                    data = self._sock.recv(_MAX_MESSAGE)
                except ConnectionResetError:  # it died with our message unread: the kernel reset it
                    data = b""
                self._closed = not data
                return json.loads(data) if data else None

    def _why(self, otherwise: str) -> str:
        """Why the server did not answer, as observed: how it ended (it closed its socket: give its
        exit a moment to be reaped), stopped, or ``otherwise`` (its bound passed)."""
        assert self._proc is not None
        if is_stopped(self._proc.pid):
            return "stopped"
        try:
            code = self._proc.wait(timeout=_EXIT_REAP_S if self._closed else 0)
        except subprocess.TimeoutExpired:
            return otherwise
        return how_it_ended(code)

    def _lose(self, reason: str) -> None:
        proc = self._proc
        if proc is None:
            return
        # exit_code: its return code when it has ended (None: running or stopped; killed next)
        self._emit("forkserver_lost", pid=proc.pid, reason=reason, exit_code=proc.poll())
        self._stop()
        self._losses += 1
        self._not_before = time.monotonic() + min(MAX_BACKOFF_S, 2.0 ** (self._losses - 1) - 1.0)

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        proc, self._proc = self._proc, None
        self._ready = False
        if proc is not None:
            signal_session(proc.pid, signal.SIGKILL)
            reap(proc, "the fork server")
