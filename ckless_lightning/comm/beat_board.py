"""A node's heartbeat board: ranks beat into shared memory, their agent reads it and tells the store.

A rank beats twice a step and on every recovery phase. Written to the job store, that was two
requests per rank per step at the one store of the whole job (issue #31); the board makes a beat a
write to memory its node agent reads. The agent publishes its node's beats to the store itself, in
one ``multi_set`` per supervision pass for all of them, with its own beat
(:meth:`~ckless_lightning.comm.JobStore.agent_pass_write`), for the readers on other nodes (a join
barrier, a standby replica). A rank's position (``recovery/where.py``: ``running``, ``peers``...,
each second it changes) goes on the board too; its one reader is the node's agent (the hang blame),
so it never reaches the store.

Layout: one anonymous memory file (``memfd``) the agent creates; no name in ``/dev/shm``, so a killed
agent leaves nothing behind. Ranks open it as ``/proc/<agent pid>/fd/<fd>`` (the agent's open file,
``CKLESS_BEAT_BOARD``), slot = local rank. A slot holds four records, one per writer:

- the rank's beats (its heartbeat callback and recovery session, in its main thread);
- the agent's beats (the beat it writes when it starts a rank, and the fresh hang clock it gives
  every live rank when a recovery begins);
- the rank's position (its ``WhereReporter`` thread; :meth:`BeatBoard.read_where`);
- what the rank asks its agent (to leave a generation, to join one: :mod:`ckless_lightning.comm.
  node_relay`).

After the slots, the node's area: the agent's node record (what its relay knows of the job:
:mod:`~ckless_lightning.comm.node_relay`) and the doorbells' descriptors, written once before any rank
starts. A doorbell is a pipe the agent owns (anonymous too): one the ranks ring to wake the agent, one
per slot the agent rings to wake that slot's rank. A ring is one byte, written without blocking (a
full pipe already rings); a waiter polls its pipe, then empties it, then reads the board, which holds
the news: a ring is only a wake-up, never the message. Ranks open a doorbell as they open the board,
``/proc/<agent pid>/fd/<fd>``.

A heartbeat read returns the later of the two beat records by time (one clock: both writers are on
this node), which is what the store's last-writer-wins key gave.

Each record is a sequence lock: the writer makes the counter odd, writes, makes it even; a reader
retries while the counter is odd or moved. One writer per record, so no lock between processes.
Python gives no memory fences, and a weakly ordered CPU (Arm: Grace) may show another core's stores
out of order, so the record also carries the CRC-32 of its payload: a reader takes only a payload
whose checksum matches (else it reads again), never a torn one.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import time
import zlib
from typing import Protocol

from ckless_lightning.comm.store import Heartbeat

__all__ = ["BeatBoard", "BoardBeats", "HeartbeatWriter", "WhereWriter"]

_RECORD = 128  # bytes: sequence (u64), length (u32), CRC-32 of the payload (u32), the payload
_HEADER = struct.Struct("<QII")
_PAYLOAD = _RECORD - _HEADER.size
# A slot's records, by offset in the slot: the rank's beats, the agent's beats, the rank's position,
# the rank's request to its agent.
_RANK_BEAT, _AGENT_BEAT, _WHERE, _REQUEST = 0, _RECORD, 2 * _RECORD, 3 * _RECORD
_SLOT = 4 * _RECORD
# The node's area, after the slots: the agent's node record, then the doorbells' descriptors (u32s:
# the agent's, then one per slot), written once before any rank opens the board.
_MAX_SLOTS = 254
_BELLS = struct.Struct("<I")
_NODE_AREA = _RECORD + _BELLS.size * (_MAX_SLOTS + 2)
_READ_TRIES = 100  # a torn read is retried; a writer holds a record for microseconds
_ORPHAN_NAP_S = 0.1  # a doorbell with no writer left (its agent died): a wait's pause instead


class HeartbeatWriter(Protocol):
    """Where a rank's heartbeats go: a :class:`~ckless_lightning.comm.JobStore` or :class:`BoardBeats`."""

    def set_rank_heartbeat(self, rank: int, beat: Heartbeat) -> None: ...


class WhereWriter(Protocol):
    """Where a rank's position goes (``recovery/where.py``): its slot of the node's board
    (:class:`BoardBeats`), or with ``agent.local_beats=false`` the
    :class:`~ckless_lightning.comm.JobStore`."""

    def set_rank_where(self, rank: int, where: str) -> None: ...


