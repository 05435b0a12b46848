"""Verified restores (tier 4): every state a restore hands a rank matches the fingerprint its owner
recorded for that step, or it is rejected and never trained on.

Units: the fingerprint's two computations agree (per tensor on the tensors' devices, and in one
pass over a host copy), a rank's ring of records and the record its copies carry, the planner
without rejected sources. Then
the restore itself on 4 gloo ranks with buddy copies, each rank's state a known function of
(rank, step): a survivor whose live state no longer matches its label, a held copy whose loop
state was corrupted in host memory, a step with no record, and a rank with no record at all.
The end-to-end runs (a launched job, bitwise against the fault-free run) are in test_tier4.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import free_port, run_ranks

from ckless_lightning.comm import Generation, JobStore
from ckless_lightning.record.events import EventLog, read_events
from ckless_lightning.recovery.memory import MemoryRestore, StartOver
from ckless_lightning.recovery.verify import verify_restored
from ckless_lightning.replication import (
    FlatBuffer,
    RankReport,
    Rejected,
    Snapshot,
    SnapshotCopies,
    SourceMap,
    Transfer,
    buddy_sources,
)
from ckless_lightning.replication import fingerprint as fingerprint_module
from ckless_lightning.replication.buddy_links import BuddyLinks, form_buddy_links
from ckless_lightning.replication.fingerprint import (
    StateFingerprint,
    TensorSums,
    loop_fingerprint,
    tensors_fingerprint,
)
from ckless_lightning.replication.loop_state import encode_loop_state
from ckless_lightning.replication.state import live_params, local_state_tensors, param_groups_of
from ckless_lightning.training.callbacks.fault_injection import corrupt_held_loop

SECRET = "test-verified-restore"


def _odd_tensors() -> list[torch.Tensor]:
    """Every shape a rank's state takes: empty shards, Adam's 0-dim step counters, sizes that are
    not a multiple of 8 bytes, bf16 next to fp32, a misaligned view."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.zeros(0),
        torch.randn(7, 3, generator=g),
        torch.tensor(3.0),
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.tensor([1, 2, 3], dtype=torch.uint8),
        torch.tensor(7, dtype=torch.int64),
        torch.tensor(True),
        torch.tensor(2.5, dtype=torch.float16),
        torch.randn(9, generator=g)[1:],  # a view whose storage does not start at an 8-byte boundary
        torch.randn(64, 32, generator=g),
    ]


def test_verif_fingerprint_of_a_host_copy_equals_the_live_one():
    tensors = _odd_tensors()
    buffer = FlatBuffer(tensors, tail_bytes=64)
    torch._foreach_copy_(buffer.views, tensors)
    assert buffer.fingerprint() == tensors_fingerprint(tensors)
    assert tensors_fingerprint([]) == FlatBuffer([]).fingerprint()


def test_verif_fingerprint_host_sums_equal_the_device_ones(monkeypatch):
    """The numpy sums over host views give what torch's sums where the tensors live give (the
    path a GPU rank's shards take): the same fingerprint for every shape a state takes."""
    tensors = _odd_tensors()
    on_host = tensors_fingerprint(tensors)
    monkeypatch.setattr(fingerprint_module, "host_bytes", lambda t: None)
    assert tensors_fingerprint(tensors) == on_host


def test_verif_fingerprint_sums_kept_across_steps_see_every_update_and_a_moved_tensor():
    """TensorSums makes its views once: an in-place update (an optimizer step) shows in the next
    fingerprint, and a tensor in new storage makes the views stale (``matches`` is False)."""
    tensors = _odd_tensors()
    sums = TensorSums(tensors)
    before = sums.fingerprint()
    assert sums.matches(tensors) and before == tensors_fingerprint(tensors)
    tensors[-1].add_(1.0)
    tensors[2].add_(1.0)  # a 0-dim step counter: summed in a stack of its group
    assert sums.fingerprint() == tensors_fingerprint(tensors) != before
    moved = [*tensors[:-1], tensors[-1].clone()]
    assert not sums.matches(moved)
    assert TensorSums(moved).fingerprint() == sums.fingerprint()


