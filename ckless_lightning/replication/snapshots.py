"""What a rank keeps in host memory for tier 4, across generations: its live state's step and
loop counters, and (``buddy`` source) snapshot copies of its own shard and of its ward's.

Buddy placement: rank r's copies live on ``buddy_rank(r)`` = (r + offset) % world;
the rank whose copies r holds is its *ward*, (r - offset) % world. After every
``every_n_steps``-th committed step each rank copies its local state into one
of two own slots (double-buffered, so a fault during a copy never leaves a rank
without a complete one), sends that slot to its buddy and receives its ward's
into one of two held slots. The exchange runs asynchronously on its own gloo
group, overlapped with the end of the step (logging, checkpointing) and the next
batch fetch; it is settled (waited for) before the next step's first batch
(``SnapshotCallback``) and before the rank leaves a generation, so a fault
during a step always finds the last committed step's copies complete.

Nothing here knows Lightning: the loop counters arrive as opaque bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckless_lightning.replication.source_map import RankReport, buddy_rank
from ckless_lightning.replication.state import LiveParam, flat_tensors

__all__ = ["FlatBuffer", "Snapshot", "SnapshotCopies"]

_ALIGN = 8
_HEADER = 8  # the loop buffer starts with its payload length (int64)


class FlatBuffer:
    """One contiguous uint8 host buffer with a typed view per tensor (8-byte aligned), then
    ``tail_bytes`` more (the loop state: one buffer, so one send and one receive per exchange)."""

    def __init__(self, like: Sequence[torch.Tensor], tail_bytes: int = 0) -> None:
        offsets, total = [], 0
        for t in like:
            offsets.append(total)
            total += -(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN
        # Pinned where a GPU is: device-to-host copies of the shard then run at full bandwidth.
        self.flat = torch.zeros(
            max(total + tail_bytes, _ALIGN), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
        )
        self.views = [
            self.flat[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for off, t in zip(offsets, like, strict=True)
        ]
        self.tail = self.flat[total : total + tail_bytes]

    def matches(self, like: Sequence[torch.Tensor]) -> bool:
        return len(like) == len(self.views) and all(
            v.shape == t.shape and v.dtype == t.dtype for v, t in zip(self.views, like, strict=True)
        )


@dataclass
class Snapshot:
    """One copy of a rank's state at ``step``; ``complete`` once fully written (or received)."""

    buffer: FlatBuffer  # the tensors, then the loop area: an 8-byte length and the pickled loop state
    step: int = -1
    complete: bool = False

    @property
    def loop(self) -> torch.Tensor:
        return self.buffer.tail

    def loop_bytes(self) -> bytes:
        n = int(self.loop[:_HEADER].view(torch.int64).item())
        return bytes(self.loop[_HEADER : _HEADER + n].numpy())


@dataclass
class _Exchange:
    works: list[Any]
    held: Snapshot | None
    step: int


