"""Event log and recovery summary: exact figures from synthetic timelines, concurrent appends, torn lines."""

from __future__ import annotations

import json
import multiprocessing
from typing import Any

import pytest

from ckless_lightning.record.events import RANK_PHASES, EventLog, read_events, read_jsonl
from ckless_lightning.record.summary import summarize, summarize_run

PHASE_ORDER = RANK_PHASES


def ev(t: float, kind: str, source: str = "agent0", **fields: Any) -> dict[str, Any]:
    return {"t": t, "kind": kind, "source": source, **fields}


def phases(gen: int, rank: int, times: dict[str, float], load_step: int, first_step: int) -> list[dict]:
    """rank_phase events of one rank; ``times`` maps phase -> t (a phase left out is skipped)."""
    steps = {"state_load_done": load_step, "first_step_done": first_step}
    return [
        ev(times[p], "rank_phase", f"rank{rank}", rank=rank, gen=gen, phase=p, step=steps.get(p))
        for p in PHASE_ORDER
        if p in times
    ]


def cold_start(
    gen: int, rank: int, t0: float, imports: float, comm: float, load: float, data: float, step: float
):
    """Times of a full process start: each phase follows the previous one by the given duration."""
    t_imp = t0 + imports
    t_comm = t_imp + comm
    t_load = t_comm + load
    t_data = t_load + data
    return {
        "process_start": t0,
        "imports_done": t_imp,
        "comm_init_start": t_imp,
        "comm_init_done": t_comm,
        "state_load_start": t_comm,
        "state_load_done": t_load,
        "data_ready": t_data,
        "first_step_done": t_data + step,
    }


def loss_records(steps_and_times: list[tuple[int, float]]) -> list[dict]:
    return [{"step": s, "loss": 10.0 - s / 10, "t": t} for s, t in steps_and_times]


def gen0(n_ranks: int = 4) -> list[dict]:
    """Job start at t=1000 and a clean generation 0: every rank's first step done at t=1010."""
    events = [ev(1000.0, "job_start", tier=0, world_size=n_ranks, nnodes=1)]
    events.append(
        ev(
            1000.0,
            "ranks_started",
            gen=0,
            node=0,
            ranks=list(range(n_ranks)),
            pids=[1] * n_ranks,
            warm=[False] * n_ranks,
        )
    )
    for r in range(n_ranks):
        events += phases(0, r, cold_start(0, r, 1000.0, 3.0, 1.0, 1.0, 1.0, 4.0), 0, 1)
    return events


def tier0_events() -> list[dict]:
    """Rank 1 SIGKILLed in step 6 (backward); all ranks restart and reload the step-4 checkpoint."""
    events = gen0()
    events += [
        ev(1012.75, "fault_injected", "launcher", rank=1, step=6, phase="backward", fault_type="sigkill",
           injected_by="outside"),
        ev(1013.0, "fault_detected", by="agent0", rank=1, reason="exit", exit_code=-9, completed_step=5),
        ev(1014.0, "ranks_stopped", gen=0, node=0, ranks=[0, 1, 2, 3]),
        ev(1014.25, "generation", gen=1, reason="rank 1 exit -9"),
        ev(1014.5, "ranks_started", gen=1, node=0, ranks=[0, 1, 2, 3], pids=[5, 6, 7, 8], warm=[False] * 4),
    ]  # fmt: skip
    # (imports, comm, load, data) per rank; the slowest of each phase is a different rank.
    durations = {
        0: (3.0, 0.5, 2.25, 0.5),
        1: (3.0, 0.5, 2.0, 1.0),
        2: (3.5, 0.5, 2.0, 0.5),
        3: (3.0, 0.75, 2.0, 0.5),
    }
    for r, (imp, comm, load, data) in durations.items():
        events += phases(1, r, cold_start(1, r, 1014.5 + 0.25 * r, imp, comm, load, data, 0.5), 4, 5)
    events.append(ev(1025.0, "job_end", exit_code=0, final_step=10))
    return events


