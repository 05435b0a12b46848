"""Where a rank's main thread is, told to the agent every second: who to blame for a hang.

When one rank stops making progress while it runs (a deadlock or an endless
loop in its own code, a stuck read), its peers block in their next collective
with it, and every heartbeat goes stale at about the same moment: the oldest
heartbeat names a random rank, and at tiers 3-4 killing an innocent one costs
its redundancy and a second recovery once the hung one is found. A
:class:`WhereReporter` thread samples the innermost Python frame of the rank's
main thread (``sys._current_frames``, which CPython documents for this kind of
use) and writes a word where its node agent reads it: the rank's slot of the node's
heartbeat board (``comm/beat_board.py``, shared memory: no store request), or with
``agent.local_beats=false`` the job store's ``where/<rank>``:

- ``peers``: in ``torch.distributed`` (a collective, a p2p wait, process-group
  formation), or in this project's own waits on peers (the commit vote, the join
  barrier): blocked on someone else;
- ``data``: waiting for the node's batch-cache reader;
- ``device``: waiting for its accelerator: in ``torch.cuda`` (a stream or event
  synchronize), or anywhere while the device still has work queued (``device_busy``:
  a ``.item()`` or a device-to-host copy behind an NCCL kernel that waits for a peer
  returns to Python only when that kernel ends, so its innermost frame is the
  caller's own code);
- ``running``: anything else (computing, or stuck in its own code).

The agent blames a stale rank that is ``running`` before one waiting for data, its
device or its ``peers`` (``agent/policies.py``, ``BLAME_ORDER``). A thread keeps
sampling while the main thread is blocked in C++ (collectives release the GIL); a
stopped process writes nothing, and the agent sees its state directly.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import FrameType

from ckless_lightning.comm.beat_board import WhereWriter

__all__ = ["WhereReporter", "cuda_busy", "where_is"]

# Innermost frames in these files wait on peers. DTensor's dispatch is local compute.
_PEER_WAITS = ("/torch/distributed/", "/ckless_lightning/recovery/", "/ckless_lightning/comm/")
_NOT_PEER_WAITS = ("/torch/distributed/tensor/",)
_DATA_WAITS = ("/ckless_lightning/data/",)
_DEVICE_WAITS = ("/torch/cuda/", "/torch/accelerator/")


def where_is(frame: FrameType | None, *, device_busy: bool = False) -> str:
    """``peers``, ``data``, ``device`` or ``running`` for a thread whose innermost Python frame is
    ``frame``; ``device_busy``: its accelerator has unfinished work."""
    path = frame.f_code.co_filename.replace("\\", "/") if frame is not None else ""
    if any(p in path for p in _PEER_WAITS) and not any(p in path for p in _NOT_PEER_WAITS):
        return "peers"
    if any(p in path for p in _DATA_WAITS):
        return "data"
    if device_busy or any(p in path for p in _DEVICE_WAITS):
        return "device"
    return "running"


def cuda_busy(device: int) -> Callable[[], bool]:
    """For :class:`WhereReporter`: whether CUDA device ``device`` has unfinished work on any stream
    that synchronizes with its default stream (an event recorded now is not yet reached). A query
    that fails (a poisoned context) says not busy: the rank is then blamed like a running one."""
    import torch

    def busy() -> bool:
        try:
            event = torch.cuda.Event()
            event.record(torch.cuda.default_stream(device))
            return not event.query()
        except RuntimeError:
            return False

    return busy


class WhereReporter:
    """Writes ``rank``'s main-thread position to ``writer`` every ``interval_s`` when it changed;
    ``start`` once, ``stop`` at the end of training (returns at once: the thread waits on an event).

    ``writer``: the rank's :class:`~ckless_lightning.comm.beat_board.BoardBeats` (its slot of the
    node's board), or the :class:`~ckless_lightning.comm.JobStore` (``agent.local_beats=false``). A
    store that stops answering (``RuntimeError``) ends the thread with a line on stderr: the main
    thread finds out on its own. A board write does not fail in normal operation; if one raises, the
    thread ends with its traceback.
    """

    def __init__(
        self,
        writer: WhereWriter,
        rank: int,
        *,
        interval_s: float = 1.0,
        device_busy: Callable[[], bool] | None = None,
    ) -> None:
        self.writer = writer
        self.rank = rank
        self.interval_s = interval_s
        self.device_busy = device_busy  # None: no accelerator (CPU ranks)
        self._main = threading.main_thread().ident
        self._last: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"where-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def sample(self) -> str:
        frame = sys._current_frames().get(self._main)  # type: ignore[arg-type]
        where = where_is(frame)
        if where == "running" and self.device_busy is not None and self.device_busy():
            return "device"
        return where

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            where = self.sample()
            if where == self._last:
                continue  # unchanged: the record still says it
            try:
                self.writer.set_rank_where(self.rank, where)
            except RuntimeError as err:  # the store is gone: the main thread finds out on its own
                print(f"rank {self.rank}: cannot report where it is ({err})", file=sys.stderr)
                return
            self._last = where
