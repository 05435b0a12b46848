"""The faults a run had, as observed: one per failure, whether or not the product injected it.

In production no fault arrives through ``fault=``: the OOM killer, a segfault, a stopped process,
a dying node. So a fault is what the job *saw*, read back from ``events.jsonl``
(:mod:`ckless_lightning.record.events`):

- the agent's ``fault_detected`` (a rank that exited, how: a signal or an exit code; a hang, or a
  stopped process; a silent node),
- a rank's own exception (``rank_phase`` ``recovery_start`` with ``own``: tiers 3-4),
- a state digest's disagreement (``state_disagreement``: tiers 3-4, HSDP),
- a rank lost after the job's end (``rank_lost_after_end``), and the job's other processes
  (``forkserver_lost``, ``spare_lost``, ``reader_restarted``: replaced, no recovery needed),
- and, when none of those explains it, a generation the job left for a ``fault`` (its ranks saw
  a peer vanish; nothing else recorded why).

An injected fault (``fault_injected`` / ``process_fault_injected``) is the same fault as the first
observation of the same rank (or process) in the same generation after it: one fault, which says
it was injected. Two observations of one rank in one generation (a hang, then the SIGKILL of the
process the agent killed for it) are one fault, named by the first.

A leaf module: no torch, no Lightning, no agent (the agent imports :func:`how_it_ended`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

__all__ = ["ObservedFault", "exit_cause", "how_it_ended", "observed_faults"]

# Injected faults that stop nothing: a held copy corrupted in memory is found only if a restore uses
# it (``restore_rejected``), so it is not a fault of the job's own.
SILENT_FAULTS = ("corrupt_copy",)
_PROCESSES = ("spare", "forkserver", "reader")
_EXIT_MEANINGS = {  # runtime.contract.ExitCode, by value (this module imports no torch)
    4: "lost a peer",
    5: "suspect hardware",
    6: "left behind",
    7: "its accelerator failed",
}


def exit_cause(code: int | None) -> str:
    """How a process ended, in one word: ``SIGKILL`` (killed by a signal), ``exit(1)``, ..."""
    if code is None:
        return "exit(?)"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal({-code})"
    return f"exit({code})"


def how_it_ended(code: int) -> str:
    """A process's end in words, for messages: ``killed by SIGKILL``, ``exited with code 1 (...)``."""
    if code < 0:
        return f"killed by {exit_cause(code)}"
    meaning = _EXIT_MEANINGS.get(code)
    return f"exited with code {code}" + (f" ({meaning})" if meaning else "")


@dataclass
class ObservedFault:
    """One fault. ``t``: its first sign (the injection, for an injected one); ``what``: ``rank``,
    ``node``, ``spare``, ``forkserver``, ``reader``; ``key``: the rank (node, pid) it hit; ``gen``:
    the generation it hit (a rank's); ``cause``: as observed (``SIGKILL``, ``exit 1``, ``stopped``,
    ``hang``, ``silent`` (a node), ``exception``, ``digest``, ``unseen``, ...); ``detail``: the
    observation's own words; ``injected``: the ``fault_injected`` event, if the product injected it;
    ``detection``: the first observation (None: only injected, never seen); ``outcome``: set for a
    fault that needs no recovery of the job (a process replaced, a rank lost after the end)."""

    t: float
    what: str
    key: int | None
    gen: int | None
    cause: str
    detail: str = ""
    injected: dict[str, Any] | None = None
    detection: dict[str, Any] | None = None
    outcome: str | None = None

    @property
    def rank(self) -> int | None:
        return self.key if self.what == "rank" else None


def observed_faults(events: list[dict[str, Any]]) -> list[ObservedFault]:
    """The faults of ``events`` (sorted by time), in the order they happened; see the module doc."""
    faults: list[ObservedFault] = []
    latest_gen = 0
    ending = _end_of_faults(events)
    events = [e for e in events if float(e["t"]) < ending]
    for event in events:
        kind = event["kind"]
        if kind == "generation":
            latest_gen = max(latest_gen, int(event["gen"]))
            continue
        gen = int(event["gen"]) if event.get("gen") is not None else latest_gen
        if kind == "fault_injected" and event.get("fault_type") not in SILENT_FAULTS:
            key = event.get("rank")
            faults.append(ObservedFault(float(event["t"]), "rank", key, gen, "unseen", injected=event))
        elif kind == "process_fault_injected":
            what = str(event.get("target"))
            pid = event.get("pid")
            faults.append(ObservedFault(float(event["t"]), what, pid, None, "unseen", injected=event))
        elif (observed := _observation(event)) is not None:
            what, key, cause, detail = observed
            _observe(faults, event, what, key, gen if what == "rank" else None, cause, detail)
    _explain_generation_moves(faults, events)
    for fault in faults:
        if fault.what in _PROCESSES and fault.outcome is None:  # injected, and nothing was lost
            fault.outcome = "not seen: the process had ended, or shrugged it off"
    faults.sort(key=lambda f: f.t)
    return faults


def _end_of_faults(events: list[dict[str, Any]]) -> float:
    """When the job began to end (``interrupted``, ``giveup``): ranks losing their peers after it,
    and the generation moves they make, are that ending, not faults (inf: it did not)."""
    ends = [float(e["t"]) for e in events if e["kind"] in ("interrupted", "giveup")]
    return min(ends, default=float("inf"))


