"""Tier 2: a per-node batch cache in shared memory that outlives the rank processes.

One reader process per node (:mod:`ckless_lightning.data.cache_reader`) writes the node's
upcoming batches ahead of training; each rank memory-maps its micro-batch for ``(step,
local rank)``. A rank restarted at any step never touches the dataset, and the node holds
one copy of its batches instead of one per rank.

Entry format: one file per step, ``root/step<step:010d>.batch``, holding every local
rank's micro-batch. All integers little-endian. A 64-byte header::

    0  8s   magic b"CKLBATCH"
    8  u32  format version (ENTRY_VERSION)
    12 u32  n_ranks (local dp ranks in the file)
    16 i64  step
    24 u32  micro_batch_size
    28 u32  row_len (seq_len + 1)
    32 u64  payload bytes
    40 8s   source tag: blake2b-64 of ``BatchCacheLayout.source_tag``
    48 16s  digest: blake2b-128 over header bytes [0, 48) and the whole payload

then the payload: ``input_ids`` int32 ``[n_ranks, micro_batch_size, row_len]``, zero
padding to a multiple of 8 bytes, ``sample_ids`` int64 ``[n_ranks, micro_batch_size]``.
blake2b, not crc32: it catches any corruption, not only burst errors, at ~0.7 ms per 512 KiB
entry (crc32 ~0.1 ms), which is noise next to a training step.

An entry is written to ``root/.tmp-<pid>-<step>`` and renamed into place, so it is visible
only when complete: a killed writer leaves a temp file, which readers never open and the
writer's next start deletes (``clean_temp``). No fsync: the cache is in RAM and dies with
the node; the rename is what makes it safe against a killed process. Consumers tell the
reader where they are with ``want.<local_index>`` files (:meth:`BatchCacheReader.request`).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import shutil
import stat
import struct
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "ENTRY_VERSION",
    "HEADER_SIZE",
    "BatchCacheLayout",
    "BatchCacheReader",
    "BatchCacheWriter",
    "CorruptEntryError",
    "create_cache_dir",
    "remove_cache_dir",
    "source_tag",
    "unbuilt_wanted_steps",
]

ENTRY_VERSION = 1
MAGIC = b"CKLBATCH"
_FIELDS = struct.Struct("<8sIIqIIQ8s")  # header bytes [0, 48): everything but the digest
HEADER_SIZE = 64
_DIGEST_SIZE = 16
_INT32 = np.dtype("<i4")
_INT64 = np.dtype("<i8")
_ENTRY_RE = re.compile(r"^step(\d{10})\.batch$")
_WAIT_POLL_S = 0.005
_WAIT_NOTICE_S = 1.0


def source_tag(
    prepared_path: str | Path, seed: int, dp_size: int, micro_batch_size: int, accumulate: int = 1
) -> str:
    """The ``source_tag`` that writer and readers of one job must share.

    Built from the prepared dataset's directory name (its content key), the seed, the dp
    layout and the accumulation (it orders the samples within an optimizer step), so entries
    left by a run with other data or another world size fail verification instead of being served.
    """
    return f"{Path(prepared_path).name}/seed={seed}/dp_size={dp_size}/mbs={micro_batch_size}/acc={accumulate}"


@dataclass(frozen=True)
class BatchCacheLayout:
    """Where one node's entries live and what shape they have; writer and readers must agree.

    ``dp_ranks`` are the data-parallel ranks on this node in local-rank order: entry slot
    ``i`` holds ``dp_ranks[i]``'s micro-batch. ``source_tag`` (see :func:`source_tag`) is
    hashed into every header; an entry with another tag is rejected.
    """

    root: Path
    dp_ranks: tuple[int, ...]
    micro_batch_size: int
    row_len: int
    source_tag: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        object.__setattr__(self, "dp_ranks", tuple(int(r) for r in self.dp_ranks))
        if not self.dp_ranks or len(set(self.dp_ranks)) != len(self.dp_ranks) or min(self.dp_ranks) < 0:
            raise ValueError(f"dp_ranks={self.dp_ranks} must be distinct non-negative ranks, at least one.")
        for key in ("micro_batch_size", "row_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"batch cache {key}={value!r} must be a positive integer.")

    @property
    def n_ranks(self) -> int:
        return len(self.dp_ranks)

    @property
    def input_nbytes(self) -> int:
        """Bytes of the ``input_ids`` block, padded to a multiple of 8."""
        raw = self.n_ranks * self.micro_batch_size * self.row_len * _INT32.itemsize
        return (raw + 7) // 8 * 8

    @property
    def payload_nbytes(self) -> int:
        return self.input_nbytes + self.n_ranks * self.micro_batch_size * _INT64.itemsize

    @property
    def entry_nbytes(self) -> int:
        return HEADER_SIZE + self.payload_nbytes

    def entry_path(self, step: int) -> Path:
        return _entry_path(self.root, _check_step(step))

    def want_path(self, local_index: int) -> Path:
        return _want_path(self.root, self._check_local(local_index))

    def _check_local(self, local_index: int) -> int:
        if isinstance(local_index, bool) or not isinstance(local_index, int):
            raise TypeError(f"local_index must be an int, got {local_index!r}")
        if not 0 <= local_index < self.n_ranks:
            raise IndexError(f"local_index={local_index} outside [0, {self.n_ranks}) for {self.root}")
        return local_index

    def _tag_digest(self) -> bytes:
        return hashlib.blake2b(self.source_tag.encode(), digest_size=8).digest()


class CorruptEntryError(Exception):
    """An entry file exists but fails verification; no data from it is ever returned.

    Delete the file and request the step again: the node's reader rebuilds it.
    """

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"batch cache entry {path} is corrupt: {reason}; "
            "delete it and the node's cache reader rebuilds it"
        )
        self.path = path
        self.reason = reason


def _entry_path(root: Path, step: int) -> Path:
    return root / f"step{step:010d}.batch"


def _want_path(root: Path, local_index: int) -> Path:
    return root / f"want.{local_index}"


def unbuilt_wanted_steps(root: Path, n_ranks: int, max_steps: int | None) -> list[int]:
    """Steps a local consumer is waiting for (its ``want`` file) that have no entry: what the reader owes.

    For the agent's progress check of the reader (it reads file names only, never an entry).
    A want file being replaced at this moment is skipped (read next time).
    """
    owed = set()
    for i in range(n_ranks):
        try:
            step = int(_want_path(Path(root), i).read_text())
        except (FileNotFoundError, ValueError):
            continue
        if (max_steps is None or step < max_steps) and not _entry_path(Path(root), step).exists():
            owed.add(step)
    return sorted(owed)


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"batch cache step {step!r} must be a non-negative integer.")
    return step


def _validate_job_id(job_id: str) -> None:
    seps = {os.sep, os.altsep or os.sep, "\0"}
    if not job_id or job_id in (".", "..") or any(s in job_id for s in seps):
        raise ValueError(
            f"job id {job_id!r} cannot name a cache directory (empty, '.', '..' or contains a path "
            "separator); pass the scheduler's job id, e.g. the Slurm job id."
        )


def _private_dir(path: Path) -> None:
    """Create ``path`` with mode 0o700, or accept it only if it is our own private directory."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        st = path.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(
                f"{path} exists but is not a private directory of this user (must be a real directory, "
                "owned by us, mode 0o700); remove it or choose another base directory."
            ) from None
        return
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask


def create_cache_dir(base: Path, job_id: str, node: int) -> Path:
    """Make ``base/ckless-<job_id>/node<node>`` (owner-only, 0o700) and return it.

    ``base`` must exist (``/dev/shm`` on a node). Distinct job ids give disjoint directories,
    so two jobs on one node never see each other's entries.
    """
    _validate_job_id(job_id)
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        raise ValueError(f"node={node!r} must be a non-negative integer.")
    base = Path(base)
    if not base.is_dir():
        raise FileNotFoundError(
            f"batch cache base directory {base} does not exist; create it or pick another"
        )
    job_dir = base / f"ckless-{job_id}"
    _private_dir(job_dir)
    node_dir = job_dir / f"node{node}"
    _private_dir(node_dir)
    return node_dir


def remove_cache_dir(base: Path, job_id: str) -> bool:
    """Remove ``base/ckless-<job_id>`` and everything in it; ``False`` if it was already gone."""
    _validate_job_id(job_id)
    job_dir = Path(base) / f"ckless-{job_id}"
    if job_dir.is_symlink():
        raise ValueError(f"{job_dir} is a symlink, not a cache directory of ours: left alone")
    if not job_dir.exists():
        return False
    shutil.rmtree(job_dir)  # never follows symlinks inside it (Python 3.11's rmtree)
    return True


