"""Faults injected from outside a rank: the node agent signals the rank's process, or kills its node.

The ``injected_by=outside`` faults of a plan (:mod:`ckless_lightning.runtime.faults`): a ``kill``
is SIGKILL of the rank's pid, a ``hang`` is SIGSTOP of it (a stopped process, state T), a
``node_loss`` kills every rank of the node and then the agent itself. A fault fires once the
target rank works on the fault's step (its heartbeat says step N-1 is complete), once per job:
:func:`~ckless_lightning.runtime.faults.claim_fault` makes it once-only across generations and
agents. Nothing here imports torch or Lightning: the agent process uses it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ckless_lightning.record.events import EventLog
from ckless_lightning.runtime.faults import FaultSpec, claim_fault, injected_event

if TYPE_CHECKING:
    from ckless_lightning.comm.store import Heartbeat

__all__ = ["OutsideFaultInjector"]


class OutsideFaultInjector:
    """Fires a node's outside faults, each once, as their ranks reach them.

    ``specs``: the faults to fire (the job's ``injected_by=outside`` faults on this node's ranks);
    ``marker_dir``: the job's once-only markers (``<run_dir>/faults``); ``events``: where
    ``fault_injected`` goes.
    """

    def __init__(self, specs: Iterable[FaultSpec], marker_dir: Path, events: EventLog) -> None:
        self.pending = list(specs)
        self.marker_dir = Path(marker_dir)
        self.events = events

    def inject_due(
        self,
        gen: int,
        beats: Mapping[int, Heartbeat],
        *,
        pid_of: Callable[[int], int],
        kill_ranks: Callable[[], None],
    ) -> None:
        """Fire each pending fault whose rank is working on its step; called once per supervision pass.

        ``gen``: the node's generation (in the event); ``beats``: the heartbeats of this node's ranks;
        ``pid_of(rank)``: the pid of the rank's process; ``kill_ranks()``: SIGKILL every rank of the
        node (a ``node_loss``, after which this process SIGKILLs itself and never returns). A fault
        is dropped once due, fired or not: one already fired in an earlier generation is not fired again.
        """
        for spec in list(self.pending):
            if beats[spec.rank].completed_step < spec.step - 1:
                continue  # step N starts once step N-1 is complete
            self.pending.remove(spec)
            if claim_fault(self.marker_dir, spec):  # not already fired in an earlier generation
                self._fire(spec, gen, pid_of, kill_ranks)

    def _fire(
        self, spec: FaultSpec, gen: int, pid_of: Callable[[int], int], kill_ranks: Callable[[], None]
    ) -> None:
        self.events.emit("fault_injected", **injected_event(spec, "outside"), gen=gen)
        if spec.fault_type == "kill":
            os.kill(pid_of(spec.rank), signal.SIGKILL)
        elif spec.fault_type == "hang":
            os.kill(pid_of(spec.rank), signal.SIGSTOP)
        elif spec.fault_type == "node_loss":
            kill_ranks()
            os.kill(os.getpid(), signal.SIGKILL)  # the whole node goes, agent included
        else:
            raise AssertionError(f"fault type {spec.fault_type} cannot be injected from outside")
