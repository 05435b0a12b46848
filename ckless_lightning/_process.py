"""Tie a child process's life to its parent's (Linux PR_SET_PDEATHSIG), so nothing outlives the agent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Get SIGKILL when ``parent_pid`` (our parent) dies; exit now if it is already gone.

    Called first thing in processes the agent starts (ranks, spares, the batch
    cache reader). A no-op off Linux.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        sys.exit(f"the parent process {parent_pid} exited before this process started")
