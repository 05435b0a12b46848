"""What the agent does with any process it starts: start it with a ready pipe, read that pipe,
ask whether it is stopped, signal its session.

A leaf of the agent package (the rank processes, the spare pool, the batch-cache reader and the
fork server use it).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["REAP_S", "is_stopped", "read_ready", "reap", "signal_session", "start_with_ready_pipe"]

# The longest wait for a killed process to be reaped: one stuck in the kernel (state D: a GPU driver
# call, a hung network file system read) dies only when that call returns.
REAP_S = 30.0


def start_with_ready_pipe(command: list[str], **popen: Any) -> tuple[subprocess.Popen[bytes], int]:
    """``command --ready-fd FD`` in its own session; returns the process and the pipe's read end,
    on which it writes a line once ready (see :func:`read_ready`). ``popen``: more ``Popen`` arguments."""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            [*command, "--ready-fd", str(write_fd)], start_new_session=True, pass_fds=(write_fd,), **popen
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return proc, read_fd


def read_ready(fd: int) -> bool | None:
    """Read a ready pipe without blocking: None, nothing yet; True, it said ready; False, it exited
    before saying anything. Once it returns a bool, ``fd`` is closed."""
    readable, _, _ = select.select([fd], [], [], 0)
    if not readable:
        return None
    said = os.read(fd, 64)
    os.close(fd)
    return bool(said)


def signal_session(pid: int, sig: signal.Signals) -> None:
    """Signal the session (process group) that ``pid`` leads; gone already is fine."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (SIGSTOP/SIGTSTP: state ``T`` in ``/proc/<pid>/stat``).

    Nothing in a job stops its own processes, so a stopped one is a fault: the agent kills it at
    once instead of waiting for its heartbeat to go stale (ptrace stops, state ``t``, do not count).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def reap(proc: Any, what: str, *, timeout_s: float = REAP_S) -> bool:
    """Wait at most ``timeout_s`` for ``proc`` (a ``Popen`` already sent SIGKILL) to exit; True if it
    did. If not, say so on stderr and return False: the caller goes on without it (it stays a
    zombie until its kernel call returns; a later ``poll`` reaps it)."""
    try:
        proc.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        print(
            f"agent: {what} (pid {proc.pid}) has not exited {timeout_s:g} s after SIGKILL: stuck in the "
            "kernel (state D, e.g. a GPU driver call); going on without it",
            file=sys.stderr,
        )
        return False