def _load_entry(layout: BatchCacheLayout, step: int, local_index: int | None) -> tuple[np.ndarray, ...]:
    """Verify ``step``'s entry; return int64 copies of ``local_index``'s ``input_ids``, ``sample_ids``.

    ``local_index=None`` only verifies. Raises ``FileNotFoundError`` when the entry is absent
    and :class:`CorruptEntryError` when it is invalid. The file is memory-mapped: the int64
    conversion of the one micro-batch is the only copy.
    """
    path = layout.entry_path(step)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_SIZE:
            raise CorruptEntryError(path, f"truncated: {size} bytes, the header alone is {HEADER_SIZE}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            magic, version, n_ranks, e_step, mbs, row_len, payload, tag = _FIELDS.unpack_from(mm, 0)
            if magic != MAGIC:
                raise CorruptEntryError(path, f"bad magic {magic!r}")
            if version != ENTRY_VERSION:
                raise CorruptEntryError(path, f"format version {version}, this code reads {ENTRY_VERSION}")
            n, m, r = layout.n_ranks, layout.micro_batch_size, layout.row_len
            if (e_step, n_ranks, mbs, row_len, payload) != (step, n, m, r, layout.payload_nbytes):
                raise CorruptEntryError(
                    path,
                    f"header says step {e_step}, {n_ranks} ranks x {mbs} x {row_len}, {payload} payload "
                    f"bytes; expected step {step}, {n} x {m} x {r}, {layout.payload_nbytes} bytes",
                )
            if tag != layout._tag_digest():
                raise CorruptEntryError(path, f"written for another data source (not {layout.source_tag!r})")
            if size != HEADER_SIZE + payload:
                raise CorruptEntryError(path, f"{size} bytes, expected {HEADER_SIZE + payload}")
            with memoryview(mm) as view:
                digest = hashlib.blake2b(view[: _FIELDS.size], digest_size=_DIGEST_SIZE)
                digest.update(view[HEADER_SIZE:])
                if digest.digest() != view[_FIELDS.size : HEADER_SIZE]:
                    raise CorruptEntryError(path, "payload checksum mismatch")
            if local_index is None:
                return ()
            row = HEADER_SIZE + local_index * m * r * _INT32.itemsize
            ids = np.frombuffer(mm, dtype=_INT32, count=m * r, offset=row).astype(np.int64).reshape(m, r)
            offset = HEADER_SIZE + layout.input_nbytes + local_index * m * _INT64.itemsize
            sids = np.frombuffer(mm, dtype=_INT64, count=m, offset=offset).copy()  # copies: mapping can close
            return ids, sids


class BatchCacheWriter:
    """Builds and atomically commits entries; used by the node's reader process.

    ``source(step, dp_rank)`` returns ``{"input_ids": LongTensor[mbs, row_len], "sample_ids":
    LongTensor[mbs]}`` (``StepBatchLoader.batch``-like) and must be a pure function of its
    arguments. Only one writer per ``root`` may run at a time.
    """

    def __init__(self, layout: BatchCacheLayout, source: Callable[[int, int], dict[str, Any]]) -> None:
        if not layout.root.is_dir():
            raise FileNotFoundError(
                f"batch cache directory {layout.root} does not exist; create it with create_cache_dir."
            )
        self.layout = layout
        self.source = source

    def verify(self, step: int) -> bool:
        """Whether a complete, valid entry for ``step`` exists."""
        try:
            _load_entry(self.layout, step, None)
        except (FileNotFoundError, CorruptEntryError):
            return False
        return True

    def write(self, step: int) -> bool:
        """Build and commit ``step``'s entry; ``False`` (no-op) if a valid one exists.

        An existing entry that fails verification is rebuilt and replaced atomically.
        """
        if self.verify(step):
            return False
        data = self._encode(step)
        final = self.layout.entry_path(step)
        tmp = self.layout.root / f".tmp-{os.getpid()}-{step}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.rename(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return True

    def _encode(self, step: int) -> bytes:
        lay = self.layout
        n, m, r = lay.n_ranks, lay.micro_batch_size, lay.row_len
        ids = np.zeros((n, m, r), dtype=_INT32)
        sids = np.zeros((n, m), dtype=_INT64)
        for i, dp_rank in enumerate(lay.dp_ranks):
            batch = self.source(step, dp_rank)
            x = torch.as_tensor(batch["input_ids"])
            s = torch.as_tensor(batch["sample_ids"])
            if tuple(x.shape) != (m, r) or tuple(s.shape) != (m,):
                raise ValueError(
                    f"batch source gave input_ids {tuple(x.shape)} and sample_ids {tuple(s.shape)} for step "
                    f"{step}, dp rank {dp_rank}; the cache layout {lay.root} expects ({m}, {r}) and ({m},). "
                    "Build the layout with the loader's micro_batch_size and seq_len + 1."
                )
            if x.numel() and (int(x.min()) < 0 or int(x.max()) > np.iinfo(np.int32).max):
                raise ValueError(
                    f"token ids of step {step}, dp rank {dp_rank} leave the int32 range the cache stores."
                )
            ids[i] = x.numpy()
            sids[i] = s.numpy()
        payload = ids.tobytes() + bytes(lay.input_nbytes - ids.nbytes) + sids.tobytes()
        fields = _FIELDS.pack(MAGIC, ENTRY_VERSION, n, step, m, r, len(payload), lay._tag_digest())
        digest = hashlib.blake2b(fields, digest_size=_DIGEST_SIZE)
        digest.update(payload)
        header = fields + digest.digest()
        return header + bytes(HEADER_SIZE - len(header)) + payload

    def entry_steps(self) -> list[int]:
        """Steps that have an entry file (valid or not), ascending."""
        return sorted(int(m.group(1)) for m in map(_ENTRY_RE.match, os.listdir(self.layout.root)) if m)

    def evict_before(self, step: int) -> int:
        """Delete entries of steps below ``step``; returns how many were removed."""
        return self.evict_except(range(step, 2**63))

    def evict_except(self, keep: Collection[int]) -> int:
        """Delete every entry whose step is not in ``keep``; returns how many were removed."""
        drop = [s for s in self.entry_steps() if s not in keep]
        for s in drop:
            self.layout.entry_path(s).unlink(missing_ok=True)
        return len(drop)

    def clean_temp(self) -> int:
        """Remove temp files left by a killed writer; call before writing, with no other writer running."""
        temps = [name for name in os.listdir(self.layout.root) if name.startswith(".tmp-")]
        for name in temps:
            (self.layout.root / name).unlink(missing_ok=True)
        return len(temps)


class BatchCacheReader:
    """A rank's view of its node's cache: reads ``(step, local_index)`` and reports its position.

    Never imports the dataset. ``read`` verifies the entry and converts this rank's slice of
    the memory-mapped int32 ids to int64 (the only copy).
    """

    def __init__(self, layout: BatchCacheLayout) -> None:
        self.layout = layout

    def read(self, step: int, local_index: int) -> dict[str, Any]:
        """``{"input_ids", "sample_ids", "step"}`` like ``StepBatchLoader.batch``.

        Raises ``FileNotFoundError`` if the entry is not there (yet) and
        :class:`CorruptEntryError` if it fails verification.
        """
        local_index = self.layout._check_local(local_index)
        ids, sids = _load_entry(self.layout, step, local_index)
        return {"input_ids": torch.from_numpy(ids), "sample_ids": torch.from_numpy(sids), "step": step}

    def wait_read(
        self,
        step: int,
        local_index: int,
        *,
        timeout_s: float,
        on_wait: Callable[[float], None] | None = None,
    ) -> dict[str, Any]:
        """``read`` once the entry appears, polling every ~5 ms.

        Call :meth:`request` first, or the reader may never build a step outside its window.
        ``on_wait(elapsed_s)`` is called once after 1 s of waiting (to log "waiting for step N
        in the batch cache"). Raises ``TimeoutError`` naming the path after ``timeout_s``;
        :class:`CorruptEntryError` propagates at once.
        """
        started = time.monotonic()
        notified = False
        while True:
            try:
                return self.read(step, local_index)
            except FileNotFoundError:
                elapsed = time.monotonic() - started
            if elapsed >= timeout_s:
                raise TimeoutError(
                    f"batch cache entry {self.layout.entry_path(step)} did not appear in {timeout_s:.1f}s; "
                    "is the node's cache reader (python -m ckless_lightning.data.cache_reader) running?"
                )
            if on_wait is not None and not notified and elapsed >= _WAIT_NOTICE_S:
                notified = True
                on_wait(elapsed)
            time.sleep(_WAIT_POLL_S)

    def request(self, step: int, local_index: int) -> None:
        """Tell the node's reader this consumer needs ``step`` next (atomic ``want.<i>`` file).

        The reader keeps every consumer's ``[step, step + prefetch)`` built and evicts only
        below the slowest consumer's ``step - lookback``.
        """
        _check_step(step)
        path = self.layout.want_path(local_index)
        tmp = path.with_name(f".{path.name}.tmp")  # one live consumer per local index
        tmp.write_text(f"{step}\n")
        os.rename(tmp, path)
