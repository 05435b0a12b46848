"""Elastic HSDP: a rank lost with no replacement takes its replica out; the job trains on and grows back.

Units: the shrink/grow rules, the store's per-generation set of training ranks, the fit loop's
micro-batch counters at another accumulation, the config checks. Then two jobs on CPU ranks,
each against its fault-free run: the same samples in every optimizer step (each once), the
loss curve within ``LOSS_RTOL`` (not bitwise: a narrower job reduces in another order), the
final weights and optimizer state within ``STATE_ATOL``:

- HSDP 3x1 on 3 ranks, 16 steps: rank 2's device is lost at step 4 and comes back after step 7:
  the job trains the steps between on 2 replicas (3 micro-batches of 2 per rank for the global
  batch of 12, not 2), then rank 2 rejoins with its state from a live replica.
- HSDP 2x2 on 4 ranks: rank 3's device is lost at step 5 for good: rank 2 stands by, ranks 0
  and 1 finish the job as one replica (rank 1 killed there too: with no replica left, from the
  last disk checkpoint); rank 2 exits when it ends.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoint_utils import flatten, load_full_checkpoint
from conftest import TINY_HSDP_REFERENCE, launch_job
from test_agent import events_of, job_processes

from ckless_lightning.comm import Heartbeat, JobStore
from ckless_lightning.record.loss_log import read_losses
from ckless_lightning.record.summary import summarize_run
from ckless_lightning.recovery.elastic import ElasticPolicy, StandbyEnded
from ckless_lightning.recovery.session import GenerationSession, JobGaveUp
from ckless_lightning.runtime.checkpointing import checkpoint_name
from ckless_lightning.training._lightning_compat import rescale_micro_batches

STEPS = 12  # the 2x2 job (TINY_HSDP_REFERENCE's length)
TRIPLE_STEPS = 20  # the 3x1 job: room for the rejoin (a slow hand-over took 1.2 s) before the last step
LOSS_RTOL = 1e-4  # per step, relative; measured: at most 1.1e-7 (the steps that change width)
STATE_ATOL = 1e-4  # final weights and Adam moments; measured: at most ~1e-7
ELASTIC = (
    "tier=4",
    "elastic.enabled=true",
    "replication.source=hsdp",
    "agent.replace_timeout=2",
    "data.record_samples=true",
    "checkpoint.every_n_steps=0",
)
TRIPLES = (  # 3x1 on 3 ranks; global batch 12 at widths 3 and 2 (micro-batches of 2)
    "cluster.nproc_per_node=3",
    "cluster.replicate=3",
    "trainer.global_batch_size=12",
    "data.micro_batch_size=2",
)
TRIPLES_REFERENCE = (
    "recipe=llama3_tiny",
    f"trainer.max_steps={TRIPLE_STEPS}",
    "tier=4",
    "replication.source=hsdp",
    "checkpoint.every_n_steps=0",
    "data.record_samples=true",
    *TRIPLES,
)


# -- units ---------------------------------------------------------------------------------------------


def test_a_broken_replica_leaves_and_a_whole_one_rejoins() -> None:
    policy = ElasticPolicy(replicate=3, shard=2, min_replicas=1, replace_timeout_s=1.0, max_steps=20)
    full = tuple(range(6))
    assert policy.without(full, {3}) == (0, 1, 4, 5)  # replica 1 (ranks 2, 3) leaves
    assert policy.mesh((0, 1, 4, 5)) == (2, 2)
    assert policy.without((0, 1, 4, 5), {0, 5}) is None  # no replica left: wait instead
    assert ElasticPolicy(replicate=3, shard=2, min_replicas=2).without(full, {0, 5}) is None
    assert policy.without(full, {0, 1}) == (2, 3, 4, 5)
    assert policy.with_replica((0, 1, 4, 5), policy.replica_of(3)) == full
    assert policy.may_grow(17) and not policy.may_grow(19)  # no rejoin for the final step


def test_the_store_fixes_each_generations_training_ranks_once() -> None:
    store = JobStore.host("127.0.0.1", 0, secret="elastic-test")
    assert store.active_ranks(0, 4) == (0, 1, 2, 3)  # never resized: every rank
    assert store.propose_active(2, (0, 1)) == (0, 1)  # a shrink fixes generation 2 before it exists
    assert store.propose_active(2, (0, 1, 2, 3)) == (0, 1)  # a second proposal does not change it
    assert store.active_ranks(1, 4) == (0, 1, 2, 3)  # generation 1 inherits generation 0's set
    assert store.active_ranks(2, 4) == (0, 1)
    assert store.active_ranks(5, 4) == (0, 1)  # later generations inherit the latest set
    assert store.propose_active(5, (0, 1, 2, 3)) == (0, 1)  # fixed at its first read
    assert store.standby([2, 3]) == {2: -1, 3: -1}
    store.set_standby(2, 5)
    assert store.standby([2, 3]) == {2: 5, 3: -1}
    assert store.generation() == 0
    assert store.advance_generation(0, world_size=4, restart=False) == 1
    assert store.restart_times(1) == []  # a resize does not spend the restart budget
    assert store.advance_generation(1, world_size=4) == 2 and len(store.restart_times(2)) == 1


def _standby_session(store: JobStore, **kwargs) -> GenerationSession:
    """Rank 2 of a 2x2 job whose generation 0 trains ranks 0 and 1 only."""
    store.generation()
    store.propose_active(0, (0, 1))
    for rank in (0, 1):
        store.set_rank_heartbeat(rank, Heartbeat(0, 3, time.time()))
    policy = ElasticPolicy(replicate=2, shard=2, replace_timeout_s=1.0, max_steps=20)
    return GenerationSession(store, rank=2, world_size=4, generation=0, elastic=policy, **kwargs)


def test_a_standby_rank_leaves_when_the_job_ends_and_gives_up_when_it_stalls() -> None:
    store = JobStore.host("127.0.0.1", 0, secret="elastic-standby-end")
    standing: list[int] = []
    session = _standby_session(store, on_standby=standing.append)
    store.mark_rank_finished(0)
    with pytest.raises(StandbyEnded, match="finished while it stood by"):
        session.join()
    assert standing == [0] and store.standby([2]) == {2: -1}  # said, then taken back
    # The training ranks' heartbeats never change again: bounded by comm.join_timeout_s.
    store = JobStore.host("127.0.0.1", 0, secret="elastic-standby-stall")
    session = _standby_session(store, join_timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(JobGaveUp, match=r"no rank of 0, 1 beat for comm.join_timeout_s=1.5 s"):
        session.join()
    assert 1.5 <= time.monotonic() - start < 10
    assert "stood by" in (store.giveup_reason() or "")


def test_a_barrier_shrinks_away_only_ranks_with_no_live_process() -> None:
    """Rank 2 of a 3x1 job grew it back (generation 1 trains 0, 1, 2) and waits in the barrier while
    ranks 0 and 1 still finish a step of generation 0 for longer than agent.replace_timeout (CI, a
    loaded host: the job shrank to rank 2 alone). Their watches beat meanwhile: they are waited for.
    A rank that does not beat (no process) is shrunk away."""
    policy = ElasticPolicy(replicate=3, shard=1, replace_timeout_s=0.3, max_steps=20)
    for silent in ((), (1,)):
        store = JobStore.host("127.0.0.1", 0, secret=f"elastic-barrier-{len(silent)}")
        store.generation()
        assert store.advance_generation(0, world_size=3, restart=False) == 1
        for rank in (0, 1):
            store.set_member(rank, 0)
        stop = threading.Event()

        def leave_late(store=store, silent=silent, stop=stop) -> None:
            ranks = [r for r in (0, 1) if r not in silent]
            waiter = store.another_client()
            end = time.monotonic() + (1.5 if not silent else 60)  # five replace_timeouts; or until stopped
            while time.monotonic() < end and not stop.is_set():
                for rank in ranks:
                    waiter.beat_leaving(rank)
                time.sleep(0.1)
            if not silent:
                for rank in ranks:
                    waiter.set_member(rank, 1)
                    waiter.join(1, 3)

        late = threading.Thread(target=leave_late)
        late.start()
        session = GenerationSession(
            store, rank=2, world_size=3, generation=1, join_timeout_s=3, elastic=policy
        )
        try:
            if not silent:
                assert session.join() == 1 and session.active == (0, 1, 2)
                assert store.generation() == 1
            else:
                with pytest.raises(JobGaveUp):  # rank 0 beats but never joins generation 2 here
                    session.join()
                assert store.generation() == 2 and store.active_ranks(2, 3) == (0, 2)
        finally:
            stop.set()
            late.join()


def _checkpoint(steps: int, micro: dict[str, int]) -> dict:
    progress = {"total": dict(micro), "current": dict(micro), "is_last_batch": False}
    optim = {"optimizer": {"step": {"total": {"ready": steps, "completed": steps}}}}
    return {
        "loops": {
            "fit_loop": {
                "epoch_loop.batch_progress": progress,
                "epoch_loop.automatic_optimization.optim_progress": optim,
            }
        }
    }


def test_the_fit_loops_micro_batch_counters_move_to_another_accumulation() -> None:
    # tier 4's snapshot: 7 steps of 2 micro-batches, the last one not yet "completed"
    checkpoint = _checkpoint(7, {"ready": 14, "started": 14, "processed": 14, "completed": 13})
    rescale_micro_batches(checkpoint, saved=2, now=3)
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["total"] == {"ready": 21, "started": 21, "processed": 21, "completed": 20}
    assert progress["current"] == progress["total"]
    rescale_micro_batches(checkpoint, saved=3, now=1)
    assert progress["total"] == {"ready": 7, "started": 7, "processed": 7, "completed": 6}
    with pytest.raises(ValueError, match="not between two steps"):
        rescale_micro_batches(_checkpoint(7, {"ready": 15, "completed": 15}), saved=2, now=3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("tier='3'", "cluster=local_cpu_hsdp", "elastic.enabled=true"), "needs tier=4"),
        (("tier='4'", "elastic.enabled=true", "replication.source=buddy"), "cluster.replicate >= 2"),
        (("tier='4'", "cluster=local_cpu_hsdp", "elastic.enabled=true", "elastic.min_replicas=2"), "1..1"),
        (
            ("tier='4'", "cluster=local_cpu_hsdp", "elastic.enabled=true", "trainer.global_batch_size=24"),
            r"trainer\.global_batch_size=24 does not divide into 2 replicas",
        ),
        (
            ("tier='4'", "cluster=local_cpu_hsdp", "elastic.enabled=true", "comm.join_timeout_s=30"),
            "agent.replace_timeout=60 must be shorter than comm.join_timeout_s=30",
        ),
        (("tier='4'", "fault=slot_lost", "fault.injected_by=inside"), "injected_by=outside"),
        (("tier='4'", "fault=slot_lost", "fault.return_step=3"), "must come after fault.step=6"),
        (("tier='4'", "fault=kill", "fault.return_step=12"), "read by fault.type=slot_lost only"),
        (("tier='2'", "fault=slot_lost"), "use tier=3 or 4"),
        (("elastic.min_replicas=0",), "elastic.min_replicas must be >= 1"),
        (("+elastic.spare=1",), "unknown config key.*elastic.spare"),
    ],
)
def test_bad_elastic_settings_are_refused_before_ranks_start(compose, overrides, message) -> None:
    from ckless_lightning.runtime.config import job_config_from_dict

    with pytest.raises(ValueError, match=message):
        job_config_from_dict(compose(*overrides))


# -- jobs ----------------------------------------------------------------------------------------------


def committed_samples(run: Path) -> dict[int, list[int]]:
    """Sample ids of each optimizer step over all ranks, from the generation that committed it (a step
    abandoned at one width is trained again, in a later generation, at another)."""
    records: dict[int, list[dict]] = {}
    for path in sorted((run / "samples").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records.setdefault(record["step"], []).append(record)
    out = {}
    for step, recs in records.items():
        last = max(r["gen"] for r in recs)
        out[step] = sorted(i for r in recs if r["gen"] == last for i in r["sample_ids"])
    return out


def assert_same_training_within_tolerance(run: Path, reference: Path, scratch: Path, steps: int) -> None:
    samples, expected = committed_samples(run), committed_samples(reference)
    assert sorted(expected) == list(range(1, steps + 1))
    assert samples == expected  # the same samples in every step, at every width
    every = [i for step in samples.values() for i in step]
    assert len(every) == len(set(every))  # each sample once
    losses, reference_losses = read_losses(run / "losses.jsonl"), read_losses(reference / "losses.jsonl")
    assert sorted(losses) == sorted(reference_losses)
    for step, loss in reference_losses.items():
        assert abs(losses[step] - loss) <= LOSS_RTOL * abs(loss), (step, losses[step], loss)
    final = checkpoint_name(steps)
    state = flatten(load_full_checkpoint(run / "checkpoints" / final, scratch))
    want = flatten(load_full_checkpoint(reference / "checkpoints" / final, scratch))
    assert state.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.allclose(state[key], value, rtol=0, atol=STATE_ATOL), key
        else:
            assert (
                state[key] == value if not isinstance(value, torch.Tensor) else torch.equal(state[key], value)
            )


def run_elastic(tmp_path: Path, data_cache: Path, *overrides: str) -> Path:
    run = tmp_path / "run"
    launch_job(run, data_cache, *ELASTIC, *overrides, timeout=600)
    summary = summarize_run(run)
    assert summary.exit_code == 0, summary.format()
    assert not job_processes(run)
    return run


def pids_by_rank(run: Path) -> dict[int, set[int]]:
    pids: dict[int, set[int]] = {}
    for event in events_of(run, "ranks_started"):
        for rank, pid in zip(event["ranks"], event["pids"], strict=True):
            pids.setdefault(rank, set()).add(pid)
    return pids


@pytest.mark.timeout(900)
def test_three_replicas_shrink_to_two_and_grow_back_with_the_same_samples(
    tmp_path, data_cache, reference_run
) -> None:
    reference = reference_run(*TRIPLES_REFERENCE)
    faults = ("fault=slot_lost", "fault.rank=2", "fault.step=4", "fault.return_step=7")
    run = run_elastic(tmp_path, data_cache, *TRIPLES, f"trainer.max_steps={TRIPLE_STEPS}", *faults)
    assert_same_training_within_tolerance(run, reference, tmp_path, TRIPLE_STEPS)
    shrink, grow = events_of(run, "elastic_resize")
    assert (shrink["reason"], shrink["active"], shrink["missing"], shrink["dp_size"]) == (
        "shrink",
        [0, 1],
        [2],
        2,
    )
    assert (grow["reason"], grow["active"], grow["returning"], grow["dp_size"]) == ("grow", [0, 1, 2], [2], 3)
    (returned,) = events_of(run, "slot_returned")
    assert returned["rank"] == 2 and returned["completed_step"] >= 7
    # The steps between trained at width 2 (3 micro-batches each), the rest at width 3 (2 each).
    widths = {}
    for path in (run / "samples").glob("rank*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            widths.setdefault(record["step"], set()).add(record["dp_size"])
    assert widths[1] == widths[3] == {3} and widths[TRIPLE_STEPS] == {3}
    assert any(widths[s] == {2} for s in range(4, 9))
    # The survivors kept their processes; rank 2 got two (the lost one, the returned one).
    pids = pids_by_rank(run)
    assert len(pids[0]) == len(pids[1]) == 1 and len(pids[2]) == 2
    restores = [e for e in events_of(run, "memory_restore") if e["gen"] == grow["gen"]]
    assert restores and all(e["sources"] == [[0, 2]] for e in restores)  # from a live replica
    summary = summarize_run(run)
    assert list(summary.width_s) == [3, 2] and all(s > 0 for s in summary.width_s.values())
    assert "widths           3 ranks" in summary.format()
    assert summary.steps_lost == 0


@pytest.mark.timeout(900)
def test_two_replicas_finish_as_one_when_the_lost_device_never_returns(
    tmp_path, data_cache, reference_run
) -> None:
    reference = reference_run(*TINY_HSDP_REFERENCE)
    # Rank 3's device is lost in step 5 for good; in step 8, at one replica, rank 1 is killed too:
    # no live copy of its shard is left, so that recovery falls back to the step-6 checkpoint.
    plan = "fault.plan=[{type:slot_lost,rank:3,step:5,injected_by:outside},{type:kill,rank:1,step:8}]"
    overrides = ("cluster=local_cpu_hsdp", f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=3")
    run = run_elastic(tmp_path, data_cache, *overrides, "fault=plan", plan)
    assert_same_training_within_tolerance(run, reference, tmp_path, STEPS)
    (shrink,) = events_of(run, "elastic_resize")
    assert (shrink["active"], shrink["replicas"], shrink["missing"]) == ([0, 1], 1, [3])
    standby = [e for e in events_of(run, "rank_phase") if e["phase"] == "standby"]
    assert {e["rank"] for e in standby} == {2}  # in the shrunk generation and the one after the kill
    assert not events_of(run, "slot_returned")
    fallback = [e for e in events_of(run, "memory_restore") if e["gen"] > shrink["gen"] and e["rank"] == 0]
    assert fallback[0]["reason"].startswith("no live copy of shard 1"), fallback
    assert fallback[0]["fallback"].endswith(checkpoint_name(6))
    pids = pids_by_rank(run)
    assert len(pids[0]) == len(pids[2]) == len(pids[3]) == 1 and len(pids[1]) == 2  # nothing replaced rank 3
    summary = summarize_run(run)
    assert list(summary.width_s) == [4, 2]
    assert summary.steps_lost == 1  # step 7, computed before the kill, again after the fallback
    assert "the job finished while it stood by" in (run / "rank_logs" / "rank2.log").read_text()
