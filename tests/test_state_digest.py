"""The state digest in the commit vote: a flipped bit in one HSDP replica is caught, named, repaired.

Unit tests of the digest, the majority rule, the checkpoint quarantine and the config checks;
then two jobs on CPU ranks, each bitwise equal to its fault-free run at the end:

- HSDP 2x2, a bit flipped in rank 1's shard: its replica (rank 3) disagrees and nothing tells
  which copy is right, so both are suspect; checkpoints that may hold the flip are set aside and
  the job resumes from the last one before it.
- HSDP 3x1, bits flipped in rank 2's state twice: the majority (ranks 0 and 1) names rank 2;
  the job resumes from the last clean checkpoint both times; the second time rank 2 is suspect
  hardware: it exits and a new process takes its place.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_utils import assert_same_run
from conftest import TINY_HSDP_REFERENCE, launch_job
from test_agent import events_of, job_processes
from test_tier3 import plan_override

from ckless_lightning.record.summary import summarize_run
from ckless_lightning.recovery.digest import StateDigest, disagreeing, replica_groups
from ckless_lightning.runtime.checkpointing import checkpoint_name, quarantine_checkpoints

STEPS = 12
EVERY = 4  # replication.digest_every: the flipped byte (the first of its tensor) is part 0
COMMON = (
    f"trainer.max_steps={STEPS}",
    "tier=4",
    f"replication.digest_every={EVERY}",
    "replication.source=hsdp",
    "agent.hang_timeout=6",
    "agent.max_restarts=10",
    "comm.init_timeout_s=300",
    "agent.recovery_timeout=120",
)
PAIRS = ("cluster.replicate=2", "checkpoint.every_n_steps=3")  # 2x2 on 4 ranks
# 3x1 on 3 ranks (global batch 12: 4 per rank)
TRIPLES = (
    "cluster.nproc_per_node=3",
    "cluster.replicate=3",
    "trainer.global_batch_size=12",
    "checkpoint.every_n_steps=3",
)


# -- units ---------------------------------------------------------------------------------------------


def test_every_flipped_bit_changes_exactly_one_part_of_the_digest() -> None:
    digest = StateDigest(EVERY)
    state = [torch.randn(123, 7), torch.randn(5).to(torch.bfloat16), torch.zeros(())]
    clean = [digest.of(state, part) for part in range(EVERY)]
    words = state[0].view(-1).view(torch.int32)
    for index in (0, 1, 200, 500, words.numel() - 1):
        for bit in (0, 6, 22, 31):
            words[index] ^= 1 << bit
            changed = [part for part in range(EVERY) if digest.of(state, part) != clean[part]]
            words[index] ^= 1 << bit
            assert len(changed) == 1, (index, bit, changed)
    assert [digest.of(state, part) for part in range(EVERY)] == clean
    assert digest.count == EVERY * (1 + 20) + EVERY and digest.seconds > 0
    with pytest.raises(ValueError, match="every must be >= 1"):
        StateDigest(0)


def test_the_digest_reads_the_state_it_is_given_in_place_and_after_it_moved() -> None:
    """The digest keeps its views of the state across votes: an in-place change shows in the part
    it falls in; state in new storage is read there (not the old views); release drops the views."""
    digest = StateDigest(EVERY)
    state = [torch.randn(123, 7), torch.randn(64, 8).to(torch.bfloat16), torch.zeros(())]
    clean, original = digest.of(state, 0), state[0].clone()
    state[0].view(-1)[0] += 1.0
    assert digest.of(state, 0) != clean
    moved = [original, *state[1:]]
    assert digest.of(moved, 0) == clean
    digest.release()
    assert digest.of(state, 0) != clean


def test_the_majority_of_a_shards_replicas_wins_and_a_tie_suspects_both() -> None:
    assert replica_groups(2, 2) == [[0, 2], [1, 3]]
    assert replica_groups(3, 1) == [[0, 1, 2]]
    assert disagreeing({0: "a", 1: "a", 2: "b"}, replica_groups(3, 1)) == [2]
    assert disagreeing({0: "a", 1: "b", 2: "a", 3: "c"}, replica_groups(2, 2)) == [1, 3]
    assert disagreeing({0: "a", 1: "b", 2: "a", 3: "b"}, replica_groups(2, 2)) == []  # shards differ
    assert disagreeing({0: "a", 1: "b", 2: "c"}, replica_groups(3, 1)) == [0, 1, 2]


def test_checkpoints_after_the_trusted_step_are_set_aside_not_deleted(tmp_path) -> None:
    for step in (3, 6, 9):
        (tmp_path / checkpoint_name(step)).mkdir()
    moved = quarantine_checkpoints(tmp_path, after_step=4, tag="gen0")
    assert [p.name for p in moved] == [f"{checkpoint_name(s)}.suspect-gen0" for s in (6, 9)]
    kept = sorted([checkpoint_name(3), *(p.name for p in moved)])
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    assert quarantine_checkpoints(tmp_path, after_step=4, tag="gen0") == []  # another rank's call
    assert quarantine_checkpoints(None, after_step=0, tag="x") == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("tier='4'", "fault=bitflip"), "cluster.replicate >= 2"),
        (("tier='1'", "cluster.replicate=2", "fault=bitflip"), "tier=3 or 4"),
        (
            ("tier='4'", "cluster.replicate=2", "fault=bitflip", "replication.digest_every=0"),
            "digest_every=0",
        ),
        (
            ("tier='4'", "cluster.replicate=2", "fault=bitflip", "fault.injected_by=outside"),
            "injected_by=inside",
        ),
        (("replication.digest_every=-1",), "replication.digest_every must be >= 0"),
    ],
)
def test_bad_bitflip_and_digest_settings_are_refused(compose, overrides, message) -> None:
    from ckless_lightning.runtime.config import job_config_from_dict

    with pytest.raises(ValueError, match=message):
        job_config_from_dict(compose(*overrides))


# -- jobs ----------------------------------------------------------------------------------------------


def run_job(tmp_path: Path, data_cache: Path, name: str, *overrides: str) -> Path:
    run = tmp_path / name
    launch_job(run, data_cache, *COMMON, *overrides, timeout=600)
    summary = summarize_run(run)
    assert summary.exit_code == 0, summary.format()
    assert not job_processes(run)
    return run


@pytest.mark.timeout(900)
def test_a_flipped_bit_in_one_of_two_replicas_rolls_back_to_a_clean_checkpoint(
    tmp_path, data_cache, reference_run
) -> None:
    reference = reference_run(*TINY_HSDP_REFERENCE)  # PAIRS' training, fault-free
    # Rank 1's first parameter, after the update of step 5; the vote of step 8 (8 % 4 == 0) compares
    # part 0: ranks 1 and 3 (shard 1's replicas) disagree. Checkpoints after step 8 - 1 - 4 = 3 may
    # hold the flip (step 6 does): set aside; the job resumes from step 3.
    run = run_job(tmp_path, data_cache, "run", *PAIRS, "fault=bitflip", "fault.rank=1", "fault.step=5")
    assert_same_run(run, reference, tmp_path, STEPS)
    (found,) = events_of(run, "state_disagreement")
    assert (found["step"], found["part"], found["suspects"], found["trusted_step"]) == (8, 0, [1, 3], 3)
    assert found["digests"]["1"] != found["digests"]["3"]
    first_restore = next(e for e in events_of(run, "memory_restore") if e["rank"] == 0)
    assert first_restore["reason"].endswith("falling back to the last disk checkpoint"), first_restore
    set_aside = sorted(p.name for p in (run / "checkpoints").glob("*.suspect-*"))
    assert set_aside == [f"{checkpoint_name(6)}.suspect-gen0"], set_aside
    phases = events_of(run, "rank_phase")
    loaded = {e["step"] for e in phases if e["phase"] == "state_load_done" and e["gen"] == 1}
    assert loaded == {3}, loaded
    assert not events_of(run, "suspect_hardware")


@pytest.mark.timeout(900)
def test_a_flipped_replica_is_named_by_the_majority_and_a_second_flip_replaces_it(
    tmp_path, data_cache
) -> None:
    """3x1: the majority names rank 2, but its live state is not restored from the majority: rank 2's
    corrupt weights were in the forward of every step since the flip, so its gradients are in every
    replica's weights (measured before this design: a repair from the majority ended with every
    rank's weights off). The job resumes from the last clean checkpoint, twice; the second time
    rank 2 is suspect hardware and a new process takes its place."""
    reference = run_job(tmp_path, data_cache, "reference", *TRIPLES)
    plan = plan_override([("bitflip", 2, 5, "optimizer"), ("bitflip", 2, 9, "optimizer")])
    run = run_job(tmp_path, data_cache, "run", *TRIPLES, "fault=plan", plan)
    assert_same_run(run, reference, tmp_path, STEPS)
    found = sorted(events_of(run, "state_disagreement"), key=lambda e: e["t"])
    # Vote 8 compares part 0 of step 7's state (flipped after step 5's update): clean up to step 3;
    # vote 12 finds the second flip (after step 9): clean up to step 7.
    summary = [(e["step"], e["suspects"], e["times"], e["trusted_step"]) for e in found]
    assert summary == [(8, [2], {"2": 1}, 3), (12, [2], {"2": 2}, 7)], summary
    restores = sorted((e for e in events_of(run, "memory_restore") if e["rank"] == 0), key=lambda e: e["t"])
    assert [e["step"] for e in restores] == [None, None], restores  # no live state: from disk
    phases = events_of(run, "rank_phase")
    loaded = {(e["gen"], e["step"]) for e in phases if e["phase"] == "state_load_done" and e["gen"] > 0}
    assert loaded == {(1, 3), (2, 6)}, loaded
    # The second flip is injected in generation 1 by the same rank process: its event says so.
    injected = sorted((e["step"], e["gen"]) for e in events_of(run, "fault_injected"))
    assert injected == [(5, 0), (9, 1)], injected
    set_aside = sorted(p.name for p in (run / "checkpoints").glob("*.suspect-*"))
    assert set_aside == [f"{checkpoint_name(6)}.suspect-gen0", f"{checkpoint_name(9)}.suspect-gen1"], (
        set_aside
    )
    (suspect,) = events_of(run, "suspect_hardware")
    assert (suspect["rank"], suspect["times"]) == (2, 2)
    exits = [e for e in events_of(run, "fault_detected") if e["rank"] == 2 and e.get("exit_code") == 5]
    assert exits, events_of(run, "fault_detected")
    started = [e["ranks"] for e in events_of(run, "ranks_started") if e["gen"] > 0]
    assert [2] in started, started  # a new process for rank 2
