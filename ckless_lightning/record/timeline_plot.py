"""The picture of a run: ``<run_dir>/timeline.png``, drawn from ``events.jsonl`` and ``losses.jsonl``.

Upper panel: one lane per rank (and per spare pool, batch-cache reader and
agent where the log has their events) against wall-clock seconds since
``job_start``; each rank's start-up and recovery phases are coloured from its
``rank_phase`` events, faults are marked, and each recovery is shaded and
labelled with its ``total_s`` from :func:`~ckless_lightning.record.summary.summarize`
(so the picture agrees with the printed table). The top axis marks when each
step's final loss was logged. Beside it, a zoom on the longest recovery (else on
the end of start-up). Lower panel: the loss against the same wall-clock
axis (each record at its own ``t``); an earlier attempt of a step that was
computed again is drawn hollow; ``against`` overlays another run's losses, each
step placed at this run's time of that step. A leaf: matplotlib is imported
only inside :func:`render_timeline`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ckless_lightning.record.events import read_events
from ckless_lightning.record.faults import observed_faults
from ckless_lightning.record.loss_compare import LossComparison, compare_losses
from ckless_lightning.record.loss_log import read_loss_records, read_losses
from ckless_lightning.record.summary import FaultRecovery, JobSummary, summarize

__all__ = ["render_timeline"]

# category -> (colour, legend label)
_COLOURS = {
    "imports": ("#f4a261", "start-up: spawn + imports"),
    "waiting": ("#dedede", "waiting for peers"),
    "standby": ("#f1e3c8", "standing by (elastic)"),
    "comm": ("#9b5de5", "comm init"),
    "state": ("#277da1", "state load"),
    "data": ("#43aa8b", "data ready"),
    "first": ("#f9c74f", "first step"),
    "training": ("#95d5b2", "training"),
    "leaving": ("#e63946", "leaving the generation"),
    "finishing": ("#b5b5b5", "final save, exit"),
    "spare": ("#cde4f5", "spare ready"),
    "reader": ("#a8c5da", "reader running"),
    "forkserver": ("#d9c8e8", "fork server ready"),
}
# A rank_phase event starts this category (phases not listed leave the current one running).
_AFTER_PHASE = {
    "process_start": "imports",
    "spare_handed": "imports",
    "spare_ready": "waiting",
    "imports_done": "waiting",
    "recovery_start": "leaving",
    "generation_left": "waiting",
    "generation_joined": "comm",
    "resume_chosen": "comm",
    "comm_init_start": "comm",
    "comm_init_done": "state",
    "state_load_start": "state",
    "state_load_done": "data",
    "data_ready": "first",
    "first_step_done": "training",
    "standby": "standby",
}
# marker kind -> (marker, colour, size, legend label)
_MARKERS = {
    "injected": ("X", "#d00000", 9, "fault injected"),
    "outside": ("X", "#7b2cbf", 9, "fault from outside (its first sign)"),
    "process_fault": ("X", "#ff8800", 8, "fault on a spare / reader"),
    "detected": ("v", "black", 7, "fault detected (by this lane)"),
    "restarted": ("o", "#1d3557", 5, "reader restarted"),
    "giveup": ("s", "black", 7, "gave up"),
}


# --- lanes -------------------------------------------------------------------------------------------

Bar = tuple[str, float, float, str]  # lane, start, end, category
Mark = tuple[str, float, str]  # lane, t, marker kind


def _rank_bars(events: list[dict[str, Any]], rank: int, lane: str, t_end: float) -> list[Bar]:
    """The rank's coloured spans: each phase event starts a category; its process's end stops it."""
    marks: list[tuple[float, str | None, int | None]] = []  # t, category (None: process gone), gen
    for e in events:
        kind, t, gen = e["kind"], float(e["t"]), e.get("gen")
        if kind == "rank_phase" and e.get("rank") == rank and e.get("phase") in _AFTER_PHASE:
            marks.append((t, _AFTER_PHASE[e["phase"]], gen if e["phase"] == "process_start" else None))
        elif kind == "commit_votes" and e.get("rank") == rank:
            marks.append((t, "finishing", None))
        elif (
            (
                kind == "fault_injected"
                and e.get("rank") == rank
                and e.get("fault_type") in ("kill", "slot_lost")
            )
            or (kind == "fault_detected" and rank in (e.get("rank"), *e.get("failed_ranks", ())))
            or (kind == "ranks_stopped" and rank in e.get("ranks", ()))
            or (kind in ("rank_end", "rank_lost_after_end") and e.get("rank") == rank)
        ):
            marks.append((t, None, gen if gen is not None else -1))
    bars: list[Bar] = []
    current: str | None = None
    since, process_gen = 0.0, -1
    for t, category, gen in sorted(marks, key=lambda m: m[0]):
        if category is None and gen is not None and 0 <= gen < process_gen:
            continue  # about a process of an older generation than the one now running
        if category == "imports" and gen is not None:
            process_gen = gen
        if current is not None and t > since:
            bars.append((lane, since, t, current))
        current, since = category, t
    if current is not None and t_end > since:
        bars.append((lane, since, t_end, current))
    return bars


def _spare_bars(events: list[dict[str, Any]], t_end: float) -> list[Bar]:
    """One span per spare pid: preparing, then ready until handed a rank, lost, or the job's end."""
    started = {e["pid"]: float(e["t"]) for e in events if e["kind"] == "spare_started"}
    prepared = {e["pid"]: float(e["t"]) for e in events if e["kind"] in ("spare_prepared", "spare_ready")}
    ended: dict[int, float] = {}
    for e in events:
        if e["kind"] == "ranks_started":
            for pid, warm in zip(e.get("pids", ()), e.get("warm", ()), strict=False):
                if warm:
                    ended.setdefault(pid, float(e["t"]))
        elif e["kind"] == "spare_lost" or (e["kind"], e.get("target")) == ("process_fault_injected", "spare"):
            ended.setdefault(e.get("pid", -1), float(e["t"]))
    spans = sorted((t, pid) for pid, t in started.items())
    slots: list[float] = []  # the end of each sub-row's last span
    bars: list[Bar] = []
    for t0, pid in spans:
        t1 = ended.get(pid, t_end)
        slot = next((i for i, end in enumerate(slots) if end <= t0), len(slots))
        slots[slot : slot + 1] = [t1]
        lane = f"spares#{slot}"
        ready = prepared.get(pid, t1)
        bars += [(lane, t0, min(ready, t1), "imports"), (lane, min(ready, t1), t1, "spare")]
    return [b for b in bars if b[2] > b[1]]


