"""A generation's namespace of the job store whose blocking reads end when the generation does.

Why: forming a generation's process groups (``init_process_group``, every
``new_group``, DeviceMesh's sub-groups, tier 4's gloo group) blocks in store
reads until every peer has published its address (gloo) or unique id (NCCL).
A peer that dies or stops between the join barrier and that point would leave
the others blocked for the whole ``timeout`` torch passes down (the collective
timeout, minutes), deaf to the new generation the agents start meanwhile.
Handing torch this store instead makes every such read return as soon as the
job's generation moves on (:class:`GenerationChanged`) and, at the latest,
after ``comm.init_timeout_s`` (``TimeoutError`` naming the missing key), so
the rank leaves for the next generation like after any other fault.

torch accepts a Python subclass of ``torch.distributed.Store`` wherever a store
goes (its pybind trampoline calls these methods from C++); checked on torch 2.13
with gloo (``init_process_group`` and ``new_group``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

__all__ = ["GenerationBoundStore", "GenerationChanged"]

_POLL_S = (1e-4, 5e-3)  # first and longest pause between checks while a key is missing


class GenerationChanged(RuntimeError):
    """The job moved past this rank's generation (a fault elsewhere): leave ``fit`` and rejoin."""

    def __init__(self, generation: int, current: int, where: str) -> None:
        self.generation = generation
        self.current = current
        super().__init__(f"generation {generation} ended (now {current}) while {where}")


class GenerationBoundStore(dist.Store):
    """Wraps ``inner`` (generation ``generation``'s namespace); reads wait at most ``timeout_s``.

    Args:
        inner: the namespace to delegate to.
        generation: the generation this namespace belongs to.
        current: reads the job's current generation (one store round trip).
        timeout_s: the longest any read waits for a missing key (``comm.init_timeout_s``).
    """

    def __init__(
        self, inner: dist.Store, *, generation: int, current: Callable[[], int], timeout_s: float
    ) -> None:
        super().__init__()
        self.inner = inner
        self.generation = generation
        self.current = current
        self.timeout_s = timeout_s

    # -- blocking reads: bounded and generation-aware --------------------------------------------------
    def get(self, key: str) -> bytes:
        self._wait_for([key])
        return self.inner.get(key)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = self.timeout_s if timeout is None else min(self.timeout_s, timeout.total_seconds())
        self._wait_for(list(keys), limit)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._wait_for(list(keys))
        return self.inner.multi_get(list(keys))

    # -- everything else: as the namespace does ----------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.inner.multi_set(list(keys), list(values))

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: Sequence[str]) -> bool:
        return self.inner.check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def clone(self) -> GenerationBoundStore:
        return GenerationBoundStore(
            self.inner.clone(), generation=self.generation, current=self.current, timeout_s=self.timeout_s
        )

    # -- internals ---------------------------------------------------------------------------------------
    def _wait_for(self, keys: list[str], limit_s: float | None = None) -> None:
        limit_s = self.timeout_s if limit_s is None else limit_s
        deadline = time.monotonic() + limit_s
        pause = _POLL_S[0]
        while not self.inner.check(keys):
            if (now := self.current()) != self.generation:
                raise GenerationChanged(self.generation, now, f"forming process groups (waiting for {keys})")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"generation {self.generation}: store keys {keys} did not appear within {limit_s:.0f} s "
                    "while forming process groups (a peer stopped or died before publishing its address); "
                    "moving to the next generation. The bound is comm.init_timeout_s."
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])
