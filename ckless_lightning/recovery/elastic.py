"""Elastic HSDP: which job ranks train in a generation, when no replacement comes for a lost one.

An HSDP job of ``replicate`` replicas x ``shard`` ranks (job rank ``i * shard + s`` is replica
``i``, shard ``s``) can lose a replica and go on: every shard still has a live copy. With
``elastic.enabled``, the set of job ranks that train is generation state in the job store
(:meth:`~ckless_lightning.comm.JobStore.active_ranks`), changed only by moving the job to a new
generation whose set was fixed before it began:

- **shrink**: a rank of the set has no process in the generation (``member < g``) after
  ``agent.replace_timeout`` in its join barrier (its slot is lost and no spare or node came):
  the next generation trains on the complete replicas only, never fewer than
  ``elastic.min_replicas``; the lost replica's surviving ranks stand by.
- **grow**: every rank of a replica outside the set stands by in the current generation (the
  lost rank's process is back, started by its agent): the next generation trains on the set
  plus that replica, which receives its state from a live replica (tier 4's HSDP restore).

The ranks that train form their process groups among themselves: their order in the set is
their rank in the generation's groups, and the mesh is (replicas in the set, ``shard``). The
global batch stays: the Trainer of a narrower generation accumulates more micro-batches, and
the data is addressed by global sample index (:class:`~ckless_lightning.data.StepBatchLoader`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ElasticPolicy", "StandbyEnded"]


class StandbyEnded(RuntimeError):
    """The job finished while this rank stood by: it has nothing left to train (exit cleanly)."""


@dataclass(frozen=True)
class ElasticPolicy:
    """The rules of one elastic job (``elastic.*``, ``agent.replace_timeout``, its mesh and length).

    Args:
        replicate, shard: the job's full mesh.
        min_replicas: never train on fewer (``elastic.min_replicas``).
        replace_timeout_s: how long a join barrier waits for a lost rank before shrinking.
        max_steps: the job's last step; no replica rejoins for the final step (its ranks would join
            a generation its peers never enter once they finished).
    """

    replicate: int
    shard: int
    min_replicas: int = 1
    replace_timeout_s: float = 60.0
    max_steps: int | None = None

    def __post_init__(self) -> None:
        assert self.replicate >= 2 and self.shard >= 1, (self.replicate, self.shard)
        assert 1 <= self.min_replicas < self.replicate, (self.min_replicas, self.replicate)
        assert self.replace_timeout_s > 0, self.replace_timeout_s

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    def replica_of(self, rank: int) -> int:
        return rank // self.shard

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        return tuple(range(replica * self.shard, (replica + 1) * self.shard))

    def mesh(self, active: tuple[int, ...]) -> tuple[int, int]:
        """The (replicate, shard) mesh of a generation that trains ``active``."""
        assert len(active) % self.shard == 0, (active, self.shard)
        return (len(active) // self.shard, self.shard)

    def without(self, active: tuple[int, ...], missing: set[int]) -> tuple[int, ...] | None:
        """``active`` without the replicas that hold a rank of ``missing``; None if that leaves fewer
        than ``min_replicas`` (the job then waits for the lost ranks)."""
        broken = {self.replica_of(r) for r in missing}
        kept = tuple(r for r in active if self.replica_of(r) not in broken)
        return kept if len(kept) // self.shard >= self.min_replicas else None

    def with_replica(self, active: tuple[int, ...], replica: int) -> tuple[int, ...]:
        return tuple(sorted({*active, *self.replica_ranks(replica)}))

    def may_grow(self, completed_step: int) -> bool:
        """Whether a replica may rejoin once the job completed ``completed_step`` (not at its end)."""
        return self.max_steps is None or completed_step < self.max_steps - 1