def _fork_server_bars(events: list[dict[str, Any]], t_end: float) -> list[Bar]:
    """One lane per node's fork server: importing, then ready to fork until lost or the job's end."""
    agents = sorted({str(e["source"]) for e in events if e["kind"] == "forkserver_started"})
    bars: list[Bar] = []
    for agent in agents:
        lane = "fork server" if agents == ["agent0"] else f"fork server {agent[5:]}"
        mine = [e for e in events if e.get("source") == agent and e["kind"].startswith("forkserver_")]
        for start in (e for e in mine if e["kind"] == "forkserver_started"):
            pid, t0 = start["pid"], float(start["t"])
            ready = next(
                (float(e["t"]) for e in mine if e["kind"] == "forkserver_ready" and e["pid"] == pid), None
            )
            lost = next(
                (float(e["t"]) for e in mine if e["kind"] == "forkserver_lost" and e["pid"] == pid), t_end
            )
            t1 = min(ready if ready is not None else lost, lost)
            bars += [(lane, t0, t1, "imports"), (lane, t1, lost, "forkserver")]
    return [b for b in bars if b[2] > b[1]]


def _lane_of(source: str) -> str:
    """The lane of an event source: "rank3" -> "rank 3"; agents keep their name."""
    return f"rank {source[4:]}" if source.startswith("rank") else source


