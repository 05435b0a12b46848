"""Who restores a lost rank's state from whom, and at which step: a pure planner.

Why: after a fault the ranks report what they still hold (their live state and
the snapshot copies in memory), and every rank must derive the same recovery
plan from the same reports, so the planner is a deterministic function with no
communication of its own (the caller gathers the reports, runs the plan on
every rank and then the transfers). When no consistent in-memory step exists,
the plan says so, with a one-line reason, and the job falls back to the last
disk checkpoint.

Two layouts:

- HSDP (:func:`hsdp_sources`): rank ``r = i * shard + s`` is replica ``i`` of shard
  ``s``; a lost rank copies the live state of a surviving replica of its shard.
- Buddy snapshots (:func:`buddy_sources`): each rank's periodic snapshot is also
  held by its buddy ``buddy_of(r)``; a lost rank copies it back from the buddy,
  and survivors roll back to their own snapshot of the same step when needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner stays pure: the config's checks import it without torch
    from ckless_lightning.replication.fingerprint import StateFingerprint

__all__ = [
    "RankReport",
    "Rejected",
    "SourceMap",
    "Transfer",
    "buddy_rank",
    "buddy_sources",
    "buddy_survives_node_loss",
    "default_buddy_offset",
    "hsdp_sources",
]


@dataclass(frozen=True)
class Transfer:
    """Copy ``src``'s tensors to ``dst`` (global ranks)."""

    src: int
    dst: int


_FALLBACK = "falling back to the last disk checkpoint"


@dataclass(frozen=True)
class RankReport:
    """What one rank still holds after a fault.

    ``live_step``: the step of its live (training) state, or ``None`` when that
    state is lost or untrusted (a replaced process, a rank whose own code
    raised). ``own_steps``: steps of complete in-memory snapshots of its own
    state. ``held``: for each other rank whose copies it keeps, the steps of
    complete copies it holds (not part of the hash). ``records``: the state fingerprints it vouches
    for, by (job rank of the state's owner, step): its own records and those its held copies
    carry (what a restore verifies against; not planned with). ``timeline``: the generation its
    timeline began in (its last resume from disk or the job's start): records of an earlier
    generation than the latest timeline any rank reports describe a timeline the job has left.
    """

    rank: int
    live_step: int | None
    own_steps: frozenset[int] = frozenset()
    held: dict[int, frozenset[int]] = field(default_factory=dict, hash=False)
    records: dict[tuple[int, int], StateFingerprint] = field(default_factory=dict, hash=False)
    timeline: int = 0


@dataclass(frozen=True)
class Rejected:
    """Sources a restore found bad (a checksum failed in flight, or the state a rank ended up with
    did not match its recorded fingerprint): not planned again in that restore.

    ``live``: ranks whose live state is rejected. ``own``: (rank, step) own copies. ``held``:
    (holder, ward, step) copies a buddy holds. ``pairs``: (source, destination) transfers (HSDP
    replicas, and any pair whose checksum failed).
    """

    live: frozenset[int] = frozenset()
    own: frozenset[tuple[int, int]] = frozenset()
    held: frozenset[tuple[int, int, int]] = frozenset()
    pairs: frozenset[Transfer] = frozenset()

    def __or__(self, other: Rejected) -> Rejected:
        return Rejected(
            self.live | other.live, self.own | other.own, self.held | other.held, self.pairs | other.pairs
        )

    def __bool__(self) -> bool:
        return bool(self.live or self.own or self.held or self.pairs)

    def apply(self, reports: dict[int, RankReport]) -> dict[int, RankReport]:
        """``reports`` without the rejected live states and copies (a planner's input)."""
        out = {}
        for r, report in reports.items():
            out[r] = replace(
                report,
                live_step=None if r in self.live else report.live_step,
                own_steps=frozenset(s for s in report.own_steps if (r, s) not in self.own),
                held={
                    ward: frozenset(s for s in steps if (r, ward, s) not in self.held)
                    for ward, steps in report.held.items()
                },
            )
        return out


