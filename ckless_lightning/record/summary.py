"""What a job's faults cost: per-fault recovery timings and job goodput, from the event log.

``launch.py`` prints :meth:`JobSummary.format` at the end of a job. The input is
``<run_dir>/events.jsonl`` (schema in :mod:`ckless_lightning.record.events`) and
``<run_dir>/losses.jsonl`` (``{"step", "loss", "t"}`` appended by rank 0 after
every optimizer step; a restarted run appends again from its resume point).
A leaf module: no torch, no Lightning.

Goodput is fault-free time over wall time: ``(startup_s + steps_done *
step_time_s) / wall_s``, where ``startup_s`` is job start to the first completed
step of generation 0 and ``step_time_s`` the median step time measured away
from faults. A fault-free run scores about 1; every second spent detecting,
restarting, reloading and redoing steps lowers it.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckless_lightning.record.ending import ending
from ckless_lightning.record.events import read_events, read_jsonl
from ckless_lightning.record.faults import ObservedFault, observed_faults

__all__ = [
    "FaultRecovery",
    "JobSummary",
    "first_step_ratio",
    "slowest_first_step",
    "summarize",
    "summarize_run",
]

_FAULT_KINDS = ("fault_injected", "fault_detected", "generation")


@dataclass
class FaultRecovery:
    """One fault and its recovery; every ``*_s`` is seconds, ``None`` where the tier skips that phase.

    ``detection_s``: fault -> first detection. ``stop_s``: detection -> last rank
    of the old generation stopped. ``process_start_s``: stop (or detection) ->
    last new process started. ``imports_s``, ``comm_init_s``, ``state_load_s``:
    the slowest rank's phase. ``data_ready_s``: state loaded -> first batch
    (slowest rank). ``first_step_s``: the last rank's first batch -> the last rank's first
    completed step (the new generation's first step, which every rank waits out in its
    collectives). ``total_s``: fault -> last rank's first completed step in the
    new generation. ``steps_lost``: steps completed anywhere before the recovery that were redone
    (``completed_before`` - ``resumed_from_step``): also those every rank rolled back past the
    fault's step (tier 4: a rank killed between the commit and its update leaves its buddy's copy
    one step behind what its peers completed).
    """

    index: int
    t_fault: float  # the injection, else the first sign of the fault (observed, or its peers noticing)
    fault_type: str  # the injected fault_type, else the observed cause
    rank: int | None
    fault_step: int | None  # injected step, else the detection's completed_step + 1 (the step in progress)
    phase: str | None
    injected_by: str | None  # "inside" | "outside" | "chaos"; None for a fault the product did not inject
    cause: str = ""  # as observed: SIGKILL, exit 1, stopped, hang, node silent, exception, unseen, ...
    what: str = "rank"  # rank, node, spare, forkserver, reader
    key: int | None = None  # the rank, node or pid it hit
    detail: str = ""  # the observation's own words (an exception's message, a hang's bound)
    detected_by: str | None = None
    detection_s: float | None = None
    stop_s: float | None = None
    old_gen: int = 0
    new_gen: int | None = None
    process_start_s: float | None = None
    imports_s: float | None = None
    comm_init_s: float | None = None
    state_load_s: float | None = None
    data_ready_s: float | None = None
    first_step_s: float | None = None
    total_s: float | None = None
    resumed_from_step: int | None = None
    completed_before: int | None = None  # the highest step any rank completed before the recovery
    steps_lost: int | None = None
    # or "gave up: <reason>", "no new generation", "superseded by fault <n>", "no completed step"
    outcome: str = "recovered"

    @property
    def recovered(self) -> bool:
        return self.total_s is not None

    @property
    def name(self) -> str:
        """``<cause>@<where>``: ``SIGKILL@1`` (rank 1), ``silent@node1``, ``stopped@spare``, ..."""
        key = _opt(self.key)
        places = {"rank": _opt(self.rank), "node": f"node{key}", "reader": f"reader{key}"}
        where = places.get(self.what, self.what)
        return f"{self.cause or self.fault_type}@{where}"


@dataclass
class JobSummary:
    """Job-level figures plus one :class:`FaultRecovery` per fault; ``None`` where the logs lack the data."""

    faults: list[FaultRecovery] = field(default_factory=list)
    tier: int | None = None
    world_size: int | None = None
    wall_s: float | None = None
    steps_done: int | None = None
    step_time_s: float | None = None
    startup_s: float | None = None
    goodput: float | None = None  # productive step time / wall time: steps done x median step / wall
    steps_lost: int = 0  # steps computed again in all (see ``summarize``)
    ml_goodput: float | None = None  # steps kept / steps computed (steps done + steps lost)
    generations: int = 0
    exit_code: int | None = None
    giveup_reason: str | None = None
    # Elastic HSDP: seconds spent at each data-parallel width, in the order first reached ({} if the
    # job never resized), and its resizes as (reason, generation, width).
    width_s: dict[int, float] = field(default_factory=dict)
    resizes: list[tuple[str, int, int]] = field(default_factory=list)
    # Tier 4: restores served from memory (each verified against the recorded fingerprints), and the
    # sources a restore rejected, as "gen <g>: <what and why>" (``restore_rejected``).
    restores_verified: int = 0
    rejected: list[str] = field(default_factory=list)

    def format(self) -> str:
        """A plain-text report, at most ~100 columns for typical fault names."""
        return "\n".join([*_fault_table(self.faults), *_footer(self)])


def summarize_run(run_dir: str | Path) -> JobSummary:
    """:func:`summarize` of ``<run_dir>/events.jsonl`` and ``<run_dir>/losses.jsonl``."""
    run_dir = Path(run_dir)
    return summarize(read_events(run_dir / "events.jsonl"), read_jsonl(run_dir / "losses.jsonl"))


def summarize(events: list[dict[str, Any]], losses: list[dict[str, Any]] | None = None) -> JobSummary:
    """Per-fault recovery rows and job figures from events (any order) and ``losses.jsonl`` records.

    A fault is each ``fault_injected``, and each ``fault_detected`` with no fault
    opened since the last ``generation`` event (a hang or crash nobody injected)
    and not about a generation the job has already left (tiers 3-4: survivors
    move the job on before the agent reports the dead process).
    """
    events = sorted(events, key=lambda e: float(e["t"]))
    summary = JobSummary()
    starts = _of(events, "job_start")
    ends = _of(events, "job_end")
    if starts:
        summary.tier = starts[0].get("tier")
        summary.world_size = starts[0].get("world_size")
    if starts and ends:
        summary.wall_s = ends[-1]["t"] - starts[0]["t"]
    nonzero = [e["exit_code"] for e in ends if e.get("exit_code")]
    summary.exit_code = nonzero[0] if nonzero else (ends[-1].get("exit_code") if ends else None)
    giveups = _of(events, "giveup")
    summary.giveup_reason = giveups[0].get("reason") if giveups else None
    gen_kinds = ("generation", "ranks_started", "rank_phase")
    gens = {e["gen"] for e in events if e["kind"] in gen_kinds and "gen" in e}
    summary.generations = len(gens) or (1 if starts else 0)

    summary.faults = [_recovery(events, i + 1, fault) for i, fault in enumerate(observed_faults(events))]
    for fault in summary.faults:
        # Two faults of one generation (two ranks lost at once): one recovery, counted once.
        first = next(f for f in summary.faults if f.old_gen == fault.old_gen and f.what == fault.what)
        if first is not fault and fault.new_gen is not None and fault.new_gen == first.new_gen:
            _handled_by(fault, first)
    for prev, fault in itertools.pairwise(summary.faults):
        # Tiers 3-4: a fault while the job was still recovering from the one before (e.g. a rank
        # killed between leaving a generation and joining the next) is handled by that recovery.
        if (
            fault.outcome == "no new generation"
            and prev.total_s is not None
            and fault.t_fault <= prev.t_fault + prev.total_s
        ):
            fault.outcome = f"handled in the recovery of fault {prev.index}"
    for fault in summary.faults:
        if fault.total_s is None and fault.outcome == "recovered":
            later = fault.index < len(summary.faults)
            gave_up = [e for e in giveups if float(e["t"]) >= fault.t_fault]
            if later:
                fault.outcome = f"superseded by fault {fault.index + 1}"
            elif gave_up:  # tiers 3-4: survivors moved the job on, then the agent gave up
                fault.outcome = f"gave up: {gave_up[0].get('reason')}"
            else:
                fault.outcome = "no completed step"

    if losses:
        summary.steps_done = max(int(r["step"]) for r in losses)
    elif ends and ends[-1].get("final_step") is not None:
        summary.steps_done = int(ends[-1]["final_step"])
    fault_times = [e["t"] for e in events if e["kind"] in _FAULT_KINDS]
    summary.step_time_s = _median_step_time(losses or [], fault_times)
    first_steps = [e["t"] for e in events if e["kind"] == "rank_phase" and e["phase"] == "first_step_done"]
    if starts and first_steps:  # the job's first step, in whichever generation a start-up fault left
        summary.startup_s = min(first_steps) - starts[0]["t"]
    if None not in (summary.steps_done, summary.step_time_s) and summary.wall_s:
        # Start-up and recoveries are not productive time (the usual definition of goodput).
        summary.goodput = summary.steps_done * summary.step_time_s / summary.wall_s  # type: ignore[operator]
    # Steps computed again: the rows' count, or the loss log's steps logged more than once where
    # that is more (faults in quick succession leave rows without a recovery of their own). A step
    # whose loss was never logged (a peer lost before the step's loss all-reduce) shows in the rows.
    logged_again = len(losses or []) - len({int(r["step"]) for r in losses or []})
    summary.steps_lost = max(logged_again, sum(f.steps_lost or 0 for f in summary.faults))
    if summary.steps_done:
        summary.ml_goodput = summary.steps_done / (summary.steps_done + summary.steps_lost)
    _widths(summary, events, starts, ends)
    # Every rank emits a ``memory_restore``; one restore per generation that restored from memory.
    summary.restores_verified = len({e["gen"] for e in _of(events, "memory_restore") if e.get("verified")})
    summary.rejected = [f"gen {e['gen']}: {e['reason']}" for e in _of(events, "restore_rejected")]
    return summary


def _widths(
    summary: JobSummary,
    events: list[dict[str, Any]],
    starts: list[dict[str, Any]],
    ends: list[dict[str, Any]],
) -> None:
    """Elastic HSDP: the time at each width, from the job's start through each resize to its end."""
    resizes = _of(events, "elastic_resize")
    if not resizes or not starts or summary.world_size is None:
        return
    t, width = float(starts[0]["t"]), int(summary.world_size)
    end = float(ends[-1]["t"]) if ends else float(events[-1]["t"])
    for resize in resizes:
        summary.width_s[width] = summary.width_s.get(width, 0.0) + float(resize["t"]) - t
        t, width = float(resize["t"]), int(resize["dp_size"])
        summary.resizes.append((str(resize["reason"]), int(resize["gen"]), width))
    summary.width_s[width] = summary.width_s.get(width, 0.0) + end - t


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