def _lanes(events: list[dict[str, Any]], t_end: float) -> tuple[list[str], list[Bar], list[Mark]]:
    """Lane names top to bottom, the bars and the markers (times absolute)."""
    start = next((e for e in events if e["kind"] == "job_start"), {})
    ranks = {int(e["rank"]) for e in events if e["kind"] == "rank_phase" and "rank" in e}
    ranks |= set(range(int(start.get("world_size") or 0)))
    names = [f"rank {r}" for r in sorted(ranks)]
    bars = [b for r in sorted(ranks) for b in _rank_bars(events, r, f"rank {r}", t_end)]
    spare_bars = _spare_bars(events, t_end)
    names += sorted({b[0] for b in spare_bars})
    bars += spare_bars
    fork_bars = _fork_server_bars(events, t_end)
    names += sorted({b[0] for b in fork_bars})
    bars += fork_bars
    marks: list[Mark] = []
    readers = sorted({int(e.get("node", 0)) for e in events if e["kind"] == "reader_started"})
    for node in readers:
        lane = "reader" if readers == [0] else f"reader {node}"
        names.append(lane)
        t0 = min(float(e["t"]) for e in events if e["kind"] == "reader_started" and e.get("node", 0) == node)
        bars.append((lane, t0, t_end, "reader"))
        marks += [
            (lane, float(e["t"]), "restarted")
            for e in events
            if e["kind"] == "reader_restarted" and e.get("node", 0) == node
        ]
    agents = sorted({e["source"] for e in events if str(e.get("source", "")).startswith("agent")})
    names += agents
    first_spare_lane = next((n for n in names if n.startswith("spares")), None)
    reader_lane = next((n for n in names if n.startswith("reader")), None)
    for e in events:
        t = float(e["t"])
        if e["kind"] == "fault_injected" and e.get("rank") is not None:
            marks.append((f"rank {e['rank']}", t, "injected"))
        elif e["kind"] == "process_fault_injected":
            fork_lane = next((n for n in names if n.startswith("fork server")), None)
            lane = {"spare": first_spare_lane, "reader": reader_lane, "forkserver": fork_lane}.get(
                e.get("target")
            )
            if lane is not None:
                marks.append((lane, t, "process_fault"))
        elif e["kind"] == "fault_detected":
            lane = _lane_of(str(e.get("by", "")))
            marks.append((lane if lane in names else f"rank {e.get('rank')}", t, "detected"))
        elif e["kind"] == "giveup" and e.get("source") in agents:
            marks.append((e["source"], t, "giveup"))
    fork_lane = next((n for n in names if n.startswith("fork server")), None)
    for fault in observed_faults(events):  # every fault the product did not inject, as observed
        if fault.injected is not None:
            continue
        if fault.what == "rank":
            lane = f"rank {fault.key}" if fault.key is not None else None
        elif fault.what == "node":
            lane = next((n for n in agents if n == f"agent{fault.key}"), None)
        else:
            lane = {"spare": first_spare_lane, "reader": reader_lane, "forkserver": fork_lane}[fault.what]
        if lane is not None:
            marks.append((lane, fault.t, "outside"))
    return names, bars, [m for m in marks if m[0] in names]


# --- drawing -----------------------------------------------------------------------------------------


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _title(run_dir: Path, s: JobSummary) -> str:
    total = sum(f.total_s for f in s.faults if f.total_s is not None)
    recovered = sum(1 for f in s.faults if f.recovered)
    wall = "-" if s.wall_s is None else f"{s.wall_s:.1f} s"
    return (
        f"{run_dir}\ntier {s.tier}, world size {s.world_size}, wall {wall}, {s.steps_done} steps   "
        f"goodput {_percent(s.goodput)}   ML goodput {_percent(s.ml_goodput)} ({s.steps_lost} lost)   "
        f"recoveries {recovered} ({total:.2f} s)"
    )


def _fault_name(f: FaultRecovery) -> str:
    step = "" if f.fault_step is None else f" step {f.fault_step}"
    injected = "" if f.injected_by is None else f" ({f.fault_type}, injected)"
    return f"#{f.index} {f.name}{injected}{step}"


def _step_ticks(final_t: dict[int, float], t0: float) -> tuple[list[float], list[str]]:
    """At most ~12 step labels at the time each step's final loss was logged."""
    steps = sorted(final_t)
    if not steps:
        return [], []
    stride = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 10**9) if len(steps) / s <= 12)
    shown = [s for s in steps if s % stride == 0 or s == steps[0]]
    return [final_t[s] - t0 for s in shown], [str(s) for s in shown]


def _zoom_window(events: list[dict[str, Any]], s: JobSummary, t0: float) -> tuple[float, float, str]:
    """The longest recovery (padded), else the end of the first start-up: (start, end, title), relative."""
    recovered = [f for f in s.faults if f.total_s is not None]
    if recovered:
        f = max(recovered, key=lambda f: f.total_s or 0.0)
        total = f.total_s or 0.0
        pad = max(0.3, 0.15 * total)
        return f.t_fault - t0 - pad, f.t_fault - t0 + total + pad, f"zoom: {_fault_name(f)}, {total:.2f} s"
    phases = [e for e in events if e["kind"] == "rank_phase" and e.get("gen") == 0]
    ready = [float(e["t"]) - t0 for e in phases if e["phase"] == "imports_done"]
    trained = [float(e["t"]) - t0 for e in phases if e["phase"] == "first_step_done"]
    if ready and trained:
        return min(ready) - 0.5, max(trained) + 0.5, "zoom: end of start-up, no faults"
    return 0.0, 1.0, "no faults"