def tier0_losses() -> list[dict]:
    before = [(s, 1010.0 + 0.5 * (s - 1)) for s in range(1, 6)]  # steps 1..5, every 0.5 s
    after = [(s, 1022.0 + 0.5 * (s - 5)) for s in range(5, 11)]  # step 5 redone at 1022.0, then 6..10
    return loss_records(before + after)


def test_tier0_single_fault_every_figure():
    s = summarize(tier0_events(), tier0_losses())
    assert len(s.faults) == 1
    f = s.faults[0]
    assert (f.fault_type, f.rank, f.fault_step, f.phase, f.injected_by) == (
        "sigkill",
        1,
        6,
        "backward",
        "outside",
    )
    assert f.t_fault == 1012.75 and f.detected_by == "agent0"
    assert f.detection_s == 0.25
    assert f.stop_s == 1.0  # detection 1013.0 -> ranks_stopped 1014.0
    assert (f.old_gen, f.new_gen) == (0, 1)
    assert f.process_start_s == 1.25  # stopped 1014.0 -> rank 3 spawned at 1015.25
    assert f.imports_s == 3.5  # rank 2
    assert f.comm_init_s == 0.75  # rank 3
    assert f.state_load_s == 2.25  # rank 0
    assert f.data_ready_s == 1.0  # rank 1
    assert f.total_s == 1022.0 - 1012.75  # ranks 2 and 3 finish their first step last
    assert f.first_step_s == 1022.0 - 1021.5  # from the last first batch (ranks 2 and 3)
    assert f.resumed_from_step == 4 and f.steps_lost == 1  # step 5 was redone
    assert f.recovered and f.outcome == "recovered"
    assert s.tier == 0 and s.world_size == 4
    assert s.wall_s == 25.0
    assert s.steps_done == 10
    assert s.step_time_s == 0.5  # the 10 s gap 5 -> 5 is excluded
    assert s.startup_s == 10.0
    assert s.goodput == 10 * 0.5 / 25.0  # productive step time over wall: start-up is not
    assert s.generations == 2
    assert (s.exit_code, s.giveup_reason) == (0, None)


def test_tier0_table_text():
    text = summarize(tier0_events(), tier0_losses()).format()
    assert max(len(line) for line in text.splitlines()) <= 100
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("#"))
    row = lines[lines.index(header) + 1]
    assert row.split() == ["1", "SIGKILL@1", "6", "sigkill/backward", "agent0",
                           "0.25", "1.00", "1.25", "3.50", "0.75", "2.25", "1.00", "9.25", "1"]  # fmt: skip
    # The first step after the recovery: ranks 2 and 3's first batch (1021.5) -> their step (1022.0)
    assert "first step after 0.50 s = 1.00 x the median step" in text
    assert "goodput          20.0%" in text
    assert "ML goodput       90.9% = steps kept / steps computed (1 lost)" in text
    assert "wall time        25.00 s" in text
    assert "exit status      0" in text
    assert "generations      2" in text


