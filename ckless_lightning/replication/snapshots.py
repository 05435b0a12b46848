"""What a rank keeps in host memory for tier 4, across generations: its live state's step and
loop counters, and (``buddy`` source) snapshot copies of its own shard and of its ward's.

Each recorded step also gets a :class:`~ckless_lightning.replication.fingerprint.StateFingerprint`
of the state it describes, which a restore verifies the state it ends up with against. The rank
keeps its own records (the last :attr:`SnapshotCopies.fingerprint_ring` steps), and each copy
carries its step's record in its last bytes, so the record travels to the buddy with the copy, in
the same message, and outlives the rank where the copy does. No record goes through the job store:
a restore gathers what every rank vouches for with the ranks' reports (:meth:`SnapshotCopies.report`),
one collective it makes anyway.

What a rank offers when it leaves a generation is a :class:`LiveCapture`: views of its live
tensors, labelled with the step and loop state they held then. It belongs to the recovery that
follows: a restore consumes it, and a generation that resumes from anything but memory drops it
(:meth:`SnapshotCopies.resumed_at`).

Buddy placement: rank r's copies live on ``buddy_rank(r)`` = (r + offset) % world;
the rank whose copies r holds is its *ward*, (r - offset) % world. After every
``every_n_steps``-th committed step each rank copies its local state into one
of two own slots (double-buffered, so a fault during a copy never leaves a rank
without a complete one), sends that slot to its buddy and receives its ward's
into one of two held slots. The exchange runs asynchronously on the rank's two pair groups
(:mod:`~ckless_lightning.replication.buddy_links`), overlapped with the end of the step (logging,
checkpointing) and the next batch fetch; it is settled (waited for) before the next step's first
batch (``SnapshotCallback``) and before the rank leaves a generation, so a fault during a step
always finds the last committed step's copies complete.

Nothing here knows Lightning: the loop counters arrive as opaque bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from ckless_lightning.comm.works import wait_works
from ckless_lightning.replication.buddy_links import BuddyLinks
from ckless_lightning.replication.fingerprint import (
    StateFingerprint,
    TensorSums,
    flat_fingerprint,
    loop_fingerprint,
)
from ckless_lightning.replication.source_map import RankReport, buddy_rank
from ckless_lightning.replication.state import LiveParam, flat_tensors

__all__ = ["FlatBuffer", "LiveCapture", "Snapshot", "SnapshotCopies"]

_ALIGN = 8
_HEADER = 8  # the loop buffer starts with its payload length (int64)
# A copy's last bytes: its step's fingerprint record (an int64 length, then the encoded record).
_RECORD_AREA = 256


class FlatBuffer:
    """One contiguous uint8 host buffer with a typed view per tensor (8-byte aligned), then
    ``tail_bytes`` more (the loop state: one buffer, so one send and one receive per exchange)."""

    def __init__(self, like: Sequence[torch.Tensor], tail_bytes: int = 0) -> None:
        offsets, total = [], 0
        for t in like:
            offsets.append(total)
            total += -(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN
        self.offsets = offsets  # where each view starts (bytes, 8-aligned)
        self.tensor_bytes = total  # the views and their zero padding; the tail follows
        # Pinned where a GPU is: device-to-host copies of the shard then run at full bandwidth.
        self.flat = torch.zeros(
            max(total + tail_bytes, _ALIGN), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
        )
        self.views = [
            self.flat[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for off, t in zip(offsets, like, strict=True)
        ]
        self.tail = self.flat[total : total + tail_bytes]
        self._matched: Sequence[torch.Tensor] | None = None  # the list last found to match

    def fingerprint(self) -> str:
        """The fingerprint of the tensors held (as ``tensors_fingerprint(self.views)``), in one pass."""
        return flat_fingerprint(self.flat, self.offsets, self.tensor_bytes)

    def matches(self, like: Sequence[torch.Tensor]) -> bool:
        """Whether the views are shaped like ``like``; the same list as last time (a rank's listing
        of its state, unchanged across steps) is not compared again: that cost ~0.3 ms a step."""
        if like is self._matched:
            return True
        ok = len(like) == len(self.views) and all(
            v.shape == t.shape and v.dtype == t.dtype for v, t in zip(self.views, like, strict=True)
        )
        self._matched = like if ok else None
        return ok

    def forget_match(self) -> None:
        """Drop the reference to the list last matched (it may hold a generation's live tensors)."""
        self._matched = None


@dataclass
class Snapshot:
    """One copy of a rank's state at ``step``; ``complete`` once fully written (or received)."""

    # The tensors, then the loop area (an 8-byte length and the pickled loop state), then the
    # record area (an 8-byte length and the step's encoded fingerprint, as its owner recorded it).
    buffer: FlatBuffer
    step: int = -1
    complete: bool = False

    @property
    def loop(self) -> torch.Tensor:
        return self.buffer.tail[:-_RECORD_AREA]

    @property
    def record_area(self) -> torch.Tensor:
        return self.buffer.tail[-_RECORD_AREA:]

    def loop_bytes(self) -> bytes:
        n = int(self.loop[:_HEADER].view(torch.int64).item())
        return bytes(self.loop[_HEADER : _HEADER + n].numpy())

    def write_record(self, fingerprint: StateFingerprint) -> None:
        """Put ``fingerprint`` (the record of this copy's step) into the copy's record area."""
        raw = fingerprint.encode().encode()
        assert len(raw) + _HEADER <= _RECORD_AREA, raw
        area = self.record_area
        area[:_HEADER].view(torch.int64)[0] = len(raw)
        area[_HEADER : _HEADER + len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def record(self) -> StateFingerprint | None:
        """The record this copy carries if it is one of its step (None: none, or unreadable)."""
        area = self.record_area
        n = int(area[:_HEADER].view(torch.int64).item())
        if not 0 < n <= _RECORD_AREA - _HEADER:
            return None
        try:
            fingerprint = StateFingerprint.parse(bytes(area[_HEADER : _HEADER + n].numpy()))
        except ValueError:  # bytes that are no record (a copy damaged in memory): no record
            return None
        return fingerprint if fingerprint.step == self.step else None


@dataclass(frozen=True)
class LiveCapture:
    """A rank's live state as it left a generation: views of its tensors (``params``, and the same
    flat in :func:`~ckless_lightning.replication.state.local_state_tensors` order), and the step and
    loop state they held then (the state's label: what a restore verifies it against)."""

    params: list[LiveParam]
    tensors: list[torch.Tensor]
    step: int
    loop: bytes


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
    live_step: int | None = None  # step of the training state (last recorded or restored), None: unknown
    live_loop: bytes | None = None  # its loop state
    capture: LiveCapture | None = None  # the live state offered to the recovery in progress
    own: list[Snapshot] = field(default_factory=list)
    held: list[Snapshot] = field(default_factory=list)
    records: dict[int, StateFingerprint] = field(default_factory=dict)  # step -> this rank's record
    timeline: int = 0  # the generation this rank's timeline began in (its last resume from disk)
    links: BuddyLinks | None = None  # the exchange's pair groups (buddy), one set per generation
    wait_timeout_s: float = 600.0  # the longest wait for an exchange (the generation's collective timeout)
    _pending: _Exchange | None = None
    _ward_like: list[torch.Tensor] | None = None  # meta tensors shaped like the ward's shard
    _sums: TensorSums | None = None  # the live state's fingerprint sums (steps without a copy)

    def __post_init__(self) -> None:
        if self.source not in ("hsdp", "buddy"):
            raise ValueError(f"replication.source must be hsdp or buddy, got {self.source!r}")
        self.buddy = buddy_rank(self.rank, world_size=self.world_size, offset=self.buddy_offset)
        self.ward = (self.rank - self.buddy_offset) % self.world_size

    @property
    def fingerprint_ring(self) -> int:
        """How many steps' fingerprints a rank keeps recorded: enough for the oldest copy a restore
        can still use (two slots, ``every_n_steps`` apart, behind the live step)."""
        return 2 * self.every_n_steps + 2

    # -- steady state ----------------------------------------------------------------------------------
    def attach(self, links: BuddyLinks) -> None:
        """A new generation's exchange groups (buddy); the ward's shard shapes are learned again."""
        self.links = links
        self._ward_like = None

    def detach(self) -> None:
        """The rank leaves its generation: drop the exchange groups (their connections close) and any
        exchange still in flight (its held copy stays incomplete)."""
        if self._pending is not None and self._pending.held is not None:
            self._pending.held.complete = False
        self._pending, self.links = None, None

    def copies_at(self, step: int) -> bool:
        """Whether ``step``'s record makes a copy and exchanges it (buddy, every k-th step)."""
        return self.source == "buddy" and step % self.every_n_steps == 0

    def record(
        self, step: int, loop: bytes, tensors: Sequence[torch.Tensor], *, gen: int
    ) -> StateFingerprint:
        """After committed step ``step`` (in generation ``gen``): remember its loop state and its
        fingerprint (:attr:`records`); every k-th step, copy the state into an own slot that carries
        the fingerprint too, for :meth:`exchange` to send. Returns the fingerprint."""
        self.live_step, self.live_loop = step, loop
        if not self.copies_at(step):
            if self._sums is None or not self._sums.matches(tensors):
                self._sums = TensorSums(tensors)
            return self.remember(
                StateFingerprint(step, gen, self._sums.fingerprint(), loop_fingerprint(loop))
            )
        self.settle()
        own = self._slot(self.own, tensors, step)
        with torch.no_grad():  # one fused call: a copy_ per tensor costs more than the bytes here
            torch._foreach_copy_(own.buffer.views, list(tensors), non_blocking=True)
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream().synchronize()  # the host reads the buffer next
        self._write_loop(own, loop)
        # The copy is the state, in one flat buffer: fingerprinted in one pass.
        fingerprint = StateFingerprint(step, gen, own.buffer.fingerprint(), loop_fingerprint(loop))
        own.write_record(fingerprint)
        own.step, own.complete = step, True
        return self.remember(fingerprint)

    def remember(self, fingerprint: StateFingerprint) -> StateFingerprint:
        """``fingerprint`` is this rank's record of its state at ``fingerprint.step`` (each recorded
        step's, and a restored rank's state, verified); the last :attr:`fingerprint_ring` are kept."""
        self.records[fingerprint.step] = fingerprint
        while len(self.records) > self.fingerprint_ring:
            del self.records[min(self.records)]
        return fingerprint

    def exchange(self, step: int) -> None:
        """After :meth:`record` of a copy step: send the own copy of ``step`` to the buddy and receive
        the ward's into a held slot, in the background (:meth:`settle` waits for it)."""
        if not self.copies_at(step):
            return
        own = self.own_copy(step)
        held = self._slot(self.held, self._ward_shapes(own.buffer.views), step)
        held.complete = False
        assert self.links is not None, "exchange before attach"
        held.step = step
        works = [self.links.send(own.buffer.flat), self.links.recv(held.buffer.flat)]
        self._pending = _Exchange(works, held, step)

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait for the exchange in flight, if any, at most ``timeout_s`` (default
        :attr:`wait_timeout_s`); True if it completed (the held copy is usable)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return True
        bound = timedelta(seconds=self.wait_timeout_s if timeout_s is None else timeout_s)
        try:
            wait_works(pending.works, bound)
        except RuntimeError:  # a peer is gone, or the wait ran out: that held copy is incomplete
            if pending.held is not None:
                pending.held.complete = False
            return False
        if pending.held is not None:
            pending.held.complete = True
        return True

    # -- recovery --------------------------------------------------------------------------------------
    def capture_live(self, params: list[LiveParam] | None, *, trusted: bool) -> None:
        """On leaving a generation: offer the live state (views) if this rank's state is trustworthy,
        labelled with the last recorded step and its loop state; else offer none."""
        self.settle()
        self._sums = None  # its views would keep this generation's state alive after the recovery
        for slot in [*self.own, *self.held]:
            slot.buffer.forget_match()
        if not trusted or params is None or self.live_step is None or self.live_loop is None:
            self.live_step, self.live_loop = None, None
            self.capture = None
        else:
            self.capture = LiveCapture(params, flat_tensors(params), self.live_step, self.live_loop)

    def drop_capture(self) -> None:
        """Forget the live capture (its tensors are about to be overwritten, or are not wanted)."""
        self.capture = None

    def report(self) -> RankReport:
        """What this rank holds, and the records it vouches for: its own (by step) and, with each
        complete held copy, the record the ward sent with it, keyed ``(owner's rank, step)``."""
        own = frozenset(s.step for s in self.own if s.complete)
        held = [s for s in self.held if s.complete]
        records = {(self.rank, step): fp for step, fp in self.records.items()}
        for slot in held:
            if (fingerprint := slot.record()) is not None:
                records[(self.ward, slot.step)] = fingerprint
        return RankReport(
            rank=self.rank,
            live_step=self.capture.step if self.capture is not None else None,
            own_steps=own,
            held={self.ward: frozenset(s.step for s in held)} if self.source == "buddy" else {},
            records=records,
            timeline=self.timeline,
        )

    def own_copy(self, step: int) -> Snapshot:
        return next(s for s in self.own if s.complete and s.step == step)

    def held_copy(self, step: int) -> Snapshot:
        return next(s for s in self.held if s.complete and s.step == step)

    def resumed_at(self, step: int | None, loop: bytes | None = None, *, timeline: int | None = None) -> None:
        """Training resumes at ``step`` with ``loop`` (a verified memory restore), or from a disk
        checkpoint or the job's start (``None``, in generation ``timeline``: a new timeline begins):
        the capture is consumed, and copies and records newer than the resume point (all of them,
        from disk: they belong to a timeline the job has left) dropped."""
        assert (step is None) == (timeline is not None), (step, timeline)
        self.drop_capture()
        restored = step is not None and loop is not None
        self.live_step, self.live_loop = (step, loop) if restored else (None, None)
        for slot in [*self.own, *self.held]:
            if step is None or slot.step > step:
                slot.complete = False
        self.records = {s: fp for s, fp in self.records.items() if step is not None and s <= step}
        if timeline is not None:
            self.timeline = timeline

    def host_bytes(self) -> int:
        """Host memory held for copies (both own and held slots)."""
        return sum(s.buffer.flat.numel() for s in [*self.own, *self.held])

    # -- internals -------------------------------------------------------------------------------------
    def _ward_shapes(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Meta tensors shaped like the ward's shard, learned once per generation (from the ward).

        FSDP2 shards dim 0 unevenly when the world size does not divide it (a rank's shard can
        even be empty), so the ward's copy is not shaped like this rank's own.
        """
        if self._ward_like is None:
            assert self.links is not None, "exchange before attach"
            mine = [(tuple(t.shape), t.dtype) for t in tensors]
            theirs = self.links.swap_shapes(mine, timedelta(seconds=self.wait_timeout_s))
            self._ward_like = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in theirs]
        return self._ward_like

    def _slot(self, slots: list[Snapshot], like: Sequence[torch.Tensor], step: int) -> Snapshot:
        """The slot to overwrite: a fresh one while fewer than two, else the older/incomplete one."""
        if len(slots) < 2:
            slots.append(Snapshot(FlatBuffer(like, self.loop_capacity + _RECORD_AREA)))
            return slots[-1]
        slot = min(slots, key=lambda s: (s.complete, s.step))
        if not slot.buffer.matches(like):
            slot.buffer = FlatBuffer(like, self.loop_capacity + _RECORD_AREA)
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