@dataclass(frozen=True)
class SourceMap:
    """The outcome every rank agrees on.

    ``step``: the step everyone resumes at, ``None`` to fall back to the last
    disk checkpoint (then ``transfers`` and ``rollback`` are empty).
    ``transfers``: copies to run (source -> lost rank). ``rollback``: ranks that
    copy their own snapshot of ``step`` into their live state. ``lost``: ranks
    whose live state is lost. ``reason``: one line for the log.
    """

    step: int | None
    transfers: tuple[Transfer, ...]
    rollback: frozenset[int]
    lost: tuple[int, ...]
    reason: str

    @property
    def fallback(self) -> bool:
        return self.step is None


def _ranks(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 1, 3``."""
    items = sorted(ranks)
    return ("rank " if len(items) == 1 else "ranks ") + ", ".join(map(str, items))


def _fallback(lost: Iterable[int], why: str) -> SourceMap:
    return SourceMap(None, (), frozenset(), tuple(sorted(lost)), f"{why}: {_FALLBACK}")


def _live(reports: dict[int, RankReport], world: Iterable[int]) -> tuple[dict[int, int], list[int]]:
    """Survivors' live steps, and lost ranks (no report, or ``live_step is None``)."""
    live: dict[int, int] = {}
    lost: list[int] = []
    for r in world:
        report = reports.get(r)
        if report is None or report.live_step is None:
            lost.append(r)
        else:
            live[r] = report.live_step
    return live, lost


def _disagreement(live: dict[int, int]) -> str:
    by_step: dict[int, list[int]] = {}
    for r, step in live.items():
        by_step.setdefault(step, []).append(r)
    parts = "; ".join(f"{_ranks(rs)} at step {step}" for step, rs in sorted(by_step.items(), reverse=True))
    return f"survivors disagree on the live step ({parts})"


def hsdp_sources(
    reports: dict[int, RankReport],
    *,
    replicate: int,
    shard: int,
    exclude: frozenset[Transfer] = frozenset(),
) -> SourceMap:
    """Restore each lost rank from the lowest-numbered surviving replica of its shard.

    Rank ``r = i * shard + s`` is replica ``i``, shard ``s``; a rank missing
    from ``reports`` counts as lost. Survivors must all be at the same live
    step ``T``; pairs in ``exclude`` (rejected before: a checksum or a verification) are not used.
    Falls back (``step=None``) when survivors disagree, none survives, or a
    lost rank has no eligible peer.
    """
    if replicate < 1 or shard < 1:
        raise ValueError(f"hsdp_sources: replicate={replicate} and shard={shard} must be >= 1.")
    world = replicate * shard
    unknown = sorted(set(reports) - set(range(world)))
    if unknown:
        raise ValueError(f"hsdp_sources: reports for {_ranks(unknown)} outside a world of {world}.")
    live, lost = _live(reports, range(world))
    if not live:
        return _fallback(lost, "no rank holds trusted live state")
    if len(set(live.values())) > 1:
        return _fallback(lost, _disagreement(live))
    step = next(iter(live.values()))

    transfers: list[Transfer] = []
    missing: dict[int, list[int]] = {}  # shard -> lost ranks without a source
    for r in lost:
        s = r % shard
        peers = [i * shard + s for i in range(replicate)]
        source = next((p for p in peers if p in live and Transfer(p, r) not in exclude), None)
        if source is None:
            missing.setdefault(s, []).append(r)
        else:
            transfers.append(Transfer(source, r))
    if missing:
        parts = []
        for s, rs in sorted(missing.items()):
            peers = [i * shard + s for i in range(replicate)]
            failed = [p for p in peers if p in live]
            if not failed:
                both = "both" if len(peers) == 2 else "all"
                parts.append(f"no live copy of shard {s} ({_ranks(peers)} {both} lost)")
            else:
                parts.append(
                    f"no live copy of shard {s} for {_ranks(rs)} ({_ranks(failed)} rejected as a source)"
                )
        return _fallback(lost, "; ".join(parts))
    if not lost:
        return SourceMap(step, (), frozenset(), (), f"no rank lost (step {step})")
    return SourceMap(
        step,
        tuple(transfers),
        frozenset(),
        tuple(lost),
        f"{_ranks(lost)} restored from replica peers (step {step})",
    )


def buddy_sources(
    reports: dict[int, RankReport],
    *,
    buddy_of: Callable[[int], int],
    exclude: frozenset[Transfer] = frozenset(),
) -> SourceMap:
    """Resume at the latest step every rank can reach; lost ranks copy from their buddy.

    ``reports`` covers every rank of the job; ``buddy_of(r)`` is the rank that
    holds ``r``'s copies. A step ``S`` is feasible when every survivor is live
    at ``S`` or holds its own snapshot of ``S``, and every rank without live
    state either holds its own complete snapshot of ``S`` (a process that
    raised keeps its copies: they were complete before its state went bad) or
    its buddy holds a complete copy of ``S`` for it (that pair not in
    ``exclude``). A buddy's held copies count whether or not its own live state
    is trusted; a replaced process holds none. The largest feasible step wins;
    ranks not live at it roll back to their own snapshot. Else falls back.
    """
    world = sorted(reports)
    live, untrusted = _live(reports, world)

    def copies(r: int) -> frozenset[int]:
        """Steps of usable copies of rank ``r`` on its buddy."""
        b = buddy_of(r)
        if b not in reports or Transfer(b, r) in exclude:
            return frozenset()
        return frozenset(reports[b].held.get(r, ()))

    from_buddy = {r: copies(r) for r in untrusted}
    candidates = set(live.values()).union(*(reports[r].own_steps for r in world), *from_buddy.values())
    if not live and not candidates:
        return _fallback(untrusted, "no rank holds trusted live state")
    for step in sorted(candidates, reverse=True):
        rollback = {r for r in world if live.get(r) != step and step in reports[r].own_steps}
        lost = [r for r in untrusted if r not in rollback]
        survivors_ok = all(live[r] == step or r in rollback for r in live)
        if survivors_ok and all(step in from_buddy[r] for r in lost):
            transfers = tuple(Transfer(buddy_of(r), r) for r in lost)
            parts = [f"{_ranks(lost)} restored from buddies"] if lost else ["no rank lost"]
            if rollback:
                parts.append(f"{_ranks(rollback)} roll back to their own snapshot")
            return SourceMap(
                step, transfers, frozenset(rollback), tuple(lost), f"{'; '.join(parts)} (step {step})"
            )

    gone = []
    for r in untrusted:
        b = buddy_of(r)
        if Transfer(b, r) in exclude:
            gone.append(f"the copy of rank {r} on its buddy rank {b} was rejected (checksum)")
        elif not from_buddy[r] and not reports[r].own_steps:
            if b not in reports or not reports[b].held:
                gone.append(f"rank {r} and its buddy rank {b} both lost")
            else:
                gone.append(f"rank {r}'s buddy rank {b} holds no complete copy of it")
    if gone:
        return _fallback(untrusted, "; ".join(gone))
    held = "; ".join(f"rank {r}'s buddy holds steps {sorted(from_buddy[r])}" for r in untrusted)
    if len(set(live.values())) > 1:
        held = f"{_disagreement(live)}{'; ' + held if held else ''}"
    return _fallback(untrusted, f"no step that every rank can reach ({held or 'no common snapshot'})")


def buddy_rank(rank: int, *, world_size: int, offset: int) -> int:
    """The rank holding ``rank``'s snapshot copies: ``(rank + offset) % world_size``."""
    return (rank + offset) % world_size


def default_buddy_offset(nnodes: int, nproc_per_node: int) -> int:
    """``nproc_per_node`` with two or more nodes (the buddy is on the next node), else 1."""
    return nproc_per_node if nnodes >= 2 else 1


def buddy_survives_node_loss(offset: int, nnodes: int, nproc_per_node: int) -> bool:
    """Whether every rank's buddy is on another node, so losing one node loses no copy."""
    world = nnodes * nproc_per_node
    if world <= 0 or offset % world == 0:
        return False
    return all(
        r // nproc_per_node != buddy_rank(r, world_size=world, offset=offset) // nproc_per_node
        for r in range(world)
    )
