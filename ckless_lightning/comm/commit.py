"""The step-commit vote: no rank applies an optimizer step that another rank does not.

Protocol (through the job store, under the generation's keys): after its
gradients are complete and clipped, a rank adds 1 to ``gen<g>/vote/<step>``;
the rank whose add makes it ``world_size`` writes ``commit`` into
``gen<g>/decision/<step>``. Waiting ranks poll that key and the job's
generation. A rank that sees the generation move on writes ``abandon`` there
instead. Both writes are ``compare_set`` from "no value", so exactly one
decision exists per step and every rank obeys the same one: either every live
rank applies the step or none does.
"""

from __future__ import annotations

import time

from ckless_lightning.comm.store import JobStore

__all__ = ["GenerationChanged", "StepCommit"]

_GEN_CHECK_S = 0.02  # how often a waiting voter reads the generation


class GenerationChanged(RuntimeError):
    """The job moved past this rank's generation (a fault elsewhere): leave ``fit`` and rejoin."""

    def __init__(self, generation: int, current: int, where: str) -> None:
        self.generation = generation
        self.current = current
        super().__init__(f"generation {generation} ended (now {current}) while {where}")


class StepCommit:
    """One generation's vote. ``vote(step)`` returns once the step is committed, else raises.

    Called once per optimizer step by every rank, after the gradient clipping
    and before the update. ``wait_s`` / ``votes`` accumulate the cost.
    """

    def __init__(self, store: JobStore, *, generation: int, world_size: int) -> None:
        self.store = store
        self.generation = generation
        self.world_size = world_size
        self.wait_s = 0.0
        self.votes = 0

    def vote(self, step: int) -> None:
        start = time.perf_counter()
        raw = self.store.store
        prefix = f"gen{self.generation}"
        decision_key = f"{prefix}/decision/{step}"
        if raw.add(f"{prefix}/vote/{step}", 1) >= self.world_size:
            decision = raw.compare_set(decision_key, "", "commit")
        else:
            decision = self._wait(decision_key, step)
        self.wait_s += time.perf_counter() - start
        self.votes += 1
        if decision != b"commit":
            current = self.store.generation()
            raise GenerationChanged(self.generation, current, f"voting on step {step}: abandoned")

    def _wait(self, key: str, step: int) -> bytes:
        raw = self.store.store
        pause = 5e-5
        next_gen_check = time.monotonic() + _GEN_CHECK_S
        while not raw.check([key]):
            if time.monotonic() >= next_gen_check:
                if self.store.generation() != self.generation:
                    return raw.compare_set(key, "", "abandon")
                next_gen_check = time.monotonic() + _GEN_CHECK_S
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        return raw.get(key)
