"""One generation of the job as one rank sees it: the bundle every per-generation object is built from.

A fault ends a generation; the next one has a new number and new process
groups, the rest stays. The strategy (process-group formation), the step
commit and tier 4's memory restore each read what they need from one
:class:`Generation` instead of having the same values copied through their
constructors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ckless_lightning.comm.store import JobStore

__all__ = ["Generation"]


@dataclass(frozen=True)
class Generation:
    """Generation ``number`` of the job, for ``rank`` of ``world_size``.

    Args:
        store: the job store (node 0's agent hosts it).
        number: the generation; its process groups live under its own store prefix.
        rank, world_size: this rank and the job's world size.
        mesh: the resolved (replicate, shard) DeviceMesh shape.
        pg_timeout_s: collective timeout of the generation's process groups.
        init_timeout_s: the longest wait for a peer while those groups form (``comm.init_timeout_s``).
        join_timeout_s: the longest join barrier before this generation (``comm.join_timeout_s``).
        stuck_grace_s: how long this rank may stay in the generation once the job left it
            (``comm.stuck_grace_s``); then its generation watch cuts its connections.
        stuck_exit_s: how long it may then stay blocked on peers (``comm.stuck_exit_s``) before it
            exits for its agent to replace it.
        vote: how the step vote is decided (``comm.vote``): ``store`` or ``collective``.
        active: an elastic generation that trains some of the job's ranks: their job ranks, in the
            order of their ranks here (``rank`` and ``world_size`` are this generation's); None:
            every job rank, rank ``r`` is job rank ``r``.
    """

    store: JobStore
    number: int
    rank: int
    world_size: int
    mesh: tuple[int, int]
    pg_timeout_s: float = 600.0
    init_timeout_s: float = 60.0
    join_timeout_s: float = 900.0
    stuck_grace_s: float = 0.25
    stuck_exit_s: float = 10.0
    vote: str = "store"
    active: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        assert self.mesh[0] * self.mesh[1] == self.world_size, (self.mesh, self.world_size)
        assert 0 <= self.rank < self.world_size, (self.rank, self.world_size)
        assert self.active is None or len(self.active) == self.world_size, (self.active, self.world_size)

    def job_rank(self, rank: int) -> int:
        """The job rank of this generation's ``rank`` (store keys that outlive a generation use it)."""
        return rank if self.active is None else self.active[rank]

    def next(self, number: int) -> Generation:
        """The same rank in generation ``number``."""
        return replace(self, number=number)
