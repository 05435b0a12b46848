"""Waiting for ``torch.distributed`` works (the buddy exchanges' point-to-point sends and receives).

One home for these waits, in ``comm/``, so that a rank blocked in one reports ``peers``
(:mod:`ckless_lightning.recovery.where` names a thread by its innermost Python frame's file; a wait
called from ``replication/`` read as ``running``). That matters after a cut: the generation watch ends
a rank blocked on peers for ``comm.stuck_exit_s`` (a gloo send to a peer behind a dead link is not
freed by cutting the connections), and the agent blames a ``running`` rank first for a hang.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

__all__ = ["wait_works"]


def wait_works(works: Iterable[Any], timeout: timedelta | None = None) -> None:
    """Wait for each of ``works`` in turn, each at most ``timeout`` (None: the group's own timeout);
    raises what ``Work.wait`` raises (RuntimeError: a peer is gone, or the wait ran out)."""
    for work in works:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