def _draw_lanes(
    ax: Any, names: list[str], bars: list[Bar], marks: list[Mark], events: list[dict[str, Any]], t0: float
) -> None:
    row = {name: len(names) - 1 - i for i, name in enumerate(names)}
    for lane, a, b, category in bars:
        height = 0.3 if lane.startswith("spares#") else 0.6
        ax.barh(row[lane], b - a, left=a - t0, height=height, color=_COLOURS[category][0], lw=0)
    for lane, t, kind in marks:
        marker, colour, size, _ = _MARKERS[kind]
        ax.plot(t - t0, row[lane], marker=marker, color=colour, ms=size, mec="white", mew=0.5, zorder=5)
    for e in events:
        if e["kind"] == "generation":
            ax.axvline(float(e["t"]) - t0, color="#555555", lw=0.6, ls="--", zorder=0)
    ax.set_ylim(-0.6, len(names) + 0.6)  # headroom for the recovery labels
    ax.tick_params(labelsize=7)


def _draw_recoveries(
    axes: list[Any], label_ax: Any, s: JobSummary, t0: float, x_max: float, top: float
) -> None:
    """Shade each recovery (fault -> first step after it) on ``axes``; label it on ``label_ax``."""
    for i, f in enumerate(s.faults):
        x = f.t_fault - t0
        for ax in axes:
            ax.axvline(x, color="#d00000", lw=0.8, ls=":")
            if f.total_s is not None:
                ax.axvspan(x, x + f.total_s, color="#d00000", alpha=0.12, lw=0)
        if f.total_s is not None:
            label = f"{_fault_name(f)}: recovered in {f.total_s:.2f} s, {f.steps_lost} lost"
        else:
            label = f"{_fault_name(f)}: {f.outcome}"
        right = x > 0.6 * x_max
        label_ax.text(
            x + (f.total_s or 0.0) if right else x,
            top - 0.45 - 0.55 * (i % 2),
            label,
            fontsize=7.5,
            va="center",
            ha="right" if right else "left",
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "#d00000", "lw": 0.6},
        )


def _draw_losses(
    ax: Any,
    run_dir: Path,
    records: list[dict[str, Any]],
    t0: float,
    against: Path | None,
    comparison: LossComparison | None,
) -> None:
    """This run's losses at their own times (first attempts of redone steps hollow), the other run's over."""
    if not records:
        ax.text(0.5, 0.5, "no loss records (losses.jsonl)", transform=ax.transAxes, ha="center")
        return
    final_t = {int(r["step"]): float(r["t"]) for r in records}  # the last record of each step wins
    last_index = {int(r["step"]): i for i, r in enumerate(records)}
    final = [r for i, r in enumerate(records) if last_index[int(r["step"])] == i]
    earlier = [r for i, r in enumerate(records) if last_index[int(r["step"])] != i]
    ax.plot(
        [float(r["t"]) - t0 for r in final],
        [float(r["loss"]) for r in final],
        "-o",
        color="#1d3557",
        ms=2.5,
        lw=1.6,
        label=f"{run_dir.name} ({len(final)} steps)",
    )
    if earlier:
        ax.plot(
            [float(r["t"]) - t0 for r in earlier],
            [float(r["loss"]) for r in earlier],
            "o",
            mfc="none",
            mec="#888888",
            ms=5,
            label=f"first attempt of a redone step ({len(earlier)})",
        )
    if comparison is not None and against is not None:
        theirs = read_losses(against / "losses.jsonl")
        shared = sorted(s for s in theirs if s in final_t)
        verdict = comparison.describe("it").removeprefix("losses ")
        ax.plot(
            [final_t[s] - t0 for s in shared],
            [theirs[s] for s in shared],
            "--",
            color="#ff8800",
            lw=1.1,
            label=f"{against.name}, placed at this run's step times: {verdict}",
        )
        if comparison.first_difference is not None and comparison.first_difference in final_t:
            ax.axvline(final_t[comparison.first_difference] - t0, color="#ff8800", lw=0.8)
    ax.legend(fontsize=7, loc="lower left")


def _legend_handles(bars: list[Bar], marks: list[Mark], faults: bool) -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    used = {b[3] for b in bars}
    handles: list[Any] = [Patch(color=c, label=label) for k, (c, label) in _COLOURS.items() if k in used]
    handles += [
        Line2D([], [], ls="", marker=m, color=c, ms=s, label=label)
        for k, (m, c, s, label) in _MARKERS.items()
        if any(mk[2] == k for mk in marks)
    ]
    if faults:
        handles.append(Patch(color="#d00000", alpha=0.12, label="recovery: fault -> first step after it"))
    handles.append(Line2D([], [], color="#555555", lw=0.6, ls="--", label="new generation"))
    return handles


