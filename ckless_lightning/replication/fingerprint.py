"""Fingerprints of a rank's state: what every tier-4 restore is verified against.

Why: a restore moves state between generations (a survivor's live tensors), between
processes (a buddy's host copy, an HSDP replica's shard) and between host slots (a rank's own
copy). Checksums of the bytes in flight say a transfer delivered what its source sent; they
cannot say that what the source sent, or what a survivor adopts, is the state its owner had at
the step it is labelled with. So after every committed step each rank records a fingerprint
of its state, labelled with that step, kept by the rank and carried by the step's copy to its
buddy (:class:`~ckless_lightning.replication.snapshots.SnapshotCopies`), and a restore compares
the state every rank ends up with against the fingerprint recorded for the step it resumes at,
before the first step after the recovery (:class:`~ckless_lightning.recovery.memory.MemoryRestore`).

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
per tensor: numpy's over a view of a host tensor, torch's on the tensor's own device otherwise,
then one device-to-host copy per device: a rank's state spans devices, Adam's ``step`` counters
stay on the CPU), and :func:`flat_fingerprint` over a host buffer that holds them back to back
(``FlatBuffer.fingerprint``: one segmented sum over the buffer, what a buddy copy costs to
fingerprint on top of the copy itself).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "StateFingerprint",
    "TensorSums",
    "flat_fingerprint",
    "gather_sums",
    "host_bytes",
    "host_word_sum",
    "loop_fingerprint",
    "storage_of",
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


# Dtypes numpy has; a host tensor of another (bfloat16, float8) is read as the integer of its size.
_NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128}
)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_bytes(t: torch.Tensor) -> np.ndarray | None:
    """``t``'s bytes as a flat uint8 numpy array, a view without a copy, if ``t`` is a contiguous
    CPU tensor; else None (sum it with torch where it lives).

    Why numpy: a numpy call over a view costs about a microsecond, a torch one several, and the
    call count, not the bytes, is what a few hundred small tensors cost per step. Integer sums
    wrap modulo 2**64 in both.
    """
    if not t.is_cpu or not t.is_contiguous():
        return None
    if t.dtype not in _NUMPY_DTYPES:
        t = t.view(_INT_OF_SIZE[t.element_size()])
    return t.detach().numpy().reshape(-1).view(np.uint8)


def host_word_sum(data: np.ndarray) -> np.int64:
    """:func:`word_sum` of the bytes ``data`` (uint8, flat), on the host."""
    whole = data.size - data.size % WORD
    total = data[:whole].view(np.int64).sum() if whole else np.int64(0)
    if whole == data.size:
        return total
    tail = np.zeros(WORD, dtype=np.uint8)
    tail[: data.size - whole] = data[whole:]
    return np.array([total, tail.view(np.int64)[0]]).sum()  # an array sum: wraps without a warning


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
    return _words_of_stacked(torch.stack([s.detach().reshape(()) for s in scalars]))


def _words_of_stacked(stacked: torch.Tensor) -> torch.Tensor:
    """:func:`word_sum` of each element of a 1-D tensor of one-element values."""
    size = stacked.element_size()
    if size == WORD:
        return stacked.view(torch.int64)
    as_int, mask = _SCALAR_AS[size]
    return stacked.view(as_int).to(torch.int64) & mask


def gather_sums(sums: Sequence[torch.Tensor]) -> np.ndarray:
    """0-dim int64 tensors on any devices -> one int64 array in the same order, with one
    device-to-host copy per device (not one per tensor: each would wait for its device)."""
    out = np.empty(len(sums), dtype=np.int64)
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    for device, index in by_device.items():
        values = torch.stack([sums[i] for i in index])
        out[index] = (values if device.type == "cpu" else values.cpu()).numpy()
    return out


def _hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).hexdigest()


def storage_of(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Where each tensor's bytes are: what views made of them must still read (views keep their
    storage alive, so an address seen again while they exist is the same storage)."""
    return [t.data_ptr() for t in tensors]


