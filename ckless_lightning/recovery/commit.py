"""The step-commit vote: no rank applies an optimizer step that another rank does not.

Protocol (through the job store, under the generation's keys): after its
gradients are complete and clipped, a rank counts its vote for the step
(:meth:`JobStore.vote`); the rank whose vote makes it ``world_size`` decides
``commit`` (:meth:`JobStore.decide`). A waiting rank blocks on the step's decision
key (:meth:`JobStore.wait_decision`, on a client of its own: no polling) until the
last voter decides, or until the job leaves the generation: then the rank's
generation watch, woken by the move, decides ``abandon`` for the step it waits on
(:meth:`StepCommit.job_left`), and a vote started after the move abandons without
waiting. The rank whose vote completes the count decides ``abandon`` too when the
generation has moved: every rank leaves at the same vote, between collectives (an
elastic grow moves the job while its ranks train; without this they would learn of
it only from the watch's cut, in the middle of a collective). Both writes are
``compare_set`` from "no value", so exactly one decision exists per step and every
rank obeys the same one: either every live rank applies the step or none does.

With a state digest (HSDP, :mod:`~ckless_lightning.recovery.digest`), each rank posts the
digest of its state before its vote counts, and the deciding rank compares the replicas of
each shard: when some disagree, the decision is ``disagree <ranks> <trusted step>`` instead of
``commit``, and every rank raises :class:`StateDisagreement` (the step is not applied; the job
moves to a new generation and resumes from the last checkpoint of a step up to the trusted one:
no rank's live state is trusted, since the corrupt replica's gradients have entered every
replica's update since the corruption).

With ``comm.vote=collective`` (:attr:`Generation.vote`), the vote is instead a one-element
all-reduce (MIN) on the generation's process group: each rank contributes 1, or 0 once its
generation watch has seen the job move; the step commits when every rank contributed 1. No store
request per step, and every rank that gets the result gets the same one. A fault inside the
all-reduce can end it on some ranks and not others, so survivors can be one step apart: the
recovery then resumes at a step every rank can reach (tier 4: from copies or the disk,
:func:`~ckless_lightning.replication.source_map.buddy_sources`; tier 3: the disk), never at a mix.
It carries no state digest (the config refuses the two together).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ckless_lightning.comm import Generation, GenerationChanged, JobStore
from ckless_lightning.recovery.digest import StateDigest, disagreeing, replica_groups

__all__ = ["StateDisagreement", "StepCommit"]

_DISAGREE = "disagree"


class StateDisagreement(GenerationChanged):
    """The vote on ``step`` found ``suspects``' state unlike their replicas': the step is abandoned.

    ``trusted_step``: the last step whose state, and so whose disk checkpoint, is known to predate
    the corruption (every part of the state was compared since and agreed until this vote).
    """

    def __init__(
        self, generation: int, current: int, step: int, suspects: list[int], trusted_step: int
    ) -> None:
        self.step = step
        self.suspects = suspects
        self.trusted_step = trusted_step
        super().__init__(generation, current, f"voting on step {step}")

    def __str__(self) -> str:
        names = ", ".join(map(str, self.suspects))
        return (
            f"generation {self.generation}, the vote on step {self.step}: the state of rank(s) {names} "
            f"disagrees with their replicas; resuming from the last checkpoint up to step {self.trusted_step}"
        )


_GEN_CHECK_S = 0.02  # polling (no waiter client): how often a waiting voter reads the generation
# A blocked voter re-reads the generation this often (a mover killed between moving the job and
# waking the watches is the only way to miss the watch's abandon).
_RECHECK_S = 2.0


class StepCommit:
    """One generation's vote. ``vote(step)`` returns once the step is committed, else raises.

    Called once per optimizer step by every rank, after the gradient clipping
    and before the update, with the step in progress (1-based). ``wait_s`` (wall),
    ``cpu_s`` (this thread's CPU) and ``votes`` accumulate the cost. ``waiter``: a store
    client of this rank's own that a waiting vote blocks in (:meth:`JobStore.another_client`,
    reused across generations); None: waiting votes poll the decision on the main client.
    With a waiter, the rank's generation watch calls :meth:`job_left` when the job moves on.
    """

    def __init__(
        self,
        generation: Generation,
        *,
        digest: StateDigest | None = None,
        on_disagreement: Callable[..., None] | None = None,
        waiter: JobStore | None = None,
    ) -> None:
        self.generation = generation
        self.waiter = waiter
        self._waiting: int | None = None  # the step this rank waits on (read by job_left's thread)
        self._moved = False  # set by job_left: the job left this generation
        self.digest = digest
        assert digest is None or generation.vote == "store", "comm.vote=collective carries no state digest"
        self.groups = replica_groups(*generation.mesh) if digest is not None else []
        self.on_disagreement = on_disagreement or (lambda **fields: None)
        self.wait_s = 0.0
        self.cpu_s = 0.0  # this thread's CPU time in votes (the store round trips and polling)
        self.votes = 0

    def vote(self, step: int, state: Callable[[], Sequence[torch.Tensor]] | None = None) -> None:
        """Vote for ``step``; ``state`` gives this rank's local state tensors (for the digest)."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        store, gen = self.generation.store, self.generation.number
        if self.generation.vote == "collective":
            decision = self._all_reduce()
        else:
            decision = self._store_vote(step, state)
        self.wait_s += time.perf_counter() - start
        self.cpu_s += time.thread_time() - cpu_start
        self.votes += 1
        if decision.startswith(_DISAGREE.encode()):
            _, names, trusted = decision.decode().split()
            suspects = [int(r) for r in names.split(",")]
            raise StateDisagreement(gen, store.generation(), step, suspects, int(trusted))
        if decision != b"commit":
            raise GenerationChanged(gen, store.generation(), f"voting on step {step}: abandoned")

    def _store_vote(self, step: int, state: Callable[[], Sequence[torch.Tensor]] | None) -> bytes:
        """The vote through the job store: count this rank's vote, then decide (the last voter) or
        wait for the decision."""
        store, gen = self.generation.store, self.generation.number
        if self.digest is not None and state is not None:
            store.post_digest(gen, step, self.generation.rank, self.digest.of(state(), step))
        if store.vote(gen, step) >= self.generation.world_size:
            # The last voter commits only in a current generation: ranks learn of a move (an
            # elastic grow, a rank leaving) at their next vote, between collectives, not from the
            # watch's cut in the middle of one.
            moved = store.generation() != gen
            return store.decide(gen, step, "abandon" if moved else self._judge(step))
        return self._wait(step)

    def _all_reduce(self) -> bytes:
        """The vote as a collective: MIN over every rank of 1 (0 once this rank's watch saw the job
        leave the generation). A peer lost during it raises here, as any collective does."""
        on_gpu = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        flag = torch.tensor([0 if self._moved else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return b"commit" if int(flag.item()) == 1 else b"abandon"

    def _judge(self, step: int) -> str:
        """The deciding rank's decision: ``commit``, or ``disagree`` when replicas' digests differ."""
        if self.digest is None:
            return "commit"
        store, gen = self.generation.store, self.generation.number
        digests = store.digests(gen, step, list(range(self.generation.world_size)))
        suspects = disagreeing(digests, self.groups)
        if not suspects:
            return "commit"
        # The vote of step s sees the state after step s - 1; a corruption first seen now happened
        # after step s - 1 - every (its part was compared, and agreed, at most `every` votes ago).
        trusted = max(0, step - 1 - self.digest.every)
        # Named by job rank (an elastic generation's ranks are not the job's): what outlives the step.
        job_rank = self.generation.job_rank
        compared = {job_rank(r) for g in self.groups if set(g) & set(suspects) for r in g}
        suspects = [job_rank(r) for r in suspects]
        digests = {job_rank(r): d for r, d in digests.items()}
        counts = {r: store.count_disagreement(r) for r in suspects}
        self.on_disagreement(
            step=step,
            part=self.digest.part(step),
            suspects=suspects,
            times=counts,
            trusted_step=trusted,
            digests={r: digests[r] for r in sorted(compared)},
        )
        return f"{_DISAGREE} {','.join(map(str, suspects))} {trusted}"

    def job_left(self, store: JobStore) -> None:
        """From the generation watch's thread, on its own client ``store``, when the job leaves this
        generation: the vote this rank waits on is decided ``abandon`` (every waiter wakes), and a
        vote it starts later abandons without waiting. Safe in any order with :meth:`_wait` (each
        writes its flag before it reads the other's; a second ``abandon`` is a no-op)."""
        self._moved = True
        step = self._waiting
        if step is not None:
            store.decide(self.generation.number, step, "abandon")

    def _wait(self, step: int) -> bytes:
        if self.waiter is None:
            return self._poll(step)
        store, gen = self.generation.store, self.generation.number
        self._waiting = step
        try:
            if self._moved:
                return store.decide(gen, step, "abandon")
            while (decision := self.waiter.wait_decision(gen, step, timeout_s=_RECHECK_S)) is None:
                if store.generation() != gen:
                    return store.decide(gen, step, "abandon")
            return decision
        finally:
            self._waiting = None

    def _poll(self, step: int) -> bytes:
        store, gen = self.generation.store, self.generation.number
        pause = 5e-5
        next_gen_check = time.monotonic() + _GEN_CHECK_S
        while (decision := store.decision(gen, step)) is None:
            if time.monotonic() >= next_gen_check:
                if store.generation() != gen:
                    return store.decide(gen, step, "abandon")
                next_gen_check = time.monotonic() + _GEN_CHECK_S
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        return decision