def render_timeline(
    run_dir: str | Path, out: str | Path | None = None, against: str | Path | None = None
) -> Path:
    """Draw ``<run_dir>``'s timeline to ``out`` (default ``<run_dir>/timeline.png``) and return its path.

    ``against``: another run dir whose losses are overlaid (and compared bitwise in the legend).
    Raises ``FileNotFoundError`` (an ``OSError``) naming a missing ``events.jsonl`` or the other
    run's ``losses.jsonl``, ``ValueError`` for an empty or corrupt log, ``ImportError`` without
    matplotlib, ``OSError`` if ``out`` cannot be written.
    """
    run_dir = Path(run_dir)
    events_path = run_dir / "events.jsonl"
    if not events_path.exists():
        raise FileNotFoundError(f"no events.jsonl: {events_path}")
    events = read_events(events_path)
    if not events:
        raise ValueError(f"no events in {events_path}")
    all_records = read_loss_records(run_dir / "losses.jsonl")
    summary = summarize(events, all_records)  # as launch.py prints it
    records = [r for r in all_records if "t" in r]  # the ones that can be placed in time
    other = None if against is None else Path(against)
    comparison = None if other is None else compare_losses(run_dir, other)

    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:  # leave an interactive user's backend alone
        matplotlib.use("Agg")
    from matplotlib.figure import Figure

    t0 = next((float(e["t"]) for e in events if e["kind"] == "job_start"), float(events[0]["t"]))
    t_end = max([float(events[-1]["t"]), *(float(r["t"]) for r in records)])
    names, bars, marks = _lanes(events, t_end)
    for f in summary.faults:  # the table's detection, also where a rank saw it first (tiers 3-4)
        if f.detected_by is not None and f.detection_s is not None and _lane_of(f.detected_by) in names:
            marks.append((_lane_of(f.detected_by), f.t_fault + f.detection_s, "detected"))
    top = len(names) + 0.6

    fig = Figure(figsize=(12, 3.4 + 0.3 * len(names)), dpi=85, layout="constrained")
    fig.suptitle(_title(run_dir, summary), fontsize=9)
    grid = fig.add_gridspec(2, 2, width_ratios=[3.2, 1], height_ratios=[1.0 + 0.2 * len(names), 1.4])
    upper = fig.add_subplot(grid[0, 0])
    zoom = fig.add_subplot(grid[0, 1], sharey=upper)
    lower = fig.add_subplot(grid[1, 0], sharex=upper)
    legend_ax = fig.add_subplot(grid[1, 1])
    legend_ax.axis("off")

    for ax in (upper, zoom):
        _draw_lanes(ax, names, bars, marks, events, t0)
    labels = ["spares" if n == "spares#0" else "" if n.startswith("spares#") else n for n in names]
    upper.set_yticks(range(len(names) - 1, -1, -1), labels, fontsize=8)
    zoom.tick_params(labelleft=False)
    upper.set_xlim(0, t_end - t0)
    _draw_recoveries([upper, lower, zoom], upper, summary, t0, t_end - t0, top)
    z0, z1, zoom_title = _zoom_window(events, summary, t0)
    zoom.set_xlim(z0, z1)
    zoom.set_title(zoom_title, fontsize=8)
    zoom.set_xlabel("seconds since job start", fontsize=7)

    final_t = {int(r["step"]): float(r["t"]) for r in records}
    steps_ax = upper.secondary_xaxis("top")
    ticks, tick_labels = _step_ticks(final_t, t0)
    steps_ax.set_xticks(ticks, tick_labels, fontsize=7)
    steps_ax.set_xlabel("step (when its final loss was logged)", fontsize=8)

    _draw_losses(lower, run_dir, records, t0, other, comparison)
    lower.set_ylabel("loss", fontsize=8)
    lower.set_xlabel("wall-clock seconds since job start (both left panels)", fontsize=8)
    lower.tick_params(labelsize=7)
    legend_ax.legend(
        handles=_legend_handles(bars, marks, bool(summary.faults)),
        loc="center",
        ncol=2,
        fontsize=7,
        frameon=False,
    )

    target = Path(out) if out is not None else run_dir / "timeline.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target)
    return target