def _observation(event: dict[str, Any]) -> tuple[str, int | None, str, str] | None:
    """(what, key, cause, detail) of an event that observes a fault; None for any other event."""
    kind = event["kind"]
    if kind == "fault_detected":
        reason = event.get("reason")
        if reason == "node_lost":
            return "node", event.get("node"), "silent", f"node {event.get('node')}'s agent went silent"
        if reason == "hang":
            if event.get("stopped"):
                return "rank", event.get("rank"), "stopped", "stopped (state T)"
            limit = event.get("limit_s")
            bound = f" {limit:g} s" if isinstance(limit, (int, float)) else ""
            return "rank", event.get("rank"), "hang", f"no heartbeat for{bound} (where: {event.get('where')})"
        if reason == "peer_lost":
            return "rank", event.get("rank"), "lost-peer", exit_cause(event.get("exit_code"))
        code = event.get("exit_code")
        return "rank", event.get("rank"), exit_cause(code), "" if code is None else how_it_ended(int(code))
    if kind == "rank_phase" and event.get("phase") == "recovery_start" and event.get("own"):
        error = str(event.get("error", ""))
        return "rank", event.get("rank"), "exception", error
    if kind == "state_disagreement":
        suspects = event.get("suspects") or [None]
        return "rank", suspects[0], "digest", f"state disagreed with its replicas in step {event.get('step')}"
    if kind == "rank_lost_after_end":
        return "rank", event.get("rank"), exit_cause(event.get("exit_code")), "after the job's end"
    if kind == "forkserver_lost":
        return "forkserver", event.get("pid"), _process_cause(event), str(event.get("reason", ""))
    if kind == "spare_lost":
        return "spare", event.get("pid"), _process_cause(event), str(event.get("reason", ""))
    if kind == "reader_restarted":
        return "reader", event.get("node"), _process_cause(event), str(event.get("reason", ""))
    return None


_READER_REASONS = {"no_progress": "stalled", "no_start": "no-start"}


def _process_cause(event: dict[str, Any]) -> str:
    reason = str(event.get("reason", ""))
    if reason in _READER_REASONS:
        return _READER_REASONS[reason]
    if event.get("stopped") or reason.startswith("stopped"):
        return "stopped"
    if event.get("exit_code") is not None:
        return exit_cause(int(event["exit_code"]))
    return "lost"


def _observe(
    faults: list[ObservedFault],
    event: dict[str, Any],
    what: str,
    key: int | None,
    gen: int | None,
    cause: str,
    detail: str,
) -> None:
    """Attach ``event`` to the fault of the same rank (process) and generation, else open one."""
    t = float(event["t"])
    for fault in reversed(faults):
        if fault.what != what:
            continue
        unseen_injection = fault.injected is not None and fault.detection is None
        if what in _PROCESSES:  # the injection names its pid, a reader's restart its node
            if not unseen_injection and fault.key != key:
                continue
        elif fault.key != key:
            continue
        elif fault.gen != gen and not (
            # A rank hit while it moved between generations: the injection names the job's
            # generation, the agent the one its process was in.
            unseen_injection and fault.gen is not None and gen is not None and abs(fault.gen - gen) <= 1
        ):
            continue
        if fault.detection is None:  # an injected fault's first observation
            fault.detection, fault.cause, fault.detail = event, cause, detail
        return  # a second observation of one fault (a hang, then the exit of the killed process)
    fault = ObservedFault(t, what, key, gen, cause, detail, detection=event)
    if event["kind"] == "rank_lost_after_end":
        fault.outcome = "after the job's end: not replaced"
    elif what in _PROCESSES:
        fault.outcome = "replaced; no recovery of the job needed"
    faults.append(fault)


def _explain_generation_moves(faults: list[ObservedFault], events: list[dict[str, Any]]) -> None:
    """A generation the job left for a ``fault`` with no fault seen in it: its ranks saw a peer
    vanish (``recovery_start``), nothing recorded why. Also: an outside fault's first sign is the
    earliest of its observation and its peers' noticing it (they often see it first)."""
    moves: dict[int, dict[str, Any]] = {}  # generation left for a fault -> the generation event
    noticed: dict[int, dict[str, Any]] = {}  # generation -> its first rank leaving it for a peer's fault
    started_over: set[int] = set()  # generations left to start over: the recovery of an earlier fault
    latest = 0
    for event in events:
        if event["kind"] == "generation":
            if event.get("reason") == "fault":
                moves.setdefault(latest, event)
            latest = max(latest, int(event["gen"]))
        elif event["kind"] == "rank_phase" and event["phase"] == "recovery_start" and not event.get("own"):
            noticed.setdefault(int(event["gen"]), event)
            if event.get("start_over"):
                started_over.add(int(event["gen"]))
    rank_faults = [f for f in faults if f.what in ("rank", "node") and f.outcome is None]
    for gen, move in sorted(moves.items()):
        sign = min((e for e in (move, noticed.get(gen)) if e is not None), key=lambda e: float(e["t"]))
        hit = [f for f in rank_faults if f.gen == gen]
        if not hit:
            if gen in started_over:  # tier 4 lost state it had no disk checkpoint for: no new fault
                continue
            seen = noticed.get(gen)
            detail = f"its peers saw: {seen.get('error', '')}"[:160] if seen else "no rank said why"
            faults.append(ObservedFault(float(sign["t"]), "rank", None, gen, "unseen", detail))
            continue
        first = min(hit, key=lambda f: f.t)
        if first.injected is None and float(sign["t"]) < first.t:
            first.t = float(sign["t"])  # the peers noticed before the agent reported it
