"""Two questions the agent asks of any process it started: is it stopped, and signal its session.

A leaf of the agent package (the rank processes, the spare pool and the fork server all use it).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["is_stopped", "signal_session"]


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