@pytest.mark.parametrize("index", range(1, 10))
def test_verif_fingerprint_changes_with_one_bit_and_with_order(index):
    tensors = _odd_tensors()
    before = tensors_fingerprint(tensors)
    flipped = [t.clone() for t in tensors]
    flipped[index].reshape(-1).view(torch.uint8)[0] ^= 1
    assert tensors_fingerprint(flipped) != before
    swapped = [tensors[index], *tensors[:index], *tensors[index + 1 :]]
    assert tensors_fingerprint(swapped) != before or tensors[index].numel() == 0


def test_verif_fingerprint_record_round_trip_and_mismatch():
    a = StateFingerprint(5, 2, "aa", "bb")
    assert StateFingerprint.parse(a.encode()) == a
    assert a.mismatch(StateFingerprint(5, -1, "aa", "bb")) is None  # the generation is not the state
    assert a.mismatch(StateFingerprint(5, 2, "aa", "cc")) == "loop"
    assert a.mismatch(StateFingerprint(5, 2, "xx", "cc")) == "tensors and loop"


def test_verif_a_rank_keeps_a_ring_of_its_records_and_reports_them():
    """Each recorded step's fingerprint stays with the rank (the last fingerprint_ring steps), is
    reported by (job rank, step), and goes with the timeline it belongs to."""
    copies = SnapshotCopies(rank=1, world_size=4, source="hsdp")
    tensors = _odd_tensors()
    made = {step: copies.record(step, b"loop %d" % step, tensors, gen=0) for step in range(1, 8)}
    assert copies.fingerprint_ring == 4 and sorted(copies.records) == [4, 5, 6, 7]
    report = copies.report()
    assert report.records == {(1, step): made[step] for step in (4, 5, 6, 7)} and report.timeline == 0
    assert made[7] == StateFingerprint(7, 0, tensors_fingerprint(tensors), loop_fingerprint(b"loop 7"))
    copies.resumed_at(5, b"loop 5")  # a memory restore at step 5: the newer records are of no state now
    assert sorted(copies.records) == [4, 5]
    copies.resumed_at(None, timeline=3)  # the job resumed from disk in generation 3: none is left
    assert copies.records == {} and copies.report().timeline == 3


def test_verif_a_copy_carries_its_record_to_the_buddy():
    """A copy's last bytes hold its step's record: what the buddy receives (the whole flat buffer)
    it reports for the ward; a damaged or other step's record counts as none."""
    copies = SnapshotCopies(rank=0, world_size=2, source="buddy")
    tensors = _odd_tensors()
    made = copies.record(4, encode_loop_state({"at": 4}), tensors, gen=2)
    own = copies.own_copy(4)
    assert own.record() == made == copies.records[4]
    held = Snapshot(FlatBuffer(tensors, own.buffer.tail.numel()), step=4, complete=True)
    held.buffer.flat.copy_(own.buffer.flat)  # what the exchange's send and receive do
    buddy = SnapshotCopies(rank=1, world_size=2, source="buddy", held=[held])
    assert buddy.report().records == {(0, 4): made}  # rank 1 vouches for its ward's step 4
    held.step = 5
    assert held.record() is None  # a copy labelled with another step than its record's
    held.step = 4
    held.record_area[8:12] = 0xFF
    assert held.record() is None and buddy.report().records == {}