def test_hang_detected_without_injection():
    events = gen0()
    events += [
        # A hang on rank 2, noticed by the heartbeat watchdog; node 1's agent also reports it (same fault).
        ev(1050.0, "fault_detected", by="agent0", rank=2, reason="hang", exit_code=None, completed_step=7),
        ev(
            1050.5,
            "fault_detected",
            "agent1",
            by="agent1",
            rank=2,
            reason="exit",
            exit_code=-9,
            completed_step=7,
        ),
        ev(1052.0, "ranks_stopped", gen=0, node=0, ranks=[0, 1, 2, 3]),
        ev(1052.0, "generation", gen=1, reason="rank 2 hang"),
    ]
    for r in range(4):
        events += phases(1, r, cold_start(1, r, 1053.0, 3.0, 1.0, 2.0, 1.0, 1.0), 5, 6)
    events.append(ev(1070.0, "job_end", exit_code=0, final_step=10))
    s = summarize(events)
    assert len(s.faults) == 1
    f = s.faults[0]
    assert (f.fault_type, f.rank, f.phase, f.injected_by) == ("hang", 2, None, None)
    assert f.fault_step == 8  # last completed step 7: the hang was in step 8
    assert f.detected_by == "agent0" and f.cause == "hang"
    assert f.detection_s is None  # nobody injected it: when it began is not known
    assert f.stop_s == 2.0 and f.process_start_s == 1.0
    assert (f.imports_s, f.comm_init_s, f.state_load_s, f.data_ready_s) == (3.0, 1.0, 2.0, 1.0)
    assert f.total_s == 1061.0 - 1050.0
    assert f.resumed_from_step == 5 and f.steps_lost == 2  # steps 6 and 7 redone
    # No losses given: steps from job_end, no step time, so no goodput.
    assert s.steps_done == 10 and s.step_time_s is None and s.goodput is None
    assert "hang@2" in s.format()


def test_gave_up():
    events = gen0()
    events += [
        ev(1012.0, "fault_injected", "rank3", rank=3, step=3, phase="forward", fault_type="exception",
           injected_by="inside"),
        ev(1012.5, "fault_detected", by="agent0", rank=3, reason="exit", exit_code=1, completed_step=2),
        ev(1013.0, "ranks_stopped", gen=0, node=0, ranks=[0, 1, 2, 3]),
        ev(1013.0, "giveup", reason="fault budget spent (0 restarts)", exit_code=1),
        ev(1013.5, "job_end", exit_code=1, final_step=2),
    ]  # fmt: skip
    s = summarize(events, loss_records([(1, 1010.0), (2, 1011.0)]))
    f = s.faults[0]
    assert f.new_gen is None and not f.recovered
    assert f.outcome == "gave up: fault budget spent (0 restarts)"
    assert (f.detection_s, f.stop_s) == (0.5, 0.5)
    assert None is f.process_start_s is f.imports_s is f.total_s is f.resumed_from_step is f.steps_lost
    assert s.wall_s == 13.5 and s.steps_done == 2 and s.step_time_s == 1.0 and s.startup_s == 10.0
    assert s.goodput == 2 * 1.0 / 13.5
    assert (s.exit_code, s.giveup_reason, s.generations) == (1, "fault budget spent (0 restarts)", 1)
    text = s.format()
    row = next(line for line in text.splitlines() if line.startswith("1 "))
    assert row.split()[:7] == ["1", "exit(1)@3", "3", "exception/forward", "agent0", "0.50", "0.50"]
    assert row.endswith("gave up: fault budget spent (0 restarts)")
    assert "exit status      1 (gave up: fault budget spent (0 restarts))" in text


