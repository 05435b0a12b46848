"""In-memory recovery: plan who restores a lost rank from whom, and copy the state over.

Why a subpackage: the planner (:mod:`.source_map`) is pure and the transfer
(:mod:`.transfer`) only needs ``torch.distributed``, so both are testable on
CPU with gloo, apart from the Lightning strategy that drives them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckless_lightning.replication.source_map import (
    RankReport,
    Rejected,
    SourceMap,
    Transfer,
    buddy_rank,
    buddy_sources,
    buddy_survives_node_loss,
    default_buddy_offset,
    hsdp_sources,
)
from ckless_lightning.runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from ckless_lightning.replication.fingerprint import StateFingerprint
    from ckless_lightning.replication.snapshots import FlatBuffer, LiveCapture, Snapshot, SnapshotCopies
    from ckless_lightning.replication.transfer import (
        DEFAULT_BUCKET_BYTES,
        BucketLayout,
        TransferError,
        checksum,
        transfer_bytes,
        transfer_tensors,
    )

# Loaded on first use (they import torch): the config's checks use only the pure planner.
_LAZY = {
    **dict.fromkeys(("FlatBuffer", "LiveCapture", "Snapshot", "SnapshotCopies"), "snapshots"),
    "StateFingerprint": "fingerprint",
    **dict.fromkeys(
        (
            "DEFAULT_BUCKET_BYTES",
            "BucketLayout",
            "TransferError",
            "checksum",
            "transfer_bytes",
            "transfer_tensors",
        ),
        "transfer",
    ),
}
__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BucketLayout",
    "FlatBuffer",
    "LiveCapture",
    "RankReport",
    "Rejected",
    "Snapshot",
    "SnapshotCopies",
    "SourceMap",
    "StateFingerprint",
    "Transfer",
    "TransferError",
    "buddy_rank",
    "buddy_sources",
    "buddy_survives_node_loss",
    "checksum",
    "default_buddy_offset",
    "hsdp_sources",
    "transfer_bytes",
    "transfer_tensors",
]
