"""Tier 4: the state each rank ends a restore with is the state its owner recorded for that step.

Why: a restore assembles a rank's state from a survivor's live tensors, its own host copy, a
buddy's held copy or an HSDP replica's shard, each labelled with a step by bookkeeping that
spans generations and processes. Transfer checksums prove the bytes arrived as sent; nothing
else proved the label. A wrong label trains on without an error (a chaos run ended with exit 0
and other losses: a survivor adopted tensors of an earlier step). So before the first step
after a restore, every rank fingerprints what it holds (tensors and loop state,
:mod:`~ckless_lightning.replication.fingerprint`) and compares it with the fingerprint its
owner recorded after that step. Every rank learns every verdict (one collective), so all reject
the same sources and plan again from what is left: another copy, an older step every rank can
reach, the disk checkpoint, or the job's start.

Where the records come from: each rank keeps its own, and a buddy copy carries its step's record
from the rank that made it (:mod:`~ckless_lightning.replication.snapshots`); every rank's report,
gathered before the plan, lists the records it vouches for. A record reaches the rank that
checks against it through the reports' collective, not through the transfer that moved the state.
Nothing goes through the job store (issue #31: one record per rank and step was the control
plane's largest cost).

Whose record a state is checked against: the rank's own, by job rank, for its live state and
for copies of its own state (its own host copy, the one its buddy held). An HSDP rank restored
from a replica takes the replica's shard and loop state, and is checked against the replica's
record (replicas hold bitwise-equal shards; their loop states differ only in the loader's
informational dp rank); a record of its own, if it made one before it was lost, must agree on
the tensors. Once restored, a rank records the state it now holds as its own for that step
(:meth:`~ckless_lightning.recovery.memory.MemoryRestore.restore`), so a later restore at the same
step can verify it in turn. A record from before the current timeline began (the latest
``timeline`` in the reports: the last resume from disk or the start) describes state the job has
left and counts as none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ckless_lightning.replication import RankReport, Rejected, SourceMap, StateFingerprint, Transfer
from ckless_lightning.replication.fingerprint import loop_fingerprint, tensors_fingerprint

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = ["Verdict", "verify_restored"]

NO_RECORD = "no fingerprint recorded"


@dataclass(frozen=True)
class Verdict:
    """One rank's check of its restored state (``rank``, ``holder``: generation ranks, as the plan
    names them; ``rank_job``, ``holder_job``: the job's, as events and messages name them).

    ``source``: ``live`` (its live state), ``own`` (its own host copy), ``buddy`` (the copy its
    buddy ``holder`` held) or ``replica`` (HSDP replica ``holder``'s shard). ``problem``: None when
    the state matches the record of ``step``; else what differs (``tensors``, ``loop``, both) or
    ``no fingerprint recorded``.
    """

    rank: int
    rank_job: int
    source: str
    holder: int | None
    holder_job: int | None
    step: int
    problem: str | None
    expected: str | None = None  # the recorded fingerprint
    got: str | None = None  # what the rank holds

    @property
    def ok(self) -> bool:
        return self.problem is None

    def rejection(self) -> Rejected:
        """What a failed verdict takes out of the next plan."""
        if self.source == "live":
            return Rejected(live=frozenset({self.rank}))
        if self.source == "own":
            return Rejected(own=frozenset({(self.rank, self.step)}))
        assert self.holder is not None
        if self.source == "buddy":
            return Rejected(held=frozenset({(self.holder, self.rank, self.step)}))
        return Rejected(pairs=frozenset({Transfer(self.holder, self.rank)}))

    def describe(self) -> str:
        """``rank 2's copy on rank 3 (step 5): loop differs from the fingerprint recorded for step 5``."""
        what = {
            "live": f"rank {self.rank_job}'s live state",
            "own": f"rank {self.rank_job}'s own copy",
            "buddy": f"rank {self.rank_job}'s copy on rank {self.holder_job}",
            "replica": f"rank {self.rank_job}'s shard from replica rank {self.holder_job}",
        }[self.source]
        if self.problem == NO_RECORD:
            return f"{what} (step {self.step}): no fingerprint recorded for step {self.step}"
        verb = "differs" if self.problem in ("tensors", "loop") else "differ"
        return f"{what} (step {self.step}): {self.problem} {verb} from the fingerprint recorded for it"

    def event_fields(self) -> dict[str, Any]:
        return {
            "rank": self.rank_job,
            "state": self.source,
            "holder": self.holder_job,
            "step": self.step,
            "problem": self.problem,
            "expected": self.expected,
            "got": self.got,
            "reason": self.describe(),
        }


def _source(plan: SourceMap, rank: int, buddy: bool) -> tuple[str, int | None]:
    if rank in plan.rollback:
        return "own", None
    if rank in plan.lost:
        src = next(p.src for p in plan.transfers if p.dst == rank)
        return ("buddy" if buddy else "replica"), src
    return "live", None


def verify_restored(
    plan: SourceMap,
    rank: int,
    tensors: Sequence[torch.Tensor],
    loop: bytes,
    *,
    reports: Mapping[int, RankReport],
    job_rank: Callable[[int], int],
    buddy: bool,
) -> Verdict:
    """Check this rank's restored ``tensors`` and ``loop`` bytes against the fingerprint recorded for
    ``plan.step`` (every rank calls it after the plan's transfers, before decoding the loop state).

    ``reports``: every rank's report as gathered before the plan, by generation rank (the records
    they vouch for); ``job_rank``: a generation rank's job rank (the records' keys)."""
    step = plan.step
    assert step is not None, "a fallback plan restores nothing from memory"
    source, holder = _source(plan, rank, buddy)
    since = max(report.timeline for report in reports.values())

    def recorded(r: int, by: int) -> StateFingerprint | None:
        """Rank ``r``'s record of ``step`` as rank ``by`` vouches for it (its own, or a held copy's)."""
        report = reports.get(by)
        fingerprint = report.records.get((job_rank(r), step)) if report is not None else None
        return fingerprint if fingerprint is not None and fingerprint.gen >= since else None

    # The rank's own record when it has one (it kept it: a survivor), else the one its buddy's copy
    # carried (a replaced rank: its records died with its process).
    expected = recorded(rank, rank)
    if expected is None and source == "buddy":
        assert holder is not None
        expected = recorded(rank, holder)
    if source == "replica":
        assert holder is not None
        # A replica's shard and loop state: its record is the reference (the loop state differs
        # between replicas in the data loader's dp_rank, which a loader does not restore). A record
        # of this rank's own, if it made one before it was lost, must agree on the tensors too.
        own, expected = expected, recorded(holder, holder)
        if own is not None and expected is not None and own.tensors != expected.tensors:
            expected = replace(expected, tensors=own.tensors)  # the replicas disagree: reject
    got = StateFingerprint(step, -1, tensors_fingerprint(tensors), loop_fingerprint(loop))
    problem = NO_RECORD if expected is None else expected.mismatch(got)
    return Verdict(
        rank,
        job_rank(rank),
        source,
        holder,
        None if holder is None else job_rank(holder),
        step,
        problem,
        expected=expected.encode() if expected is not None else None,
        got=got.encode(),
    )
