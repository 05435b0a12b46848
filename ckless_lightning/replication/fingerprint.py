"""Fingerprints of a rank's state: what every tier-4 restore is verified against.

Why: a restore moves state between generations (a survivor's live tensors), between
processes (a buddy's host copy, an HSDP replica's shard) and between host slots (a rank's own
copy). Checksums of the bytes in flight say a transfer delivered what its source sent; they
cannot say that what the source sent, or what a survivor adopts, is the state its owner had at
the step it is labelled with. So after every committed step each rank records a fingerprint
of its state, labelled with that step, where it outlives the rank (the job store,
:meth:`~ckless_lightning.comm.JobStore.record_state`), and a restore compares the state every
rank ends up with against the fingerprint recorded for the step it resumes at, before the first
step after the recovery (:class:`~ckless_lightning.recovery.memory.MemoryRestore`).

What is fingerprinted: the rank's local state tensors (parameter shards and optimizer state,
:func:`~ckless_lightning.replication.state.local_state_tensors`, in that order) and its loop
state (the bytes of Lightning's checkpoint without tensors plus the RNG states: loop counters,
data position, scheduler, callbacks). Each tensor contributes the 64-bit wrapping sum of its
bytes read as 8-byte words (zero-padded to a multiple of 8); the sums, in order, are hashed with
BLAKE2b, and so are the loop bytes. A flipped bit changes its tensor's sum by +/- 2**k (never 0
modulo 2**64); a state of another step changes every sum it touches; a tensor in another place
changes the order of the sums. Not detected: a permutation of words inside one tensor (the
bucketed transfer's checksums cover the bytes in flight).

Two ways to compute the same value: :func:`tensors_fingerprint` over the live tensors (one sum
per tensor, on the tensor's own device, then one device-to-host copy per device: a rank's state
spans devices, Adam's ``step`` counters stay on the CPU), and :func:`flat_fingerprint` over a
host buffer that holds them back to back (``FlatBuffer.fingerprint``: one cumulative sum over
the buffer, what a buddy copy costs to fingerprint on top of the copy itself).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "StateFingerprint",
    "flat_fingerprint",
    "gather_sums",
    "loop_fingerprint",
    "tensors_fingerprint",
    "word_sum",
]

WORD = 8  # bytes of one summed word; FlatBuffer aligns every tensor to it
_DIGEST_BYTES = 16


@dataclass(frozen=True)
class StateFingerprint:
    """A rank's state at ``step``, recorded in generation ``gen`` (hex digests of its tensors and of
    its loop state)."""

    step: int
    gen: int
    tensors: str
    loop: str

    def encode(self) -> str:
        return f"{self.step} {self.gen} {self.tensors} {self.loop}"

    @classmethod
    def parse(cls, raw: bytes | str) -> StateFingerprint:
        text = raw.decode() if isinstance(raw, bytes) else raw
        step, gen, tensors, loop = text.split()
        return cls(int(step), int(gen), tensors, loop)

    def mismatch(self, other: StateFingerprint) -> str | None:
        """What of ``other`` differs from this one (``"tensors"``, ``"loop"``, both), None if nothing."""
        parts = [name for name in ("tensors", "loop") if getattr(self, name) != getattr(other, name)]
        return " and ".join(parts) or None


def word_sum(t: torch.Tensor) -> torch.Tensor:
    """The wrapping int64 sum of ``t``'s bytes as 8-byte words, zero-padded (a 0-dim int64 tensor on
    ``t``'s device). ``t`` must be contiguous; call under ``torch.no_grad()``."""
    if t.dim() and (t.shape[-1] * t.element_size()) % WORD == 0 and t.data_ptr() % WORD == 0:
        return t.view(torch.int64).sum(dtype=torch.int64)  # no reshape: a call less per tensor
    data = t.reshape(-1).view(torch.uint8)
    return torch.nn.functional.pad(data, (0, -data.numel() % WORD)).view(torch.int64).sum(dtype=torch.int64)


# A one-element tensor of this many bytes, zero-padded to a word, is this integer type's value
# with its upper bytes cleared (little-endian, as every platform torch runs on).
_SCALAR_AS = {1: (torch.uint8, 0xFF), 2: (torch.int16, 0xFFFF), 4: (torch.int32, 0xFFFFFFFF)}


def _scalar_words(scalars: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`word_sum` of each one-element tensor (same device and dtype), in two torch calls."""
    stacked = torch.stack([s.detach().reshape(()) for s in scalars])
    size = stacked.element_size()
    if size == WORD:
        return stacked.view(torch.int64)
    as_int, mask = _SCALAR_AS[size]
    return stacked.view(as_int).to(torch.int64) & mask


def gather_sums(sums: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-dim int64 tensors on any devices -> one int64 CPU tensor in the same order, with one
    device-to-host copy per device (not one per tensor: each would wait for its device)."""
    out = torch.empty(len(sums), dtype=torch.int64)
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    for device, index in by_device.items():
        values = torch.stack([sums[i] for i in index])
        out[torch.tensor(index)] = values if device.type == "cpu" else values.cpu()
    return out


def _hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).hexdigest()


def tensors_fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    """The fingerprint of ``tensors`` (contiguous; any devices, any dtypes).

    One sum per tensor, except one-element tensors (Adam's ``step``: one per parameter), which are
    taken together per device and dtype: the call count, not the bytes, is the cost at small sizes.
    """
    sums: list[torch.Tensor | None] = [None] * len(tensors)
    scalars: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    with torch.no_grad():
        for i, t in enumerate(tensors):
            if t.numel() == 1 and t.element_size() <= WORD:
                scalars.setdefault((t.device, t.dtype), []).append(i)
            else:
                sums[i] = word_sum(t)
        for index in scalars.values():
            for i, value in zip(index, _scalar_words([tensors[i] for i in index]), strict=True):
                sums[i] = value
    return _hash(gather_sums(sums).numpy().tobytes())  # type: ignore[arg-type]


def flat_fingerprint(flat: torch.Tensor, offsets: Sequence[int], end: int) -> str:
    """:func:`tensors_fingerprint` of tensors laid out in the uint8 buffer ``flat`` from each of
    ``offsets`` (8-byte aligned, zero padding between them) up to byte ``end``, in one pass."""
    if not offsets:
        return tensors_fingerprint([])
    words = flat[:end].view(torch.int64)
    running = words.cumsum(0, dtype=torch.int64)  # wraps like the per-tensor sums
    ends = torch.tensor([*offsets[1:], end]) // WORD - 1
    starts = torch.tensor(list(offsets)) // WORD - 1
    zero = torch.zeros((), dtype=torch.int64)
    at = lambda i: torch.where(i >= 0, running[i.clamp(min=0)], zero)  # running sum before word 0: 0
    return _hash((at(ends) - at(starts)).numpy().tobytes())


def loop_fingerprint(loop: bytes) -> str:
    """The fingerprint of a step's loop state bytes."""
    return _hash(loop)