def _phases(events: list[dict[str, Any]], gen: int) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "rank_phase" and e.get("gen") == gen]


def _handled_by(fault: FaultRecovery, first: FaultRecovery) -> None:
    """``fault`` hit while ``first``'s generation was failing; ``first``'s recovery handled both."""
    fault.outcome = f"handled in the recovery of fault {first.index}"
    fault.new_gen = None
    for attr in (
        "stop_s",
        "process_start_s",
        "imports_s",
        "comm_init_s",
        "state_load_s",
        "data_ready_s",
        "first_step_s",
    ):
        setattr(fault, attr, None)
    fault.total_s = fault.resumed_from_step = fault.steps_lost = None


def _recovery(events: list[dict[str, Any]], index: int, observed: ObservedFault) -> FaultRecovery:
    """The row of ``observed``; "before" and "after" are by position in time order."""
    t_f = observed.t
    pos = next((i for i, e in enumerate(events) if float(e["t"]) >= t_f), len(events))
    injected = observed.injected
    after = events[pos:]
    new_gen_pos = next((i for i, e in enumerate(after) if e["kind"] == "generation"), None)
    new_gen_event = None if new_gen_pos is None else after[new_gen_pos]
    old_gens = [e["gen"] for e in events[:pos] if e["kind"] == "generation"]
    # An injected fault's detection comes before the generation it led to.
    until_new_gen = after if new_gen_pos is None else after[:new_gen_pos]
    # In-process recovery (tiers 3-4): a rank leaving fit after the fault is a detection too.
    detections = [
        e
        for e in until_new_gen
        if e["kind"] == "fault_detected" or (e["kind"] == "rank_phase" and e["phase"] == "recovery_start")
    ]
    # Whoever noticed first: the observation of it (the agent's may come after the generation it
    # led to: tiers 3-4), or a peer leaving the generation before that.
    seen = [e for e in (observed.detection, *detections[:1]) if e is not None]
    detection = min(seen, key=lambda e: float(e["t"])) if seen else None
    completed = detection.get("completed_step") if detection is not None else None
    if completed is not None and completed < 0:
        completed = None  # the heartbeat's "still starting up"
    inj = injected or {}
    fault = FaultRecovery(
        index=index,
        t_fault=t_f,
        fault_type=inj.get("fault_type") or inj.get("signal") or observed.cause,
        rank=observed.rank,
        fault_step=inj.get("step")
        if injected is not None
        else (None if completed is None else completed + 1),
        phase=inj.get("phase"),
        injected_by=(inj.get("injected_by") or "chaos") if injected is not None else None,
        cause=observed.cause,
        what=observed.what,
        key=observed.key,
        detail=observed.detail,
        old_gen=observed.gen if observed.gen is not None else (old_gens[-1] if old_gens else 0),
    )
    if observed.outcome is not None:  # a process replaced, a rank lost after the end: no recovery
        fault.outcome = observed.outcome
        if observed.detection is not None:
            fault.detected_by = observed.detection.get("by") or observed.detection.get("source")
            fault.detection_s = float(observed.detection["t"]) - t_f if injected is not None else None
        return fault
    t_detect = None
    if detection is not None:
        t_detect = float(detection["t"])
        fault.detected_by = detection.get("by") or f"rank{detection.get('rank')}"
        # A fault nobody injected has no known moment: its times count from its first sign.
        fault.detection_s = t_detect - t_f if injected is not None else None
    # Ranks stopped (tiers 0-2), or left the generation in-process (tiers 3-4).
    stops = [
        e["t"]
        for e in after
        if e.get("gen") == fault.old_gen
        and (e["kind"] == "ranks_stopped" or (e["kind"] == "rank_phase" and e["phase"] == "generation_left"))
    ]
    t_stop = max(stops) if stops else None
    if t_stop is not None and t_detect is not None:
        fault.stop_s = t_stop - t_detect
    trained = [e["t"] for e in _phases(events, fault.old_gen) if e["phase"] == "first_step_done"]
    if fault.old_gen > 0 and trained and min(trained) > t_f:
        # The job was still recovering into old_gen when this fault hit, and that recovery went on
        # to train: it absorbed the fault (a rank lost before joining is replaced in the same
        # generation). The next generation event belongs to a later fault.
        fault.outcome = "no new generation"
        return fault
    if new_gen_event is None:
        giveups = _of(after, "giveup")
        fault.outcome = f"gave up: {giveups[0].get('reason')}" if giveups else "no new generation"
        return fault
    new_gen_event = _past_shrinks(events, new_gen_event)
    fault.new_gen = int(new_gen_event["gen"])
    by_phase = _by_phase(_phases(events, fault.new_gen))
    spawns = by_phase.get("process_start", {})
    trained_at = min((e["t"] for e in by_phase.get("first_step_done", {}).values()), default=None)
    if trained_at is not None:  # not a process started once the generation trained (elastic: a rejoin)
        spawns = {r: e for r, e in spawns.items() if e["t"] <= trained_at}
    t_from = t_stop if t_stop is not None else t_detect
    if spawns and t_from is not None:
        # Tiers 3-4: a spare may take the rank before the survivors have left the old generation.
        fault.process_start_s = max(0.0, max(e["t"] for e in spawns.values()) - t_from)
    fault.imports_s = _slowest(by_phase, "process_start", "imports_done")
    fault.comm_init_s = _slowest(by_phase, "comm_init_start", "comm_init_done")
    fault.state_load_s = _slowest(by_phase, "state_load_start", "state_load_done")
    fault.data_ready_s = _slowest(by_phase, "state_load_done", "data_ready")
    first_steps = by_phase.get("first_step_done", {})
    if first_steps:
        trained = max(e["t"] for e in first_steps.values())
        fault.total_s = trained - t_f
        batches = by_phase.get("data_ready", {})
        if batches:
            fault.first_step_s = trained - max(e["t"] for e in batches.values())
    loaded = by_phase.get("state_load_done", {})
    if loaded:
        fault.resumed_from_step = loaded.get(0, loaded[min(loaded)]).get("step")
    # What was done before the recovery: the step before the fault's, and what ranks that left the
    # old generation in-process (tiers 3-4) or the detection say they had completed.
    done = [fault.fault_step - 1] if fault.fault_step is not None else []
    done += [int(d["completed_step"]) for d in detections if d.get("completed_step") is not None]
    done += [
        int(e["completed_step"])
        for e in after
        if e["kind"] == "rank_phase"
        and e["phase"] == "recovery_start"
        and e.get("gen") == fault.old_gen
        and e.get("completed_step") is not None
    ]
    if done:
        fault.completed_before = max(done)
    if fault.completed_before is not None and fault.resumed_from_step is not None:
        fault.steps_lost = max(0, fault.completed_before - fault.resumed_from_step)
    return fault


