"""Bucketed, checksummed point-to-point copies of a rank's local tensors to other ranks.

Why: after a fault, a replaced rank gets its state back from a peer that holds
the same state (an HSDP replica, or a buddy that holds a snapshot copy) instead
of from disk. The copy must be fast (several receivers restore in parallel, one
message per bucket per pair rather than one per tensor) and must never leave a
receiver with silently corrupted state: each bucket travels with a checksum,
and a bucket that fails it is never copied into the receiver's tensors. At the
end every rank of the group learns which receivers got everything, so all
ranks take the same decision (resume, try another source, or fall back to disk).

Works over any ``torch.distributed`` backend with point-to-point support
(gloo on CPU, NCCL on CUDA): buckets and checksums live on the group's device
(CUDA for NCCL, else CPU), whatever device the tensors are on.
Ranks in ``pairs`` are global ranks (``torch.distributed.get_rank()``), also
when ``group`` is not the default group; they must be members of ``group``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ckless_lightning.comm.works import wait_works
from ckless_lightning.replication.source_map import Transfer  # defined with the plans that list them

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BucketLayout",
    "Transfer",
    "TransferError",
    "checksum",
    "transfer_bytes",
    "transfer_tensors",
]

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
_ALIGN = 8
_CHECKSUM_CHUNK_WORDS = 1 << 17  # 1 MiB of words per chunk: its temporaries stay in cache


def _align(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def checksum(buf: torch.Tensor) -> torch.Tensor:
    """``[sum(w_i), sum(w_i * (i + 1))]`` (int64, wrapping) of ``buf`` viewed as int64 words ``w_i``.

    ``buf``: a contiguous 1-D uint8 tensor whose length is a multiple of 8.
    Returns a ``[2]`` int64 tensor on ``buf``'s device. The first word changes
    with any single changed byte, the second also with reordered words.
    """
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() % _ALIGN:
        raise ValueError(
            f"checksum: expected a 1-D uint8 tensor of a multiple of 8 bytes, got {buf.dtype} "
            f"{tuple(buf.shape)}"
        )
    words = buf.contiguous().view(torch.int64)
    weights = _weights(buf.device)
    out = torch.zeros(2, dtype=torch.int64, device=buf.device)
    # Chunks that stay in cache, against one cached 1..n ramp: sum(w_i * (start + j + 1)) over a
    # chunk is start * sum(w_i) + sum(w_i * (j + 1)). About 6x faster than a ramp per chunk.
    for start in range(0, words.numel(), _CHECKSUM_CHUNK_WORDS):
        chunk = words[start : start + _CHECKSUM_CHUNK_WORDS]
        total = chunk.sum()
        out[0] += total
        out[1] += total * start + (chunk * weights[: chunk.numel()]).sum()
    return out


def _weights(device: torch.device) -> torch.Tensor:
    """``[1, 2, ..., _CHECKSUM_CHUNK_WORDS]`` (int64) on ``device``, made once per device."""
    if device not in _WEIGHTS:
        _WEIGHTS[device] = torch.arange(1, _CHECKSUM_CHUNK_WORDS + 1, dtype=torch.int64, device=device)
    return _WEIGHTS[device]


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class _Slot:
    bucket: int
    offset: int
    nbytes: int


class BucketLayout:
    """Where each tensor's bytes go in a sequence of uint8 buckets.

    Tensors are assigned in order; a bucket holds at most ``bucket_bytes``
    unless a single tensor is larger (it then gets a bucket of its own). Each
    tensor starts at an 8-byte aligned offset and bucket sizes are multiples
    of 8 (at least 8). Only the tensors' shapes and dtypes matter, so ranks with
    alike tensors get identical layouts. ``tensors`` must be contiguous; they may be on several
    devices (a CUDA rank's state is: Adam keeps each ``step`` on the CPU): :meth:`pack` and
    :meth:`unpack` copy each tensor's bytes between its device and the bucket's.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"BucketLayout: bucket_bytes={bucket_bytes} must be positive.")
        self.bucket_bytes = bucket_bytes
        self._slots: list[_Slot] = []
        self._members: list[list[int]] = []
        self._sizes: list[int] = []
        for index, t in enumerate(tensors):
            if not t.is_contiguous():
                raise ValueError(f"BucketLayout: tensor {index} ({tuple(t.shape)}) is not contiguous.")
            nbytes = t.numel() * t.element_size()
            padded = _align(nbytes)
            if not self._sizes or (self._sizes[-1] > 0 and self._sizes[-1] + padded > bucket_bytes):
                self._sizes.append(0)
                self._members.append([])
            bucket = len(self._sizes) - 1
            self._slots.append(_Slot(bucket, self._sizes[-1], nbytes))
            self._members[bucket].append(index)
            self._sizes[-1] += padded
        self._sizes = [max(size, _ALIGN) for size in self._sizes]
        self.signature = _signature(tensors, bucket_bytes)

    @property
    def num_buckets(self) -> int:
        return len(self._sizes)

    @property
    def total_bytes(self) -> int:
        """Bytes of all buckets together, padding included."""
        return sum(self._sizes)

    def bucket_nbytes(self, i: int) -> int:
        return self._sizes[i]

    def bucket_tensors(self, i: int) -> list[int]:
        """Indices of the tensors in bucket ``i``."""
        return list(self._members[i])

    @torch.no_grad()
    def pack(self, i: int, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """Copy the bytes of bucket ``i``'s tensors into ``out`` (uint8, >= ``bucket_nbytes(i)``)."""
        for index in self._members[i]:
            slot = self._slots[index]
            if slot.nbytes:
                src = tensors[index].reshape(-1).view(torch.uint8)
                out[slot.offset : slot.offset + slot.nbytes].copy_(src)

    @torch.no_grad()
    def unpack(self, i: int, buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy bucket ``i``'s bytes from ``buf`` back into its tensors, in place (storage kept)."""
        for index in self._members[i]:
            slot = self._slots[index]
            if slot.nbytes:
                dst = tensors[index].reshape(-1).view(torch.uint8)
                dst.copy_(buf[slot.offset : slot.offset + slot.nbytes])


def _signature(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> int:
    """A positive int63 digest of the shapes, dtypes and bucket size (what the layout depends on)."""
    text = repr((bucket_bytes, [(tuple(t.shape), str(t.dtype)) for t in tensors]))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little") + 1


class TransferError(RuntimeError):
    """Some transfers did not verify; ``failed`` lists them."""

    def __init__(self, message: str, failed: Sequence[Transfer]) -> None:
        super().__init__(message)
        self.failed: tuple[Transfer, ...] = tuple(failed)


CorruptHook = Callable[[Transfer, int, torch.Tensor], None]


def _group_rank(group: dist.ProcessGroup | None, global_rank: int) -> int:
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def _control_device(group: dist.ProcessGroup | None) -> torch.device:
    """Device for the small agreement tensors: CUDA when the group runs NCCL, else CPU."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_pairs(pairs: Sequence[Transfer], group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` (on every rank alike) for pairs the protocol does not support."""
    size = dist.get_world_size(group)
    dsts = [p.dst for p in pairs]
    if len(set(dsts)) != len(dsts):
        raise ValueError(f"transfer: a rank receives from several sources: {list(pairs)}")
    for p in pairs:
        if p.src == p.dst:
            raise ValueError(f"transfer: {p} sends to itself.")
        for r in (p.src, p.dst):
            gr = _group_rank(group, r)
            if not 0 <= gr < size:
                raise ValueError(f"transfer: rank {r} of {p} is not in the group (size {size}).")
    both = {p.src for p in pairs} & set(dsts)
    if both:
        raise ValueError(f"transfer: ranks {sorted(both)} both send and receive: {list(pairs)}")


def _agree_flags(local: dict[int, int], group: dist.ProcessGroup | None) -> list[int]:
    """Sum, over the group, a per-rank int vector (global rank -> value); returns it by group rank."""
    size = dist.get_world_size(group)
    flags = torch.zeros(size, dtype=torch.int64, device=_control_device(group))
    for r, value in local.items():
        flags[_group_rank(group, r)] = value
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    return [int(v) for v in flags.cpu().tolist()]


def transfer_tensors(
    pairs: Sequence[Transfer],
    tensors: Sequence[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    corrupt: CorruptHook | None = None,
) -> dict[int, bool]:
    """Copy each ``src``'s ``tensors`` into ``dst``'s ``tensors`` in place; return ``{dst: verified}``.

    Called by every rank of ``group`` with the same ``pairs`` (a rank is the
    source of any number of pairs, or the destination of at most one, not both).
    Each rank passes its own local, contiguous tensors; those of the two ranks
    of a pair must have the same shapes and dtypes (checked: ``ValueError`` on
    every rank otherwise). A destination's tensors keep their storage; a bucket
    whose checksum fails is not copied, nor is any later bucket of that pair,
    so a failed destination holds a prefix of verified buckets and its
    untouched rest. Every rank returns the same dict. ``corrupt`` is a test
    hook, called on the sender as ``corrupt(pair, bucket_index, send_buffer)``
    after the checksum was taken and before the send.
    """
    pairs = list(pairs)
    _check_pairs(pairs, group)
    me = dist.get_rank()
    layout = BucketLayout(tensors, bucket_bytes)

    # One small collective first: it checks that the two sides of every pair have alike
    # layouts (a mismatch would hang or garble the copy) and, under NCCL, makes the
    # first call in the group one that every rank joins, as batch_isend_irecv requires.
    involved = {p.src for p in pairs} | {p.dst for p in pairs}
    sigs = _agree_flags({me: layout.signature} if me in involved else {}, group)
    bad = [p for p in pairs if sigs[_group_rank(group, p.src)] != sigs[_group_rank(group, p.dst)]]
    if bad:
        raise ValueError(f"transfer_tensors: tensor shapes/dtypes differ between the ranks of {bad}.")

    sends = [p for p in pairs if p.src == me]
    recv = next((p for p in pairs if p.dst == me), None)
    failed = False
    if sends or recv is not None:
        # Buckets live where the group sends from: a buddy's host copy goes out over NCCL through
        # the device (NCCL cannot send CPU tensors), a CUDA shard over gloo through host memory.
        device = _control_device(group)
        largest = max(layout.bucket_nbytes(i) for i in range(layout.num_buckets)) if tensors else 0
        send_buf = torch.zeros(largest if sends else 0, dtype=torch.uint8, device=device)
        recv_buf = torch.empty(largest if recv is not None else 0, dtype=torch.uint8, device=device)
        recv_ck = torch.empty(2, dtype=torch.int64, device=device)
        for i in range(layout.num_buckets):
            n = layout.bucket_nbytes(i)
            ops: list[dist.P2POp] = []
            if sends:
                buf = send_buf[:n]
                layout.pack(i, tensors, buf)
                ck = checksum(buf)
                for p in sends:
                    out = buf
                    if corrupt is not None:
                        out = buf.clone()  # the hook must not touch the other pairs' copy
                        corrupt(p, i, out)
                    ops.append(dist.P2POp(dist.isend, out, peer=p.dst, group=group))
                    ops.append(dist.P2POp(dist.isend, ck, peer=p.dst, group=group))
            if recv is not None:
                ops.append(dist.P2POp(dist.irecv, recv_buf[:n], peer=recv.src, group=group))
                ops.append(dist.P2POp(dist.irecv, recv_ck, peer=recv.src, group=group))
            wait_works(dist.batch_isend_irecv(ops))
            if recv is not None and not failed:
                if torch.equal(checksum(recv_buf[:n]), recv_ck):
                    layout.unpack(i, recv_buf[:n], tensors)
                else:
                    failed = True

    flags = _agree_flags({me: 1} if failed else {}, group)
    return {p.dst: flags[_group_rank(group, p.dst)] == 0 for p in pairs}


def transfer_bytes(
    pairs: Sequence[Transfer],
    payload: bytes | None,
    *,
    group: dist.ProcessGroup | None = None,
    corrupt: CorruptHook | None = None,
) -> bytes | None:
    """Send each ``src``'s small ``payload`` (e.g. pickled loop counters) to its ``dst``s.

    Called by every rank of ``group`` with the same ``pairs`` (rules as for
    :func:`transfer_tensors`); a source passes its payload, others ``None``
    (ignored). A destination returns what it received, other ranks ``None``.
    If any destination's checksum fails, every rank raises ``TransferError``
    (the ranks agree, so none goes on alone). ``corrupt`` is called on the
    sender as ``corrupt(pair, 0, padded_buffer)`` after the checksum was taken.
    """
    pairs = list(pairs)
    _check_pairs(pairs, group)
    me = dist.get_rank()
    device = _control_device(group)
    sends = [p for p in pairs if p.src == me]
    recv = next((p for p in pairs if p.dst == me), None)
    if sends and payload is None:
        raise ValueError(f"transfer_bytes: rank {me} sends in {sends} but has no payload.")

    length = torch.zeros(1, dtype=torch.int64, device=device)
    data = torch.zeros(0, dtype=torch.uint8, device=device)
    if sends:
        assert payload is not None
        length[0] = len(payload)
        padded = bytearray(payload) + bytes(_align(len(payload)) - len(payload))
        data = torch.frombuffer(padded, dtype=torch.uint8).to(device) if padded else data
    recv_len = torch.zeros(1, dtype=torch.int64, device=device)

    # Round 1: lengths, so that the receiver can size its buffer.
    ops = [dist.P2POp(dist.isend, length, peer=p.dst, group=group) for p in sends]
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv_len, peer=recv.src, group=group))
    if ops:
        wait_works(dist.batch_isend_irecv(ops))

    # Round 2: the padded payload and its checksum.
    received: torch.Tensor | None = None
    recv_ck = torch.empty(2, dtype=torch.int64, device=device)
    ops = []
    if sends:
        ck = checksum(data)
        for p in sends:
            out = data
            if corrupt is not None:
                out = data.clone()
                corrupt(p, 0, out)
            if out.numel():
                ops.append(dist.P2POp(dist.isend, out, peer=p.dst, group=group))
            ops.append(dist.P2POp(dist.isend, ck, peer=p.dst, group=group))
    if recv is not None:
        n = int(recv_len.item())
        received = torch.empty(_align(n), dtype=torch.uint8, device=device)
        if received.numel():
            ops.append(dist.P2POp(dist.irecv, received, peer=recv.src, group=group))
        ops.append(dist.P2POp(dist.irecv, recv_ck, peer=recv.src, group=group))
    if ops:
        wait_works(dist.batch_isend_irecv(ops))

    ok = received is None or torch.equal(checksum(received), recv_ck)
    flags = _agree_flags({me: 0 if ok else 1}, group)
    failed = [p for p in pairs if flags[_group_rank(group, p.dst)]]
    if failed:
        raise TransferError(f"transfer_bytes: checksum mismatch for {failed}", failed)
    if received is None:
        return None
    return bytes(received[: int(recv_len.item())].cpu().tolist())
