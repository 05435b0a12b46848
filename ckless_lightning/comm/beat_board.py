"""A node's heartbeat board: ranks beat into shared memory, their agent reads it and tells the store.

A rank beats twice a step and on every recovery phase. Written to the job store, that was two
requests per rank per step at the one store of the whole job (issue #31); the board makes a beat a
write to memory its node agent reads. The agent publishes its node's beats to the store itself, in
one ``multi_set`` per supervision pass for all of them, with its own beat
(:meth:`~ckless_lightning.comm.JobStore.agent_pass_write`), for the readers on other nodes (a join
barrier, a standby replica).

Layout: one anonymous memory file (``memfd``) the agent creates; no name in ``/dev/shm``, so a killed
agent leaves nothing behind. Ranks open it as ``/proc/<agent pid>/fd/<fd>`` (the agent's open file,
``CKLESS_BEAT_BOARD``), slot = local rank. A slot holds two records, one per writer: the rank's
beats and the agent's (the beat it writes when it starts a rank, and the fresh hang clock it gives
every live rank when a recovery begins). A read returns the later of the two by time (one clock:
both writers are on this node), which is what the store's last-writer-wins key gave.

Each record is a sequence lock: the writer makes the counter odd, writes, makes it even; a reader
retries while the counter is odd or moved. One writer per record, so no lock between processes.
Python gives no memory fences, and a weakly ordered CPU (Arm: Grace) may show another core's stores
out of order, so the record also carries the CRC-32 of its beat: a reader takes only a beat whose
checksum matches (else it reads again), never a torn one.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from typing import Protocol

from ckless_lightning.comm.store import Heartbeat

__all__ = ["BeatBoard", "BoardBeats", "HeartbeatWriter"]

_RECORD = 128  # bytes: sequence (u64), length (u32), CRC-32 of the beat (u32), the encoded beat
_HEADER = struct.Struct("<QII")
_PAYLOAD = _RECORD - _HEADER.size
_SLOT = 2 * _RECORD  # the rank's record, then the agent's
_READ_TRIES = 100  # a torn read is retried; a writer holds a record for microseconds


class HeartbeatWriter(Protocol):
    """Where a rank's heartbeats go: a :class:`~ckless_lightning.comm.JobStore` or :class:`BoardBeats`."""

    def set_rank_heartbeat(self, rank: int, beat: Heartbeat) -> None: ...


class BeatBoard:
    """Heartbeat slots shared by a node agent and its ranks (see the module docstring).

    :meth:`create` (the agent) or :meth:`open` (a rank); :meth:`close` when done. Not thread-safe for
    two writers of one record: a rank writes only its own slot's rank record, the agent only agent
    records.
    """

    def __init__(self, fd: int, slots: int, *, owned: bool) -> None:
        self._fd = fd
        self.slots = slots
        self._owned = owned  # the agent's memfd: its path names this process's descriptor
        self._map = mmap.mmap(fd, slots * _SLOT)

    @classmethod
    def create(cls, slots: int) -> BeatBoard:
        """A new, zeroed board of ``slots`` slots (one per local rank), in this process."""
        assert slots > 0, slots
        fd = os.memfd_create("ckless-beats", os.MFD_CLOEXEC)
        os.ftruncate(fd, slots * _SLOT)
        return cls(fd, slots, owned=True)

    @classmethod
    def open(cls, path: str) -> BeatBoard:
        """The board at ``path`` (:attr:`path` of the agent's board).

        Raises ``OSError`` naming the path when this process cannot open it (``/proc`` mounted with
        ``hidepid``, or the rank runs as another user): ``agent.local_beats=false`` beats through the
        store instead.
        """
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size == 0 or size % _SLOT:
                raise OSError(f"{path} is not a heartbeat board ({size} bytes)")
            return cls(fd, size // _SLOT, owned=False)
        except BaseException:
            os.close(fd)
            raise

    @property
    def path(self) -> str:
        """Where another process of this node opens this board (the agent's descriptor in /proc)."""
        assert self._owned, "only the agent's board has a path to hand out"
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    def write(self, slot: int, beat: Heartbeat, *, by_agent: bool = False) -> None:
        """Write ``beat`` into ``slot``: its rank's record, or with ``by_agent`` the agent's."""
        payload = beat.encode().encode()
        assert 0 <= slot < self.slots and len(payload) <= _PAYLOAD, (slot, payload)
        offset = slot * _SLOT + (_RECORD if by_agent else 0)
        (seq,) = struct.unpack_from("<Q", self._map, offset)
        seq += seq & 1  # a writer killed mid-write left it odd: go on from the next even value
        struct.pack_into("<Q", self._map, offset, seq + 1)
        self._map[offset + _HEADER.size : offset + _HEADER.size + len(payload)] = payload
        struct.pack_into("<II", self._map, offset + 8, len(payload), zlib.crc32(payload))
        struct.pack_into("<Q", self._map, offset, seq + 2)

    def read(self, slot: int) -> Heartbeat | None:
        """The later of ``slot``'s two records (None: neither was ever written)."""
        beats = [b for b in (self._read_record(slot * _SLOT), self._read_record(slot * _SLOT + _RECORD)) if b]
        return max(beats, key=lambda b: b.time) if beats else None

    def _read_record(self, offset: int) -> Heartbeat | None:
        for _ in range(_READ_TRIES):
            before, length, crc = _HEADER.unpack_from(self._map, offset)
            if before == 0:
                return None
            raw = self._map[offset + _HEADER.size : offset + _HEADER.size + min(length, _PAYLOAD)]
            (after,) = struct.unpack_from("<Q", self._map, offset)
            if before == after and not before & 1 and zlib.crc32(raw) == crc:
                return Heartbeat.parse(raw)
        # Odd (or torn) for 100 reads: its writer died or was stopped in the middle of a write (a
        # SIGKILL between two stores); its last beat is lost, which is what a dead rank's silence means.
        return None

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)


class BoardBeats:
    """A rank's heartbeat writer on its node's board: the ``set_rank_heartbeat`` a
    :class:`~ckless_lightning.comm.JobStore` has, for :class:`~ckless_lightning.training.callbacks.
    heartbeat.HeartbeatCallback` and the recovery session (``rank`` must be this rank)."""

    def __init__(self, board: BeatBoard, *, rank: int, slot: int) -> None:
        self.board = board
        self.rank = rank
        self.slot = slot

    def set_rank_heartbeat(self, rank: int, beat: Heartbeat) -> None:
        assert rank == self.rank, (rank, self.rank)
        self.board.write(self.slot, beat)