def test_verif_planner_never_uses_a_rejected_source():
    """Buddy layout, 4 ranks, rank 2 lost; rank 3 holds rank 2's copies of steps 4 and 5."""
    reports = {
        0: RankReport(0, 5, frozenset({4, 5}), {3: frozenset({4, 5})}),
        1: RankReport(1, 5, frozenset({4, 5}), {0: frozenset({4, 5})}),
        2: RankReport(2, None),
        3: RankReport(3, 5, frozenset({4, 5}), {2: frozenset({4, 5})}),
    }
    buddy = lambda r: (r + 1) % 4
    assert buddy_sources(reports, buddy_of=buddy).step == 5
    # The copy of step 5 is rejected: every rank goes back to step 4 (own copies, the older held one).
    plan = buddy_sources(Rejected(held=frozenset({(3, 2, 5)})).apply(reports), buddy_of=buddy)
    assert (plan.step, plan.rollback, plan.transfers) == (4, frozenset({0, 1, 3}), (Transfer(3, 2),))
    # Rank 0's live state is rejected too: it rolls back with the others.
    rejected = Rejected(live=frozenset({0}), held=frozenset({(3, 2, 5)}))
    assert buddy_sources(rejected.apply(reports), buddy_of=buddy).step == 4
    # Nothing of step 4 left for rank 2 either: fall back.
    rejected |= Rejected(held=frozenset({(3, 2, 4)}))
    assert buddy_sources(rejected.apply(reports), buddy_of=buddy).fallback


def test_verif_a_replica_shard_is_checked_against_the_replicas_record():
    """HSDP: rank 1 restored from its replica rank 3 takes rank 3's shard and loop state (the loop
    states of replicas differ in the loader's dp rank): checked against rank 3's record; its own
    record of the step, when it made one, must agree on the tensors."""
    tensors = _odd_tensors()
    state = tensors_fingerprint(tensors)
    plan = SourceMap(2, (Transfer(3, 1),), frozenset(), (1,), "rank 1 restored from replica peers (step 2)")
    loop_of = {r: encode_loop_state({"dp_rank": r}) for r in (1, 3)}
    reports = {r: RankReport(r, None if r == 1 else 2) for r in range(4)}

    def vouch(rank: int, tensors_hex: str, *, timeline: int = 0) -> None:
        record = StateFingerprint(2, 0, tensors_hex, loop_fingerprint(loop_of[rank]))
        reports[rank] = replace(reports[rank], records={(rank, 2): record}, timeline=timeline)

    def verdict():
        return verify_restored(
            plan, 1, tensors, loop_of[3], reports=reports, job_rank=lambda r: r, buddy=False
        )

    assert verdict().problem == "no fingerprint recorded"  # rank 3 recorded nothing yet
    vouch(3, state)
    assert verdict().ok
    vouch(1, state)
    assert verdict().ok  # its own record: same tensors, its own dp rank in the loop
    vouch(1, "0" * 32)
    assert verdict().problem == "tensors"  # the replicas' records disagree: not trusted
    reports[0] = replace(reports[0], timeline=1)  # a rank resumed from disk in generation 1
    assert verdict().problem == "no fingerprint recorded"  # records of generation 0 are void


def test_verif_a_replaced_rank_is_checked_against_the_record_its_buddys_copy_carried():
    """Buddy layout: rank 2's process is new (no records); rank 3's report vouches for rank 2's
    step 5 (the record its held copy carried): what rank 2 received is checked against it."""
    tensors = _odd_tensors()
    loop = encode_loop_state({"at": 5})
    record = StateFingerprint(5, 0, tensors_fingerprint(tensors), loop_fingerprint(loop))
    plan = SourceMap(5, (Transfer(3, 2),), frozenset(), (2,), "rank 2 from its buddy (step 5)")
    reports = {r: RankReport(r, None if r == 2 else 5) for r in range(4)}

    def verdict(got: list[torch.Tensor]):
        return verify_restored(plan, 2, got, loop, reports=reports, job_rank=lambda r: r, buddy=True)

    assert verdict(tensors).problem == "no fingerprint recorded"
    reports[1] = replace(reports[1], records={(2, 5): record})  # not the holder: not its word
    assert verdict(tensors).problem == "no fingerprint recorded"
    reports[3] = replace(reports[3], records={(2, 5): record})
    assert verdict(tensors).ok and verdict(tensors).holder == 3
    flipped = [t.clone() for t in tensors]
    flipped[-1][0, 0] += 1
    assert verdict(flipped).problem == "tensors"


# -- the restore on 4 gloo ranks ------------------------------------------------------------------------