def _past_shrinks(events: list[dict[str, Any]], gen_event: dict[str, Any]) -> dict[str, Any]:
    """The generation a fault's recovery trained in: ``gen_event``'s, or, where that one never trained
    and an elastic shrink followed it (no replacement came for the lost rank), the shrink's."""
    while not any(e["phase"] == "first_step_done" for e in _phases(events, int(gen_event["gen"]))):
        later = [
            e for e in events if e["kind"] == "generation" and int(e["gen"]) == int(gen_event["gen"]) + 1
        ]
        if not later or later[0].get("reason") != "shrink":
            break
        gen_event = later[0]
    return gen_event


def _by_phase(phase_events: Iterable[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """{phase: {rank: event}}; a phase a rank reports twice in one generation keeps the first."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for event in phase_events:
        out.setdefault(event["phase"], {}).setdefault(int(event["rank"]), event)
    return out


def _slowest(by_phase: dict[str, dict[int, dict[str, Any]]], start: str, end: str) -> float | None:
    """Max over ranks that reported both phases of ``end.t - start.t``; ``None`` if no rank did."""
    starts, ends = by_phase.get(start, {}), by_phase.get(end, {})
    spans = [ends[rank]["t"] - starts[rank]["t"] for rank in starts.keys() & ends.keys()]
    return max(spans) if spans else None


def _median_step_time(losses: list[dict[str, Any]], fault_times: list[float]) -> float | None:
    """Median time between consecutive loss records one step apart with no fault or generation between."""
    gaps = []
    for prev, cur in itertools.pairwise(losses):
        if "t" not in prev or "t" not in cur or int(cur["step"]) != int(prev["step"]) + 1:
            continue
        if any(prev["t"] < t <= cur["t"] for t in fault_times):
            continue
        gaps.append(cur["t"] - prev["t"])
    return statistics.median(gaps) if gaps else None


# --- formatting --------------------------------------------------------------------------------------

_TIME_COLUMNS = (
    ("detect", "detection_s"),
    ("stop", "stop_s"),
    ("spawn", "process_start_s"),
    ("import", "imports_s"),
    ("comm", "comm_init_s"),
    ("load", "state_load_s"),
    ("data", "data_ready_s"),
    ("total", "total_s"),
)
_LEGEND = (
    "fault: the cause as observed @ the rank or process it hit. injected: what the product injected",
    "(type/phase), '-' for a fault from outside. seconds; '-': a phase this tier skips. detect: fault ->",
    "detected ('-' for a fault from outside: its moment is unknown, its times count from its first",
    "sign). stop: -> old ranks stopped. spawn: -> last new process started. import, comm, load: the",
    "slowest rank's imports, communicator init, state load. data: state loaded -> first batch. total:",
    "fault -> first completed step after it. lost: steps completed before the fault computed again.",
)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _opt(value: Any) -> str:
    return "-" if value is None else str(value)


def _injected_cell(f: FaultRecovery) -> str:
    if f.injected_by is None:
        return "-"
    return f.fault_type if f.phase is None else f"{f.fault_type}/{f.phase}"


def _fault_table(faults: list[FaultRecovery]) -> list[str]:
    if not faults:
        return ["faults: none"]
    header = ["#", "fault", "step", "injected", "by", *(name for name, _ in _TIME_COLUMNS), "lost"]
    rows: list[list[str]] = []
    for f in faults:
        cells = [
            str(f.index),
            f.name,
            _opt(f.fault_step),
            _injected_cell(f),
            _opt(f.detected_by),
            *(_secs(getattr(f, attr)) for _, attr in _TIME_COLUMNS),
            _opt(f.steps_lost),
        ]
        rows.append(cells)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    numeric_from = 5  # text columns are left-aligned, the rest right-aligned

    def line(cells: list[str]) -> str:
        n = numeric_from
        text = "  ".join(c.ljust(w) for c, w in zip(cells[:n], widths[:n], strict=True))
        numbers = " ".join(c.rjust(w) for c, w in zip(cells[n:], widths[n:], strict=True))
        return f"{text}  {numbers}".rstrip()

    out = ["faults:", line(header)]
    for f, cells in zip(faults, rows, strict=True):
        if f.new_gen is None:
            # No later generation: the timings up to the stop are real, the rest never happened.
            cut = numeric_from + 2
            out.append(line(cells[:cut] + [""] * (len(header) - cut)) + "  " + f.outcome)
        elif not f.recovered:
            out.append(line(cells) + "  " + f.outcome)
        else:
            out.append(line(cells))
    out.extend(_LEGEND)
    return out


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _footer(s: JobSummary) -> list[str]:
    steps = _opt(s.steps_done)
    recovering = [f.total_s for f in s.faults if f.total_s is not None]
    return [
        "",
        f"tier {_opt(s.tier)}, world size {_opt(s.world_size)}",
        f"wall time        {_secs(s.wall_s)} s",
        f"steps done       {steps}",
        f"median step      {_secs(s.step_time_s)} s (consecutive steps with no fault between)",
        f"startup          {_secs(s.startup_s)} s (job start -> the job's first completed step)",
        *_fault_count_lines(s),
        f"recoveries       {len(recovering)}, {_secs(sum(recovering))} s (fault -> first step after it)",
        *_first_step_lines(s),
        f"goodput          {_percent(s.goodput)} = steps done x median step / wall time",
        f"ML goodput       {_percent(s.ml_goodput)} = steps kept / steps computed ({s.steps_lost} lost)",
        f"generations      {s.generations}",
        *_width_lines(s),
        *_verification_lines(s),
        f"exit status      {ending(s)}",
    ]


def slowest_first_step(s: JobSummary) -> float | None:
    """The slowest recovery's first step after it (``first_step_s``), None without one."""
    return max((f.first_step_s for f in s.faults if f.first_step_s is not None), default=None)


def first_step_ratio(s: JobSummary) -> float | None:
    """The slowest first step after a recovery, in median steps (None: no recovery, or no median)."""
    slowest = slowest_first_step(s)
    if slowest is None or not s.step_time_s:
        return None
    return slowest / s.step_time_s


def _first_step_lines(s: JobSummary) -> list[str]:
    ratio = first_step_ratio(s)
    if ratio is None:
        return []
    # The slowest recovery's: its last rank's first batch -> every rank's first step done
    return [
        f"first step after {_secs(slowest_first_step(s))} s = {ratio:.2f} x the median step "
        "(the slowest recovery's)"
    ]


def _fault_count_lines(s: JobSummary) -> list[str]:
    if not s.faults:
        return []
    injected = sum(f.injected_by is not None for f in s.faults)
    ranks = sum(f.what in ("rank", "node") for f in s.faults)
    return [
        f"faults           {len(s.faults)}: {len(s.faults) - injected} from outside, {injected} injected; "
        f"{ranks} of ranks or nodes, {len(s.faults) - ranks} of other processes"
    ]


def _verification_lines(s: JobSummary) -> list[str]:
    """Tier 4: how many restores were verified against the recorded fingerprints, and each source a
    restore rejected (never trained on: that restore planned again without it)."""
    if not s.restores_verified and not s.rejected:
        return []
    rejected = f"; {len(s.rejected)} source(s) rejected, not trained on:" if s.rejected else ""
    return [
        f"verified         {s.restores_verified} restore(s) from memory matched the recorded state{rejected}",
        *(f"  rejected       {line}" for line in s.rejected),
    ]


def _width_lines(s: JobSummary) -> list[str]:
    """Elastic HSDP: the time at each data-parallel width and the resizes (none if it never resized)."""
    if not s.width_s:
        return []
    widths = ", ".join(f"{width} ranks {_secs(secs)} s" for width, secs in s.width_s.items())
    resizes = ", ".join(f"{reason} to {width} in gen {gen}" for reason, gen, width in s.resizes)
    return [f"widths           {widths} (elastic: {resizes})"]
