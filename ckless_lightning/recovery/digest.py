"""A digest of a rank's state in its commit vote: silent corruption caught within N steps.

Why: a bit flipped in memory, or in a reduction on bad hardware, leaves a rank training on
wrong state without an error; none of the systems we compare against checks for it per step.
HSDP replicas of a shard must hold the same bytes after every committed step (they apply the
same reduced gradients to the same values), so the vote compares them.

What is digested: the rank's local state as the vote of step ``s`` sees it, which is the
state after the update of step ``s - 1`` (parameter shards and optimizer state,
:func:`~ckless_lightning.replication.state.local_state_tensors`). Each vote covers one part in
``every`` of every tensor's bytes, part ``s % every`` (small tensors whole, in part 0), so
every byte is compared once every ``every`` steps at ``1/every`` of the cost. A part's digest
is the 64-bit wrapping sum of its bytes taken as 8-byte words (one flipped bit changes the sum
by ± 2**k, never 0 modulo 2**64), computed where the tensors live (one small device-to-host
copy per vote); the per-tensor sums are hashed into one 16-hex-digit value, so a vote adds a
short value to the store at any size.

The comparison (:func:`disagreeing`) is a pure function of the digests: in each group of
replicas of one shard, ranks outside the strict majority disagree; with no strict majority
(two copies that differ), every copy of the group is suspect, since nothing tells which is
right. The suspects are named and counted; the repair is the same either way (the recovery
loop): the corrupt copy's gradients entered every replica's update from the step after the
corruption, so even the majority's live state is not clean, and the job resumes from the last
checkpoint of a step before the corruption can have happened (``step - 1 - every``).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from ckless_lightning.replication.fingerprint import gather_sums, host_bytes, storage_of

__all__ = ["StateDigest", "disagreeing", "replica_groups"]

_WORD = 8
_WHOLE_BELOW = 512  # bytes per part: a tensor smaller than every x this is digested whole, in part 0


class StateDigest:
    """Digests ``1/every`` of a rank's state per step (see the module docstring).

    ``of(tensors, step)`` is called in the vote of ``step``, once per optimizer step; ``seconds``
    accumulates its wall time.
    """

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(
                f"a state digest covers 1/every of the state per step; every must be >= 1, got {every}"
            )
        self.every = every
        self.seconds = 0.0
        self.count = 0
        # Per part, made the first time a vote covers it: a generation's first vote makes only its
        # own part's (bench/digest.py, llama3_tiny's 156 tensors: 1.0 ms against 2.9 ms for all 10)
        self._views: dict[int, list[np.ndarray | torch.Tensor]] = {}
        self._bytes: list[np.ndarray | torch.Tensor] | None = None  # each tensor's bytes, made once
        self._storage: list[int] = []  # of the state the views read

    def part(self, step: int) -> int:
        """Which part of every tensor the vote of ``step`` covers."""
        return step % self.every

    def of(self, tensors: Sequence[torch.Tensor], step: int) -> str:
        """The digest of part :meth:`part` of ``tensors`` (hex; equal state gives an equal digest)."""
        start = time.perf_counter()
        part = self.part(step)
        if self._bytes is None or len(tensors) != len(self._storage) or storage_of(tensors) != self._storage:
            self._bytes = [_as_bytes(t) for t in tensors]
            self._views = {}
            self._storage = storage_of(tensors)
        views = self._views.get(part)
        if views is None:
            views = self._views[part] = self._part_views(self._bytes, part)
        sums = np.zeros(len(views), dtype=np.int64)
        on_device: list[int] = []
        for i, view in enumerate(views):
            if isinstance(view, np.ndarray):
                sums[i] = view.sum(dtype=np.int64)
            else:
                on_device.append(i)
        if on_device:  # one copy per device: a rank's state spans devices (Adam's step)
            with torch.no_grad():
                sums[on_device] = gather_sums([views[i].sum(dtype=torch.int64) for i in on_device])
        digest = hashlib.blake2b(sums.tobytes(), digest_size=8).hexdigest()
        self.seconds += time.perf_counter() - start
        self.count += 1
        return f"{part}:{digest}"

    def release(self) -> None:
        """Drop the views of the last state digested (they keep its storage alive): call when the
        rank leaves a generation."""
        self._views, self._bytes, self._storage = {}, None, []

    def _part_views(
        self, tensors_bytes: Sequence[np.ndarray | torch.Tensor], part: int
    ) -> list[np.ndarray | torch.Tensor]:
        """What the vote of part ``part`` sums, one view per tensor that has bytes in that part
        (``tensors_bytes``: each state tensor's bytes, :func:`_as_bytes`).

        Small tensors (under ``_WHOLE_BELOW`` bytes per part) are all in part 0, summed as bytes:
        a vote's cost is a call per tensor it touches, which dominates at small sizes. The rest are
        split evenly, summed as 8-byte words where the storage allows it, else as bytes. Host
        tensors are read as numpy views (a call costs a microsecond, not several), others where
        they live.
        """
        views: list[np.ndarray | torch.Tensor] = []
        for as_bytes in tensors_bytes:
            nbytes = as_bytes.shape[0]
            if nbytes < self.every * _WHOLE_BELOW:
                if part == 0:
                    views.append(as_bytes)
                continue
            words = as_bytes
            if nbytes % _WORD == 0 and _address(as_bytes) % _WORD == 0:
                words = as_bytes.view(np.int64 if isinstance(as_bytes, np.ndarray) else torch.int64)
            n = words.shape[0]
            views.append(words[n * part // self.every : n * (part + 1) // self.every])
        return views


def _as_bytes(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """``t``'s bytes, flat: a numpy view on the host (:func:`host_bytes`), else a uint8 view on its device."""
    flat = t.detach().reshape(-1)
    as_bytes = host_bytes(flat)
    return flat.view(torch.uint8) if as_bytes is None else as_bytes


def _address(data: np.ndarray | torch.Tensor) -> int:
    """Where ``data``'s first byte is."""
    return data.ctypes.data if isinstance(data, np.ndarray) else data.data_ptr()


def replica_groups(replicate: int, shard: int) -> list[list[int]]:
    """The ranks that hold the same shard: rank ``i * shard + s`` is replica ``i`` of shard ``s``."""
    return [[i * shard + s for i in range(replicate)] for s in range(shard)]


def disagreeing(digests: dict[int, str], groups: Sequence[Sequence[int]]) -> list[int]:
    """The ranks whose digest is not their group's strict majority (every rank of a group that has
    none); ranks without a digest are not judged."""
    suspects: list[int] = []
    for group in groups:
        present = {r: digests[r] for r in group if r in digests}
        if len(set(present.values())) <= 1:
            continue
        (value, count), *_ = Counter(present.values()).most_common()
        if 2 * count > len(present):
            suspects += [r for r, d in present.items() if d != value]
        else:
            suspects += sorted(present)
    return sorted(suspects)
