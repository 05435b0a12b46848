"""Faults injected from outside a rank: the node agent signals the rank's process, or kills its node.

The ``injected_by=outside`` faults of a plan (:mod:`ckless_lightning.runtime.faults`): a ``kill``
is SIGKILL of the rank's pid, a ``hang`` is SIGSTOP of it (a stopped process, state T), a
``node_loss`` kills every rank of the node and then the agent itself, a ``slot_lost`` has the
agent kill the rank and start nothing in its place until the job completed
``fault.return_step``. A fault fires once the target rank works on the fault's step (its
heartbeat says step N-1 is complete), once per job: :func:`~ckless_lightning.runtime.faults.claim_fault`
makes it once-only across generations and agents. Nothing here imports torch or Lightning: the
agent process uses it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ckless_lightning.record.events import EventLog
from ckless_lightning.runtime.faults import FaultConfig, FaultSpec, claim_fault, injected_event

if TYPE_CHECKING:
    from ckless_lightning.comm.store import Heartbeat

__all__ = ["ChaosInjector", "OutsideFaultInjector"]


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
        lose_slot: Callable[[FaultSpec], None] | None = None,
    ) -> None:
        """Fire each pending fault whose rank is working on its step; called once per supervision pass.

        ``gen``: the node's generation (in the event); ``beats``: the heartbeats of this node's ranks;
        ``pid_of(rank)``: the pid of the rank's process; ``kill_ranks()``: SIGKILL every rank of the
        node (a ``node_loss``, after which this process SIGKILLs itself and never returns);
        ``lose_slot(spec)``: take the rank's device away (a ``slot_lost``: the agent kills the rank and
        starts nothing in its place until ``spec.return_step``). A fault is dropped once due, fired or
        not: one already fired in an earlier generation is not fired again. A rank without a process
        (its slot lost) has no heartbeat here: its faults wait.
        """
        for spec in list(self.pending):
            if spec.rank not in beats or beats[spec.rank].completed_step < spec.step - 1:
                continue  # step N starts once step N-1 is complete
            self.pending.remove(spec)
            if claim_fault(self.marker_dir, spec):  # not already fired in an earlier generation
                self._fire(spec, gen, pid_of, kill_ranks, lose_slot)

    def _fire(
        self,
        spec: FaultSpec,
        gen: int,
        pid_of: Callable[[int], int],
        kill_ranks: Callable[[], None],
        lose_slot: Callable[[FaultSpec], None] | None,
    ) -> None:
        self.events.emit("fault_injected", **injected_event(spec, "outside"), gen=gen)
        if spec.fault_type == "kill":
            os.kill(pid_of(spec.rank), signal.SIGKILL)
        elif spec.fault_type == "hang":
            os.kill(pid_of(spec.rank), signal.SIGSTOP)
        elif spec.fault_type == "slot_lost":
            assert lose_slot is not None, "slot_lost needs the agent's lose_slot"
            lose_slot(spec)
        elif spec.fault_type == "node_loss":
            kill_ranks()
            os.kill(os.getpid(), signal.SIGKILL)  # the whole node goes, agent included
        else:
            raise AssertionError(f"fault type {spec.fault_type} cannot be injected from outside")


class ChaosInjector:
    """``fault=chaos`` on one node: SIGKILL or SIGSTOP of a random process of it at random times.

    The times are wall-clock arrivals from the agent's start, Exponential(mean ``fault.mtbf_s``),
    so they fall in any phase: start-up, steps, recoveries, process-group formation. Each arrival
    picks one process of ``fault.targets`` (ranks, warm spares, the batch-cache reader) that is
    alive at that moment, and one of ``fault.signals``; an arrival with nothing to hit is skipped.
    Seeded per node (``fault.seed``, the node rank): the same draws every run, though what they
    hit depends on timing. At most ``fault.max_faults`` per node. A rank hit is a
    ``fault_injected`` (``injected_by: "chaos"``); a spare or reader hit is a
    ``process_fault_injected`` (it costs no recovery).
    """

    def __init__(self, cfg: FaultConfig, node: int, events: EventLog) -> None:
        self.rng = random.Random(f"chaos/{cfg.seed}/{node}")
        self.mean_s = cfg.mtbf_s
        self.left = cfg.max_faults
        self.targets = tuple(cfg.targets)
        self.signals = tuple(cfg.signals)
        self.events = events
        self.node = node
        self.next_at = time.monotonic() + self._gap()

    def _gap(self) -> float:
        return self.rng.expovariate(1.0 / self.mean_s)

    def inject_due(
        self, gen: int, processes: Mapping[str, Mapping[int, int]], beats: Mapping[int, Heartbeat]
    ) -> None:
        """Fire if an arrival is due; called once per supervision pass.

        ``processes``: for each target kind, ``{id: pid}`` of its live processes (a rank's id is its
        global rank; a spare's or reader's is its pid); ``beats``: the heartbeats of this node's ranks.
        """
        if self.left <= 0 or time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + self._gap()
        candidates = [
            (kind, ident, pid) for kind in self.targets for ident, pid in processes.get(kind, {}).items()
        ]
        if not candidates:
            return
        kind, ident, pid = self.rng.choice(candidates)
        how = self.rng.choice(self.signals)
        self.left -= 1
        if kind == "rank":
            beat = beats.get(ident)
            step = beat.completed_step + 1 if beat is not None and beat.completed_step >= 0 else None
            self.events.emit(
                "fault_injected",
                rank=ident,
                step=step,
                phase=None,
                fault_type="kill" if how == "kill" else "hang",
                injected_by="chaos",
                pid=pid,
                gen=gen,
            )
        else:
            self.events.emit(
                "process_fault_injected", target=kind, pid=pid, signal=how, node=self.node, gen=gen
            )
        try:
            os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        except ProcessLookupError:  # it exited between the look and the signal: nothing to hit
            self.events.emit("process_fault_missed", target=kind, pid=pid)