def test_two_faults_warm_spare_then_in_process():
    """Fault 1: rank 1 killed in step 3, a warm spare takes its rank and gets its shard from a peer (no
    steps lost). Fault 2: an exception in rank 2 in step 7; everybody recovers in-process from the step-5
    checkpoint (no process start, no stop). Losses continue step by step across fault 1."""
    events = gen0()
    events += [
        ev(1011.5, "fault_injected", "launcher", rank=1, step=3, phase="optimizer_step", fault_type="sigkill",
           injected_by="outside"),
        ev(1011.75, "fault_detected", by="agent0", rank=1, reason="exit", exit_code=-9, completed_step=2),
        ev(1012.0, "ranks_stopped", gen=0, node=0, ranks=[1]),
        ev(1012.0, "generation", gen=1, reason="rank 1 exit -9"),
        ev(1012.25, "ranks_started", gen=1, node=0, ranks=[1], pids=[9], warm=[True]),
    ]  # fmt: skip
    for r in range(4):
        times = {"comm_init_start": 1012.25, "comm_init_done": 1012.5}
        if r == 1:  # the warm spare: given its rank at 1012.25, imports already done
            times |= {"process_start": 1012.25, "imports_done": 1012.25}
        times |= {"state_load_start": 1012.5, "state_load_done": 1013.0 if r == 1 else 1012.5}
        times |= {"data_ready": 1013.25, "first_step_done": 1013.5}
        events += phases(1, r, times, 2, 3)
    events += [
        ev(1015.25, "fault_injected", "rank2", rank=2, step=7, phase="forward", fault_type="exception",
           injected_by="inside"),
        ev(1015.25, "rank_phase", "rank2", rank=2, gen=1, phase="recovery_start", own=True,
           error="RuntimeError: injected", completed_step=6),
        ev(1015.5, "generation", gen=2, reason="rank 2 exception"),
    ]  # fmt: skip
    for r in range(4):
        times = {"comm_init_start": 1015.75, "comm_init_done": 1016.0, "state_load_start": 1016.0}
        times |= {
            "state_load_done": 1017.0,
            "data_ready": 1017.25,
            "first_step_done": 1017.75 + 0.25 * (r == 3),
        }
        events += phases(2, r, times, 5, 6)
    events.append(ev(1020.0, "job_end", exit_code=0, final_step=8))
    steps = [(1, 1010.0), (2, 1011.0), (3, 1013.5), (4, 1014.0), (5, 1014.5), (6, 1015.0)]
    losses = loss_records([*steps, (6, 1018.0), (7, 1018.75), (8, 1019.5)])
    s = summarize(events, losses)
    assert len(s.faults) == 2
    f1, f2 = s.faults
    assert (f1.index, f1.fault_type, f1.rank, f1.fault_step, f1.phase) == (
        1,
        "sigkill",
        1,
        3,
        "optimizer_step",
    )
    assert (f1.detection_s, f1.stop_s, f1.process_start_s, f1.imports_s) == (0.25, 0.25, 0.25, 0.0)
    assert (f1.comm_init_s, f1.state_load_s, f1.data_ready_s) == (0.25, 0.5, 0.75)
    assert f1.total_s == 2.0 and (f1.old_gen, f1.new_gen) == (0, 1)
    assert f1.resumed_from_step == 2 and f1.steps_lost == 0
    assert (f2.index, f2.fault_type, f2.rank, f2.fault_step, f2.injected_by) == (
        2,
        "exception",
        2,
        7,
        "inside",
    )
    assert f2.detected_by == "rank2" and f2.detection_s == 0.0 and f2.cause == "exception"
    assert None is f2.stop_s is f2.process_start_s is f2.imports_s
    assert (f2.comm_init_s, f2.state_load_s, f2.data_ready_s) == (0.25, 1.0, 0.25)
    assert f2.total_s == 2.75 and (f2.old_gen, f2.new_gen) == (1, 2)
    assert f2.resumed_from_step == 5 and f2.steps_lost == 1
    # Gaps: 1->2 1.0; 2->3 spans fault 1 (excluded: with it the median would be 0.75); 3->4, 4->5,
    # 5->6 0.5; 6->6 is a redo; 6->7, 7->8 0.75.
    assert s.step_time_s == 0.625
    assert s.steps_done == 8 and s.wall_s == 20.0 and s.startup_s == 10.0
    assert s.goodput == 8 * 0.625 / 20.0 == 0.25
    assert s.ml_goodput == 8 / 9  # step 6 computed twice
    assert s.generations == 3
    rows = [line.split() for line in s.format().splitlines() if line[:2] in ("1 ", "2 ")]
    assert rows[1] == ["2", "exception@2", "7", "exception/forward", "rank2",
                       "0.00", "-", "-", "-", "0.25", "1.00", "0.25", "2.75", "1"]  # fmt: skip


