"""The step-commit vote: no rank applies an optimizer step that another rank does not.

Protocol (through the job store, under the generation's keys): after its
gradients are complete and clipped, a rank counts its vote for the step
(:meth:`JobStore.vote`); the rank whose vote makes it ``world_size`` decides
``commit`` (:meth:`JobStore.decide`). Waiting ranks poll the decision and the
job's generation. A rank that sees the generation move on decides ``abandon``
instead. Both writes are ``compare_set`` from "no value", so exactly one
decision exists per step and every rank obeys the same one: either every live
rank applies the step or none does.
"""

from __future__ import annotations

import time

from ckless_lightning.comm import Generation, GenerationChanged

__all__ = ["StepCommit"]

_GEN_CHECK_S = 0.02  # how often a waiting voter reads the generation


class StepCommit:
    """One generation's vote. ``vote(step)`` returns once the step is committed, else raises.

    Called once per optimizer step by every rank, after the gradient clipping
    and before the update, with the step in progress (1-based). ``wait_s`` (wall),
    ``cpu_s`` (this thread's CPU) and ``votes`` accumulate the cost.
    """

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.wait_s = 0.0
        self.cpu_s = 0.0  # this thread's CPU time in votes (the store round trips and polling)
        self.votes = 0

    def vote(self, step: int) -> None:
        start, cpu_start = time.perf_counter(), time.thread_time()
        store, gen = self.generation.store, self.generation.number
        if store.vote(gen, step) >= self.generation.world_size:
            decision = store.decide(gen, step, "commit")
        else:
            decision = self._wait(step)
        self.wait_s += time.perf_counter() - start
        self.cpu_s += time.thread_time() - cpu_start
        self.votes += 1
        if decision != b"commit":
            raise GenerationChanged(gen, store.generation(), f"voting on step {step}: abandoned")

    def _wait(self, step: int) -> bytes:
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