def _set_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    """Rank ``rank``'s state after step ``step``: every value a function of (rank, step)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + 1000 * rank + 10 * step + i)
            state = optimizer.state[p]
            state["step"] = torch.tensor(float(step))
            state["exp_avg"] = torch.full_like(p, 0.5 * step + rank)
            state["exp_avg_sq"] = torch.full_like(p, 0.25 * step + rank)


def _loop(optimizer: torch.optim.Optimizer, rank: int, step: int) -> bytes:
    return encode_loop_state(
        {"optimizer_states": [{"param_groups": param_groups_of([optimizer])[0]}], "at": (rank, step)}
    )


SCENARIOS = ("clean", "stale live", "corrupt held loop", "step 2 unrecorded", "no record at all")


def _restore_scenarios(rank: int, world: int, ports: list[int], events_dir: str) -> dict[str, dict]:
    """Every scenario in turn, each with its own job store and event log (one start of 4 ranks)."""
    return {
        scenario: _restore_scenario(rank, world, port, scenario, str(Path(events_dir) / f"{i}.jsonl"))
        for i, (scenario, port) in enumerate(zip(SCENARIOS, ports, strict=True))
    }


def _buddy_links(store: JobStore, rank: int, world: int, name: str) -> BuddyLinks:
    """Buddy pair groups on a namespace of their own (the job store stays in generation 0 here)."""
    pg_store = dist.PrefixStore(f"{name}/", store.process_group_store(0, init_timeout_s=30.0))
    return form_buddy_links(pg_store, rank=rank, world_size=world, offset=1, timeout=timedelta(seconds=30))


def _restore_scenario(rank: int, world: int, port: int, scenario: str, events_path: str) -> dict:
    store = (JobStore.host if rank == 0 else JobStore.connect)("127.0.0.1", port, secret=SECRET)
    dist.barrier()  # every rank connected before rank 0 could finish and close the store
    snapshots = SnapshotCopies(rank=rank, world_size=world, source="buddy")
    snapshots.attach(_buddy_links(store, rank, world, "before"))
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        _set_state(model, optimizer, rank, step)
        snapshots.record(step, _loop(optimizer, rank, step), local_state_tensors(model, [optimizer]), gen=0)
        unrecorded = scenario == "no record at all" or (scenario == "step 2 unrecorded" and step == 2)
        if rank == 1 and unrecorded:
            del snapshots.records[step]  # rank 1 lost its record of the step (its copies keep theirs)
        snapshots.exchange(step)
        snapshots.settle()
    # The fault: rank 2 is a new process (nothing held); the others capture their live state.
    if rank == 2:
        snapshots = SnapshotCopies(rank=rank, world_size=world, source="buddy")
    else:
        snapshots.capture_live(live_params(model, [optimizer]), trusted=True)
    if scenario == "stale live" and rank == 0:
        _set_state(model, optimizer, rank, 1)  # its capture (views) now holds step 1, labelled step 2
    if scenario == "corrupt held loop" and rank == 3:
        assert corrupt_held_loop(snapshots) == 2  # rank 2's copy of step 2, in rank 3's memory
    generation = Generation(store, number=1, rank=rank, world_size=world, mesh=(1, world))
    snapshots.attach(_buddy_links(store, rank, world, "after"))
    fresh = torch.nn.Linear(4, 3)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    restore = MemoryRestore(
        snapshots,
        generation,
        checkpoint_dir=None,
        bucket_bytes=1 << 10,
        events=EventLog(events_path, f"rank{rank}"),
    )
    try:
        checkpoint = restore.restore(fresh, [fresh_optimizer])
    except StartOver as err:
        return {"start_over": str(err)}
    finally:
        dist.barrier()  # rank 0 hosts the store: it stays until every rank is done with it
    assert isinstance(checkpoint, dict)
    rank_at, step = checkpoint["at"]
    expected = (torch.nn.Linear(4, 3), None)
    expected_optimizer = torch.optim.AdamW(expected[0].parameters())
    _set_state(expected[0], expected_optimizer, rank, step)
    same = all(
        torch.equal(a, b)
        for a, b in zip(
            local_state_tensors(fresh, [fresh_optimizer]),
            local_state_tensors(expected[0], [expected_optimizer]),
            strict=True,
        )
    )
    return {"rank_at": rank_at, "step": step, "same": same, "live_step": snapshots.live_step}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict[str, tuple[list[dict], list[dict]]]:
    """Each scenario's results by rank and its events."""
    events = tmp_path_factory.mktemp("verified-restore")
    ports = [free_port() for _ in SCENARIOS]
    by_rank = run_ranks(_restore_scenarios, 4, ports, str(events), timeout=180)
    return {
        scenario: ([r[scenario] for r in by_rank], read_events(events / f"{i}.jsonl"))
        for i, scenario in enumerate(SCENARIOS)
    }