def test_an_exit_the_agent_reports_after_moving_the_job_on_is_its_detection():
    """Tiers 3-4: the agent sees a killed rank exit before any survivor notices, moves the job on
    (``generation``) and then reports it (``fault_detected`` of the dead process's generation)."""
    events = gen0()
    events += [
        ev(1011.5, "fault_injected", "rank1", rank=1, step=3, phase="forward", fault_type="kill",
           injected_by="inside"),
        ev(1011.6, "generation", gen=1, reason="fault"),
        ev(1011.61, "fault_detected", by="agent0", rank=1, reason="exit", exit_code=-9, completed_step=2,
           gen=0),
        ev(1011.62, "ranks_started", gen=1, node=0, ranks=[1], pids=[9], warm=[True]),
    ]  # fmt: skip
    for r in range(4):
        times = {"comm_init_start": 1012.0, "comm_init_done": 1012.25, "state_load_start": 1012.25}
        times |= {"state_load_done": 1012.5, "data_ready": 1012.75, "first_step_done": 1013.0}
        events += phases(1, r, times, 2, 3)
    events.append(ev(1014.0, "job_end", exit_code=0, final_step=3))
    (fault,) = summarize(events, loss_records([(1, 1010.0), (2, 1011.0), (3, 1013.0)])).faults
    assert fault.detected_by == "agent0" and round(fault.detection_s, 6) == 0.11
    assert fault.completed_before == 2 and fault.steps_lost == 0 and fault.total_s == 1.5


def test_fault_during_recovery_is_superseded():
    """Rank 1 dies again while starting up (heartbeat step -1: no step known); fault 1 never completes."""
    events = gen0()
    events += [
        ev(1011.0, "fault_injected", "launcher", rank=1, step=2, phase="forward", fault_type="sigkill",
           injected_by="outside"),
        ev(1011.5, "fault_detected", by="agent0", rank=1, reason="exit", exit_code=-9, completed_step=1),
        ev(1011.5, "generation", gen=1, reason="rank 1 exit"),
        ev(1012.0, "rank_phase", "rank1", rank=1, gen=1, phase="process_start", step=None),
        ev(1013.0, "fault_detected", by="agent0", rank=1, reason="exit", exit_code=1, completed_step=-1),
        ev(1013.5, "generation", gen=2, reason="rank 1 exit"),
        ev(1014.0, "rank_phase", "rank1", rank=1, gen=2, phase="first_step_done", step=2),
        ev(1015.0, "job_end", exit_code=0, final_step=2),
    ]  # fmt: skip
    f1, f2 = summarize(events).faults
    assert f1.total_s is None and f1.outcome == "superseded by fault 2"
    assert f1.process_start_s == 0.5  # from detection: no ranks_stopped
    assert (
        f2.fault_type == "exit(1)" and f2.fault_step is None and f2.total_s == 1.0 and f2.steps_lost is None
    )


def test_a_start_over_is_the_recovery_of_the_fault_that_lost_the_state():
    """Tier 4: ranks 0 and 1 (a rank and its buddy) SIGKILLed; generation 1 finds rank 0's state held
    nowhere and no disk checkpoint, so every rank leaves it to start over (``start_over``). The two
    kills are the faults; the start-over is no third one, and the recovery ends at generation 2's
    first step."""
    events = gen0()
    leave = {"phase": "recovery_start", "own": False}
    events += [
        ev(1011.0, "rank_phase", "rank2", rank=2, gen=0, error="RuntimeError: Connection closed by peer",
           completed_step=3, **leave),
        ev(1011.0, "generation", "rank2", gen=1, reason="fault"),
        ev(1011.1, "fault_detected", by="agent0", rank=0, reason="exit", exit_code=-9, failed_ranks=[0, 1],
           completed_step=3, gen=0),
        ev(1011.1, "fault_detected", by="agent0", rank=1, reason="exit", exit_code=-9, failed_ranks=[0, 1],
           completed_step=3, gen=0),
        *[ev(1012.0, "rank_phase", f"rank{r}", rank=r, gen=1, error="StartOver: tier 4: ...",
             completed_step=0, start_over=True, **leave) for r in range(4)],
        ev(1012.0, "generation", "rank3", gen=2, reason="fault"),
        *[ev(1013.0, "rank_phase", f"rank{r}", rank=r, gen=2, phase="first_step_done", step=1)
          for r in range(4)],
        ev(1015.0, "job_end", exit_code=0, final_step=12),
    ]  # fmt: skip
    summary = summarize(events)
    assert [f.name for f in summary.faults] == ["SIGKILL@0", "SIGKILL@1"], summary.format()
    assert summary.faults[1].total_s == pytest.approx(1.9)  # its detection -> generation 2's first step