class BeatBoard:
    """Heartbeat slots shared by a node agent and its ranks (see the module docstring).

    :meth:`create` (the agent) or :meth:`open` (a rank); :meth:`close` when done. Not thread-safe for
    two writers of one record: a rank's main thread writes only its own slot's beat record, its
    ``WhereReporter`` thread only that slot's position record, the agent only agent records.
    """

    def __init__(self, fd: int, slots: int, *, owned: bool, proc_dir: str | None = None) -> None:
        self._fd = fd
        self.slots = slots
        self._owned = owned  # the agent's memfd: its path names this process's descriptor
        self._map = mmap.mmap(fd, slots * _SLOT + _NODE_AREA)
        self._node = slots * _SLOT  # the node record's offset
        # Doorbells: the agent holds both ends of each pipe; a rank opens the ends it uses, by path
        # under the agent's /proc/<pid>/fd (``proc_dir``), on first use.
        self._proc_dir = proc_dir
        self._pipes: dict[int, tuple[int, int]] = {}  # bell (-1: the agent's, else a slot) -> (read, write)
        self._opened: dict[tuple[int, int], int] = {}  # (bell, os.O_RDONLY or os.O_WRONLY) -> descriptor

    @classmethod
    def create(cls, slots: int) -> BeatBoard:
        """A new, zeroed board of ``slots`` slots (one per local rank) and its doorbells, in this process."""
        assert 0 < slots <= _MAX_SLOTS, slots
        fd = os.memfd_create("ckless-beats", os.MFD_CLOEXEC)
        os.ftruncate(fd, slots * _SLOT + _NODE_AREA)
        board = cls(fd, slots, owned=True)
        for i, bell in enumerate((-1, *range(slots))):
            ends = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            board._pipes[bell] = ends
            _BELLS.pack_into(board._map, board._node + _RECORD + i * _BELLS.size, ends[0])
        return board

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
            if size <= _NODE_AREA or (size - _NODE_AREA) % _SLOT:
                raise OSError(f"{path} is not a heartbeat board ({size} bytes)")
            return cls(fd, (size - _NODE_AREA) // _SLOT, owned=False, proc_dir=os.path.dirname(path))
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
        self._write_record(slot, _AGENT_BEAT if by_agent else _RANK_BEAT, beat.encode().encode())

    def read(self, slot: int) -> Heartbeat | None:
        """The later of ``slot``'s two beat records (None: neither was ever written, or reads whole)."""
        raws = (self._read_record(slot, _RANK_BEAT), self._read_record(slot, _AGENT_BEAT))
        beats = [Heartbeat.parse(raw) for raw in raws if raw is not None]
        return max(beats, key=lambda b: b.time) if beats else None

    def write_where(self, slot: int, where: str) -> None:
        """Write ``slot``'s rank's position (a word of ``recovery/where.py``: ``running``, ``peers``...);
        only that rank's ``WhereReporter`` thread writes it."""
        self._write_record(slot, _WHERE, where.encode())

    def read_where(self, slot: int) -> str | None:
        """``slot``'s rank's last position; None: never written, or its writer died mid-write."""
        raw = self._read_record(slot, _WHERE)
        return None if raw is None else raw.decode()

    def write_request(self, slot: int, op: str, gen: int) -> None:
        """``slot``'s rank asks its agent to ``op`` (``join`` or ``leave``) generation ``gen`` (its main
        thread; the agent writes ``start`` -1 into the slot of a rank it starts, before it runs)."""
        self._write_record(slot, _REQUEST, f"{op} {gen}".encode())

    def read_request(self, slot: int) -> tuple[str, int]:
        """What ``slot``'s rank asked last: (op, generation); ``("", -1)``: nothing (or its writer died
        mid-write)."""
        raw = self._read_record(slot, _REQUEST)
        if raw is None:
            return "", -1
        op, gen = raw.decode().split()
        return op, int(gen)

    def write_node(self, payload: str) -> None:
        """The agent's node record (one writer: the agent, under a lock of its own)."""
        assert self._owned, "only the agent writes the node record"
        self._write_at(self._node, payload.encode())

    def read_node(self) -> str | None:
        """The agent's node record; None: never written."""
        raw = self._read_at(self._node)
        return None if raw is None else raw.decode()

    # -- doorbells --------------------------------------------------------------------------------
    def ring_agent(self) -> None:
        """Wake the node agent (a rank, after it wrote what the agent is to read)."""
        _ring(self._bell(-1, os.O_WRONLY))

    def ring(self, slot: int) -> None:
        """Wake ``slot``'s rank (the agent, after it wrote the node record; a rank, to end its own wait)."""
        _ring(self._bell(slot, os.O_WRONLY))

    def wait_for_ranks(self, timeout_s: float) -> bool:
        """The agent: block until a rank rings, at most ``timeout_s``; True if one did."""
        return _wait(self._bell(-1, os.O_RDONLY), timeout_s)

    def wait_slot(self, slot: int, timeout_s: float) -> bool:
        """``slot``'s rank: block until its doorbell rings, at most ``timeout_s``; True if it did."""
        return _wait(self._bell(slot, os.O_RDONLY), timeout_s)

    def _bell(self, bell: int, mode: int) -> int:
        """The descriptor of doorbell ``bell``'s end for ``mode`` (read or write)."""
        if self._owned:
            read, write = self._pipes[bell]
            return read if mode == os.O_RDONLY else write
        fd = self._opened.get((bell, mode))
        if fd is None:
            assert self._proc_dir is not None and -1 <= bell < self.slots, bell
            (number,) = _BELLS.unpack_from(self._map, self._node + _RECORD + (bell + 1) * _BELLS.size)
            fd = os.open(f"{self._proc_dir}/{number}", mode | os.O_NONBLOCK | os.O_CLOEXEC)
            self._opened[(bell, mode)] = fd
        return fd

    def _write_record(self, slot: int, record: int, payload: bytes) -> None:
        """Write ``payload`` into ``slot``'s record at ``record`` under its sequence lock."""
        assert 0 <= slot < self.slots, slot
        self._write_at(slot * _SLOT + record, payload)

    def _write_at(self, offset: int, payload: bytes) -> None:
        assert len(payload) <= _PAYLOAD, payload
        (seq,) = struct.unpack_from("<Q", self._map, offset)
        seq += seq & 1  # a writer killed mid-write left it odd: go on from the next even value
        struct.pack_into("<Q", self._map, offset, seq + 1)
        self._map[offset + _HEADER.size : offset + _HEADER.size + len(payload)] = payload
        struct.pack_into("<II", self._map, offset + 8, len(payload), zlib.crc32(payload))
        struct.pack_into("<Q", self._map, offset, seq + 2)

    def _read_record(self, slot: int, record: int) -> bytes | None:
        """The payload of ``slot``'s record at ``record``, whole and as one write left it; None: never
        written, or no consistent read in :data:`_READ_TRIES` tries."""
        assert 0 <= slot < self.slots, slot
        return self._read_at(slot * _SLOT + record)

    def _read_at(self, offset: int) -> bytes | None:
        for _ in range(_READ_TRIES):
            before, length, crc = _HEADER.unpack_from(self._map, offset)
            if before == 0:
                return None
            raw = self._map[offset + _HEADER.size : offset + _HEADER.size + min(length, _PAYLOAD)]
            (after,) = struct.unpack_from("<Q", self._map, offset)
            if before == after and not before & 1 and zlib.crc32(raw) == crc:
                return raw
        # Odd (or torn) for 100 reads: its writer died or was stopped in the middle of a write (a
        # SIGKILL between two stores); its last payload is lost, which is what a dead rank's silence means.
        return None

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
        for fd in (*self._opened.values(), *(end for ends in self._pipes.values() for end in ends)):
            os.close(fd)
        self._opened.clear()
        self._pipes.clear()


def _ring(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:  # the pipe is full: it rings already
        return


def _wait(fd: int, timeout_s: float) -> bool:
    """Poll ``fd`` (a doorbell's read end) for ``timeout_s``; empty it if it rang. ``poll``, not
    ``select``: a simulated job holds thousands of descriptors."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(max(0, int(timeout_s * 1000))):
        return False
    try:
        while os.read(fd, 4096):
            continue
    except BlockingIOError:  # emptied: the next ring wakes the next wait
        return True
    # End of file: no writer is left, the agent is gone (its ranks die with it). Nothing will ring;
    # a waiter that loops on its deadline must not spin meanwhile.
    time.sleep(min(timeout_s, _ORPHAN_NAP_S))
    return False


class BoardBeats:
    """A rank's writer on its node's board: the ``set_rank_heartbeat`` and ``set_rank_where`` a
    :class:`~ckless_lightning.comm.JobStore` has, for :class:`~ckless_lightning.training.callbacks.
    heartbeat.HeartbeatCallback`, the recovery session and the rank's ``WhereReporter`` (``rank``
    must be this rank; beats from one thread, positions from another)."""

    def __init__(self, board: BeatBoard, *, rank: int, slot: int) -> None:
        self.board = board
        self.rank = rank
        self.slot = slot

    def set_rank_heartbeat(self, rank: int, beat: Heartbeat) -> None:
        assert rank == self.rank, (rank, self.rank)
        self.board.write(self.slot, beat)

    def set_rank_where(self, rank: int, where: str) -> None:
        assert rank == self.rank, (rank, self.rank)
        self.board.write_where(self.slot, where)