def _kinds(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


def test_verif_restore_of_recorded_state_passes(scenarios):
    results, events = scenarios["clean"]
    assert [(r["rank_at"], r["step"], r["same"]) for r in results] == [(r, 2, True) for r in range(4)]
    assert all(r["live_step"] == 2 for r in results)  # the restored state is the rank's live state
    assert not _kinds(events, "restore_rejected")
    assert all(e["verified"] and e["lost"] == [2] for e in _kinds(events, "memory_restore"))


def test_verif_a_survivors_live_state_unlike_its_label_is_rejected(scenarios):
    """Rank 0 offers live tensors labelled step 2 that hold step 1 (what the chaos run's survivors
    adopted): rejected; it rolls back to its own copy of step 2, which verifies."""
    results, events = scenarios["stale live"]
    assert [(r["rank_at"], r["step"], r["same"]) for r in results] == [(r, 2, True) for r in range(4)]
    [rejected] = _kinds(events, "restore_rejected")
    assert (rejected["rank"], rejected["state"], rejected["step"], rejected["problem"]) == (
        0,
        "live",
        2,
        "tensors",
    )
    restored = {e["rank"]: e for e in _kinds(events, "memory_restore")}
    assert restored[0]["rollback"] == [0] and restored[0]["rejected"] == [rejected["reason"]]


def test_verif_a_held_copy_with_corrupt_loop_state_is_rejected(scenarios):
    """Rank 3's copy of rank 2 (step 2) had a byte of its loop state flipped in host memory: the
    transfer's checksums pass (the source sends what it holds), the verification does not; every
    rank goes back to step 1, rank 2 from the older held copy."""
    results, events = scenarios["corrupt held loop"]
    assert [(r["rank_at"], r["step"], r["same"]) for r in results] == [(r, 1, True) for r in range(4)]
    [rejected] = _kinds(events, "restore_rejected")
    assert (rejected["rank"], rejected["state"], rejected["holder"]) == (2, "buddy", 3)
    assert (rejected["step"], rejected["problem"]) == (2, "loop")
    assert not _kinds(events, "transfer_rejected")  # nothing was wrong in flight


def test_verif_state_without_a_record_is_never_trained_on(scenarios):
    """Rank 1 did not record step 2: neither its live state nor its own copy of step 2 can be
    verified; every rank resumes at step 1, which every rank recorded."""
    results, events = scenarios["step 2 unrecorded"]
    assert [(r["rank_at"], r["step"], r["same"]) for r in results] == [(r, 1, True) for r in range(4)]
    rejected = [(e["rank"], e["state"], e["problem"]) for e in _kinds(events, "restore_rejected")]
    assert rejected == [(1, "live", "no fingerprint recorded"), (1, "own", "no fingerprint recorded")]


def test_verif_nothing_verifiable_falls_back_and_says_why(scenarios):
    """Rank 1 recorded nothing: no step verifies, and with no disk checkpoint every rank starts over."""
    results, events = scenarios["no record at all"]
    assert all("starts over" in r["start_over"] for r in results), results
    fallbacks = [e for e in _kinds(events, "memory_restore") if e["step"] is None]
    assert len(fallbacks) == 4 and all("rank 1's live state" in e["reason"] for e in fallbacks), fallbacks
    assert json.dumps(fallbacks[0]["rejected"]).count("no fingerprint recorded") >= 2