def test_no_faults_and_empty():
    s = summarize([*gen0(), ev(1020.0, "job_end", exit_code=0, final_step=20)],
                  loss_records([(i, 1010.0 + 0.5 * (i - 1)) for i in range(1, 21)]))  # fmt: skip
    assert s.faults == [] and s.goodput == 20 * 0.5 / 20.0 == 0.5 and s.ml_goodput == 1.0
    assert "faults: none" in s.format()
    empty = summarize([])
    assert empty.wall_s is None and empty.exit_code is None and empty.generations == 0
    assert "unknown (no job_end event" in empty.format()


# --- EventLog ----------------------------------------------------------------------------------------


def _writer(path: str, writer: int, count: int) -> None:
    log = EventLog(path, f"rank{writer}")
    for i in range(count):
        log.emit(
            "rank_phase", rank=writer, gen=0, phase="process_start", step=i, pad="x" * (200 + 7 * i % 1500)
        )


def test_concurrent_appends_never_interleave(tmp_path):
    path = tmp_path / "sub" / "events.jsonl"  # parent created on first emit
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 500)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    lines = path.read_text().splitlines()
    assert len(lines) == 2000
    records = [json.loads(line) for line in lines]
    assert sorted((r["rank"], r["step"]) for r in records) == [(w, i) for w in range(4) for i in range(500)]
    assert all(r["source"] == f"rank{r['rank']}" and r["kind"] == "rank_phase" for r in records)
    assert len(read_events(path)) == 2000