class TensorSums:
    """The word sums of one list of tensors (contiguous; any devices, any dtypes), called once per
    step on a rank's state.

    The views each sum reads are made once: a rank's state stays in the same storage across steps
    (FSDP2 keeps its sharded storage, the optimizer updates its state in place), and making a
    view costs more than summing a small tensor. A call then costs one numpy sum per host tensor
    (a view of its bytes as words), one torch sum per device tensor (on its device, then one
    device-to-host copy per device: a rank's state spans devices, Adam's ``step`` counters stay
    on the CPU), and one stack per group of one-element tensors (Adam's ``step``: one per
    parameter). :meth:`matches` says whether these views still read ``tensors``' storage.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self._storage = storage_of(self.tensors)
        self._words: list[tuple[int, np.ndarray]] = []  # host, whole words: summed as int64
        self._ragged: list[tuple[int, np.ndarray]] = []  # host, bytes not a whole number of words
        self._device: list[tuple[int, torch.Tensor]] = []  # summed by torch where they live
        scalars: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(self.tensors):
            if t.numel() == 1 and t.element_size() <= WORD:
                scalars.setdefault((t.device, t.dtype), []).append(i)
            elif not t.numel():
                continue  # sums to 0
            elif (data := host_bytes(t)) is None:
                self._device.append((i, t.detach()))
            elif data.size % WORD:
                self._ragged.append((i, data))
            else:
                self._words.append((i, data.view(np.int64)))
        self._scalars = [  # 0-dim views, stacked in one call per group
            (index, [self.tensors[i].detach().reshape(()) for i in index]) for index in scalars.values()
        ]

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether these sums read ``tensors``' storage."""
        return len(tensors) == len(self.tensors) and storage_of(tensors) == self._storage

    def sums(self) -> np.ndarray:
        """Each tensor's word sum, in order (int64)."""
        out = np.zeros(len(self.tensors), dtype=np.int64)
        for i, words in self._words:
            out[i] = words.sum()
        for i, data in self._ragged:
            out[i] = host_word_sum(data)
        on_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
        with torch.no_grad():
            for i, t in self._device:
                on_device.setdefault(t.device, []).append(([i], word_sum(t).reshape(1)))
            for index, views in self._scalars:
                words = _words_of_stacked(torch.stack(views))
                if words.is_cpu:
                    out[index] = words.numpy()
                else:
                    on_device.setdefault(words.device, []).append((index, words))
            for parts in on_device.values():  # one device-to-host copy per device
                index = [i for part_index, _ in parts for i in part_index]
                out[index] = torch.cat([words for _, words in parts]).cpu().numpy()
        return out

    def fingerprint(self) -> str:
        """:func:`tensors_fingerprint` of the tensors, as they are now."""
        return _hash(self.sums().tobytes())


def tensors_fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    """The fingerprint of ``tensors`` (contiguous; any devices, any dtypes); for one list summed
    at every step, keep a :class:`TensorSums`."""
    return TensorSums(tensors).fingerprint()


def flat_fingerprint(flat: torch.Tensor, offsets: Sequence[int], end: int) -> str:
    """:func:`tensors_fingerprint` of tensors laid out in the uint8 CPU buffer ``flat`` from each of
    ``offsets`` (8-byte aligned, zero padding between them) up to byte ``end``, in one pass (numpy's
    ``add.reduceat``: a sum per segment, nothing written but the sums)."""
    sums = np.zeros(len(offsets), dtype=np.int64)
    starts = np.asarray(offsets, dtype=np.int64) // WORD
    ends = np.append(starts[1:], end // WORD)
    nonempty = starts < ends  # reduceat gives an empty segment its first word, not 0
    if nonempty.any():
        words = flat[:end].numpy().view(np.int64)
        sums[nonempty] = np.add.reduceat(words, starts[nonempty])
    return _hash(sums.tobytes())


def loop_fingerprint(loop: bytes) -> str:
    """The fingerprint of a step's loop state bytes."""
    return _hash(loop)
