"""``comm.vote=collective``: the step vote as a one-element all-reduce, with no job-store request.

Multi-rank tests on gloo (``tests/dist.py``): every rank gets the same decision; one rank whose
generation watch saw the job move makes every rank abandon the step; a peer lost before its vote
makes the others' vote fail as a lost peer (not hang). The config refuses the collective vote
with the HSDP state digest it does not carry. End to end (tier 4, a rank killed at every phase of
a step, the chaos of any process at any moment): ``test_tier4.py`` and ``test_chaos.py``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from dist import RankError, run_ranks

from ckless_lightning.comm import Generation, GenerationChanged
from ckless_lightning.recovery.commit import StepCommit
from ckless_lightning.recovery.sever import sever_connections
from ckless_lightning.runtime.config import CommConfig
from ckless_lightning.runtime.contract import is_peer_failure


class _NoStore:
    """Stands in for the job store: the collective vote must not touch it (an abandoned step reads
    the current generation for its message, and only then)."""

    def __init__(self) -> None:
        self.reads = 0

    def generation(self) -> int:
        self.reads += 1
        return 1


def _commit(rank: int, world_size: int, store: _NoStore) -> StepCommit:
    generation = Generation(store, 0, rank, world_size, (1, world_size), vote="collective")  # type: ignore[arg-type]
    return StepCommit(generation)


def _three_steps(rank: int, world_size: int) -> tuple[int, int]:
    store = _NoStore()
    commit = _commit(rank, world_size, store)
    for step in (1, 2, 3):
        commit.vote(step)
    return commit.votes, store.reads


def _one_rank_saw_the_move(rank: int, world_size: int) -> str:
    store = _NoStore()
    commit = _commit(rank, world_size, store)
    commit.vote(1)
    if rank == world_size - 1:
        commit.job_left(store)  # type: ignore[arg-type]
    try:
        commit.vote(2)
    except GenerationChanged as err:
        return str(err)
    return "committed"


def _a_peer_dies_before_its_vote(rank: int, world_size: int, out_dir: str) -> None:
    commit = _commit(rank, world_size, _NoStore())
    commit.vote(1)
    if rank == 1:  # lost, as a killed rank is to its peers (closed connections), then gone for good
        sever_connections(keep_ports=set())
        time.sleep(5)  # the survivors' votes fail meanwhile
        os._exit(9)
    try:
        commit.vote(2)
        outcome = "committed"
    except Exception as err:  # what the recovery loop sees
        outcome = f"raised; a lost peer: {is_peer_failure(err)}"
    Path(out_dir, f"rank{rank}").write_text(outcome)


@pytest.mark.timeout(120)
def test_every_rank_commits_with_no_store_request():
    assert run_ranks(_three_steps, 3) == [(3, 0)] * 3


@pytest.mark.timeout(120)
def test_one_rank_that_saw_the_job_move_makes_every_rank_abandon():
    outcomes = run_ranks(_one_rank_saw_the_move, 3)
    assert all("voting on step 2: abandoned" in o for o in outcomes), outcomes


@pytest.mark.timeout(120)
def test_a_peer_lost_before_its_vote_fails_the_others_vote_as_a_lost_peer(tmp_path):
    with pytest.raises(RankError, match="exit"):  # rank 1's exit, as the harness reports it
        run_ranks(_a_peer_dies_before_its_vote, 3, str(tmp_path), timeout=90)
    outcomes = {r: (tmp_path / f"rank{r}").read_text() for r in (0, 2) if (tmp_path / f"rank{r}").exists()}
    assert outcomes == {0: "raised; a lost peer: True", 2: "raised; a lost peer: True"}, outcomes


def test_comm_vote_is_checked():
    with pytest.raises(ValueError, match=r"comm\.vote must be one of auto, store, collective"):
        CommConfig(vote="raft")
    assert CommConfig(vote="collective").vote == "collective"
    assert CommConfig().vote == "auto"


def test_auto_is_the_collective_but_where_the_store_vote_carries_the_digest_or_the_job_is_elastic(compose):
    """``comm.vote=auto`` (the default) resolves as the job's config is built: the collective at
    tiers 3-4 with buddy copies or HSDP without the digest; the store vote with the HSDP digest
    (which only it carries: a bitflip fault needs it), in an elastic job, and at tiers 0-2."""
    from ckless_lightning.runtime.config import job_config_from_dict

    def vote(*overrides: str) -> str:
        return job_config_from_dict(compose("fault=none", *overrides)).comm.vote

    assert vote("tier='4'") == "collective" and vote("tier='3'") == "collective"
    assert vote("tier='4'", "cluster.replicate=2") == "store"  # the digest is on by default
    assert vote("tier='4'", "cluster.replicate=2", "replication.digest_every=0") == "collective"
    assert vote("tier='1'") == "store"
    elastic = ("tier='4'", "cluster.replicate=2", "replication.digest_every=0", "elastic.enabled=true")
    assert vote(*elastic) == "store"
    assert vote("tier='4'", "comm.vote=store") == "store"  # an explicit choice stands


def test_the_collective_vote_is_refused_with_the_hsdp_digest(compose):
    from ckless_lightning.runtime.config import job_config_from_dict

    hsdp = ("tier='4'", "cluster.replicate=2", "fault=none", "comm.vote=collective")
    with pytest.raises(ValueError, match=r"comm\.vote=collective .* replication\.digest_every=0"):
        job_config_from_dict(compose(*hsdp))
    assert job_config_from_dict(compose(*hsdp, "replication.digest_every=0")).comm.vote == "collective"
    buddy = job_config_from_dict(compose("tier='4'", "fault=none", "comm.vote=collective"))
    assert buddy.comm.vote == "collective"


def test_survivors_a_partial_all_reduce_left_one_step_apart_resume_together():
    """Rank 1 dies inside step 8's all-reduce; it completed on rank 0 (which applied and recorded
    step 8) and failed on ranks 2 and 3 (still at 7). Every rank resumes at step 7: rank 0 rolls back
    to its own copy of 7, rank 1 gets its copy of 7 from its buddy, rank 2."""
    from ckless_lightning.replication import RankReport, Transfer, buddy_sources

    copies = {r: frozenset({6, 7}) for r in range(4)}
    reports = {r: RankReport(r, 7, copies[r], {(r - 1) % 4: frozenset({6, 7})}) for r in (2, 3)}
    reports[0] = RankReport(0, 8, frozenset({7, 8}), {3: frozenset({7, 8})})
    reports[1] = RankReport(1, None)
    plan = buddy_sources(reports, buddy_of=lambda r: (r + 1) % 4)
    assert (plan.step, plan.transfers, plan.rollback) == (7, (Transfer(2, 1),), frozenset({0}))