@dataclass
class SnapshotCopies:
    """Per rank process. ``source`` (config ``replication.source``): "hsdp" (live state only) or "buddy"
    (plus copies)."""

    rank: int
    world_size: int
    source: str
    every_n_steps: int = 1
    buddy_offset: int = 1
    loop_capacity: int = 1 << 20
    live_step: int | None = None  # step of the live tensors, None if untrusted
    live_loop: bytes | None = None
    live_params: list[LiveParam] | None = None  # captured when leaving a generation
    live_tensors: list[torch.Tensor] | None = None  # the same, flat (``flat_tensors``)
    own: list[Snapshot] = field(default_factory=list)
    held: list[Snapshot] = field(default_factory=list)
    group: Any = None  # the exchange's process group (buddy), one per generation
    _pending: _Exchange | None = None
    _ward_like: list[torch.Tensor] | None = None  # meta tensors shaped like the ward's shard

    def __post_init__(self) -> None:
        if self.source not in ("hsdp", "buddy"):
            raise ValueError(f"replication.source must be hsdp or buddy, got {self.source!r}")
        self.buddy = buddy_rank(self.rank, world_size=self.world_size, offset=self.buddy_offset)
        self.ward = (self.rank - self.buddy_offset) % self.world_size

    # -- steady state ----------------------------------------------------------------------------------
    def attach(self, group: Any) -> None:
        """A new generation's exchange group (buddy); the ward's shard shapes are learned again."""
        self.group = group
        self._ward_like = None

    def record(self, step: int, loop: bytes, tensors: Sequence[torch.Tensor]) -> None:
        """After committed step ``step``: remember its loop state; every k-th step, copy and exchange."""
        self.live_step, self.live_loop = step, loop
        if self.source != "buddy" or step % self.every_n_steps:
            return
        self.settle()
        own = self._slot(self.own, tensors, step)
        with torch.no_grad():  # one fused call: a copy_ per tensor costs more than the bytes here
            torch._foreach_copy_(own.buffer.views, list(tensors), non_blocking=True)
        if tensors and tensors[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the exchange's gloo threads read the buffer
        self._write_loop(own, loop)
        own.step, own.complete = step, True
        held = self._slot(self.held, self._ward_shapes(tensors), step)
        held.complete = False
        ops = [
            dist.P2POp(dist.isend, own.buffer.flat, peer=self.buddy, group=self.group),
            dist.P2POp(dist.irecv, held.buffer.flat, peer=self.ward, group=self.group),
        ]
        held.step = step
        self._pending = _Exchange(dist.batch_isend_irecv(ops), held, step)

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait for the exchange in flight, if any; True if it completed (the held copy is usable)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return True
        try:
            for work in pending.works:
                if timeout_s is None:
                    work.wait()
                else:
                    work.wait(timedelta(seconds=timeout_s))
        except RuntimeError:  # a peer of the exchange is gone: that held copy is incomplete
            if pending.held is not None:
                pending.held.complete = False
            return False
        if pending.held is not None:
            pending.held.complete = True
        return True

    # -- recovery --------------------------------------------------------------------------------------
    def capture_live(self, params: list[LiveParam] | None, *, trusted: bool) -> None:
        """On leaving a generation: keep the live state (views) if this rank's state is trustworthy."""
        self.settle()
        if not trusted or params is None:
            self.live_step, self.live_loop = None, None
            self.drop_live()
        else:
            self.live_params, self.live_tensors = params, flat_tensors(params)

    def drop_live(self) -> None:
        """Forget the live capture (its tensors are about to be overwritten, or are not wanted)."""
        self.live_params, self.live_tensors = None, None

    def report(self) -> RankReport:
        has_live = self.live_tensors is not None and self.live_step is not None
        own = frozenset(s.step for s in self.own if s.complete)
        held = frozenset(s.step for s in self.held if s.complete)
        return RankReport(
            rank=self.rank,
            live_step=self.live_step if has_live else None,
            own_steps=own,
            held={self.ward: held} if self.source == "buddy" else {},
        )

    def own_copy(self, step: int) -> Snapshot:
        return next(s for s in self.own if s.complete and s.step == step)

    def held_copy(self, step: int) -> Snapshot:
        return next(s for s in self.held if s.complete and s.step == step)

    def resumed_at(self, step: int | None) -> None:
        """Training resumes at ``step`` (None: from disk): drop the live capture and newer copies."""
        self.drop_live()
        for slot in [*self.own, *self.held]:
            if step is None or slot.step > step:
                slot.complete = False

    def host_bytes(self) -> int:
        """Host memory held for copies (both own and held slots)."""
        return sum(s.buffer.flat.numel() for s in [*self.own, *self.held])

    # -- internals -------------------------------------------------------------------------------------
    def _ward_shapes(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Meta tensors shaped like the ward's shard, learned once per generation (collective).

        FSDP2 shards dim 0 unevenly when the world size does not divide it (a rank's shard can
        even be empty), so the ward's copy is not shaped like this rank's own.
        """
        if self._ward_like is None:
            mine = [(tuple(t.shape), t.dtype) for t in tensors]
            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self.group)
            self._ward_like = [
                torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in everyone[self.ward]
            ]
        return self._ward_like

    def _slot(self, slots: list[Snapshot], like: Sequence[torch.Tensor], step: int) -> Snapshot:
        """The slot to overwrite: a fresh one while fewer than two, else the older/incomplete one."""
        if len(slots) < 2:
            slots.append(Snapshot(FlatBuffer(like, self.loop_capacity)))
            return slots[-1]
        slot = min(slots, key=lambda s: (s.complete, s.step))
        if not slot.buffer.matches(like):
            slot.buffer = FlatBuffer(like, self.loop_capacity)
        slot.complete = False
        return slot

    def _write_loop(self, slot: Snapshot, loop: bytes) -> None:
        if len(loop) + _HEADER > slot.loop.numel():
            raise ValueError(
                f"the loop state is {len(loop)} bytes, more than replication.loop_capacity_mb allows "
                f"({slot.loop.numel() - _HEADER} bytes); raise replication.loop_capacity_mb"
            )
        slot.loop[:_HEADER].view(torch.int64)[0] = len(loop)
        slot.loop[_HEADER : _HEADER + len(loop)].copy_(torch.frombuffer(bytearray(loop), dtype=torch.uint8))