def test_emit_record_and_limits(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", "agent0")
    rec = log.emit("ranks_started", t=123.5, gen=0, node=0, ranks=[0], pids=[42], warm=[False])
    assert rec == {"t": 123.5, "kind": "ranks_started", "source": "agent0", "gen": 0, "node": 0, "ranks": [0],
                   "pids": [42], "warm": [False]}  # fmt: skip
    assert read_events(log.path) == [rec]
    with pytest.raises(ValueError, match="under 3072 bytes"):
        log.emit("giveup", reason="x" * 4000, exit_code=1)
    log.emit("node_rejoined", node=1, gen=2)  # kinds beyond the documented ones are allowed
    assert [e["kind"] for e in read_events(log.path)] == ["ranks_started", "node_rejoined"]


def test_read_events_sorts_and_handles_torn_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    good = [json.dumps(ev(t, "generation", gen=i, reason="r")) for i, t in enumerate((3.0, 1.0, 2.0))]
    path.write_text("\n".join(good) + '\n{"t": 4.0, "kind": "gen')  # a writer died mid-line
    assert [e["t"] for e in read_events(path)] == [1.0, 2.0, 3.0]
    path.write_text(good[0] + '\n{"t": 4.0, "ki\n' + good[1] + "\n")
    with pytest.raises(ValueError, match=r"events\.jsonl:2: not a JSON record"):
        read_events(path)
    assert read_events(tmp_path / "missing.jsonl") == []


def test_summarize_run_reads_both_files(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", "agent0")
    for e in tier0_events():
        log.emit(e["kind"], **{k: v for k, v in e.items() if k not in ("kind", "source")})
    (tmp_path / "losses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tier0_losses()))
    assert read_jsonl(tmp_path / "losses.jsonl") == tier0_losses()
    assert summarize_run(tmp_path) == summarize(tier0_events(), tier0_losses())


def test_a_step_rolled_back_by_every_rank_counts_as_lost():
    """Tier 4: rank 1 is killed in step 5 after the commit; its peers completed step 5 and say so as
    they leave the generation, but its buddy's copy holds step 4, so every rank resumes from step 4:
    step 5 is redone, one step lost (not 0, as ``fault_step - 1 - resumed`` would say)."""
    events = gen0()
    events += [
        ev(1012.0, "fault_injected", "rank1", rank=1, step=5, phase="optimizer", fault_type="kill",
           injected_by="inside"),
        ev(1012.1, "generation", "rank0", gen=1, reason="fault"),
    ]  # fmt: skip
    for r in (0, 2, 3):
        events.append(
            ev(
                1012.05,
                "rank_phase",
                f"rank{r}",
                rank=r,
                gen=0,
                phase="recovery_start",
                step=None,
                completed_step=5,
            )
        )
    for r in range(4):
        times = {"comm_init_start": 1012.2, "comm_init_done": 1012.3, "state_load_start": 1012.3}
        times |= {"state_load_done": 1012.5, "data_ready": 1012.6, "first_step_done": 1013.0}
        events += phases(1, r, times, 4, 5)
    events.append(ev(1016.0, "job_end", exit_code=0, final_step=8))
    (fault,) = summarize(events).faults
    assert (fault.fault_step, fault.completed_before, fault.resumed_from_step) == (5, 5, 4)
    assert fault.steps_lost == 1


def test_faults_from_outside_are_rows_and_the_ending_is_not_a_fault():
    """Tier 4, nothing injected: rank 1 SIGKILLed (its peers notice first, the agent reports it after
    the job moved on), the fork server SIGKILLed (replaced, no recovery); then SIGTERM: the ranks'
    generation move after ``interrupted`` is the job's end, not a fault."""
    events = gen0()
    events += [
        ev(1012.0, "rank_phase", "rank0", rank=0, gen=0, phase="recovery_start", own=False,
           error="RuntimeError: Connection closed by peer", completed_step=4),
        ev(1012.05, "generation", "rank0", gen=1, reason="fault"),
        ev(1012.3, "fault_detected", by="agent0", rank=1, reason="exit", exit_code=-9, completed_step=4,
           gen=0),
        ev(1013.0, "forkserver_lost", pid=77, reason="killed by SIGKILL", exit_code=-9),
        ev(1020.0, "interrupted", node=0, signal="SIGTERM"),
        ev(1020.1, "rank_phase", "rank2", rank=2, gen=1, phase="recovery_start", own=False,
           error="RuntimeError: Connection closed by peer", completed_step=9),
        ev(1020.2, "generation", "rank2", gen=2, reason="fault"),
        ev(1021.0, "job_end", exit_code=143, final_step=9),
    ]  # fmt: skip
    for r in range(4):
        times = {"comm_init_start": 1012.2, "comm_init_done": 1012.3, "state_load_start": 1012.3}
        times |= {"state_load_done": 1012.5, "data_ready": 1012.6, "first_step_done": 1013.5}
        events += phases(1, r, times, 4, 5)
    s = summarize(events)
    assert [f.name for f in s.faults] == ["SIGKILL@1", "SIGKILL@forkserver"], s.format()
    kill, server = s.faults
    assert kill.injected_by is None and kill.detection_s is None and kill.t_fault == 1012.0
    assert kill.detected_by == "rank0" and kill.total_s == 1.5 and kill.fault_step == 5
    assert not server.recovered and server.outcome.startswith("replaced")
    text = s.format()
    assert "recoveries       1, 1.50 s" in text and "faults           2: 2 from outside, 0 injected" in text
    assert "exit status      143 (stopped by SIGTERM" in text
