"""Disk checkpoints: sharded DCP folders written by Lightning's ModelCheckpoint.

A checkpoint is a folder ``step<NNNNNNNN>.ckpt`` (the name the job's own
``ModelCheckpoint`` writes) or any name Lightning's ``ModelCheckpoint`` gives with its
default template, ``epoch=<E>-step=<N>.ckpt`` (``-v<K>`` appended on a clash; also
``step=<N>`` anywhere in a user's own ``filename``), holding torch.distributed.checkpoint
shards (model + optimizer) and Lightning's ``meta.pt`` (loops, schedulers,
callbacks, data position). A name that says no step (``last.ckpt``) is not a
recovery point: its step would have to be read from the folder. It counts as complete only when both DCP's
``.metadata`` and ``meta.pt`` exist: rank 0 writes ``meta.pt`` last, so a run
killed mid-save leaves an incomplete folder that resume skips.

Fenced commits (tier 1+): every rank writes into ``<name>.partial-g<generation>`` (a name no glob of
checkpoints matches); once the save is complete, rank 0 renames it to ``<name>`` only if the job is
still in that generation (:func:`commit_checkpoint`). A rank the job left behind (a node cut off
from the network and healed) cannot put a checkpoint where a resume would find it.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

__all__ = [
    "CHECKPOINT_GLOB",
    "checkpoint_name",
    "checkpoint_step",
    "commit_checkpoint",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "quarantine_checkpoints",
    "resolve_resume",
    "staging_path",
]

CHECKPOINT_GLOB = "*.ckpt"
_STEP_RE = re.compile(r"^step(\d+)\.ckpt$")
# Lightning's ModelCheckpoint: "{epoch}-{step}" with auto_insert_metric_name, a "-v<K>" version suffix.
_LIGHTNING_STEP_RE = re.compile(r"(?:^|[-_])step=(\d+)(?:[-_][^/]*)?\.ckpt$")


def checkpoint_name(step: int) -> str:
    return f"step{step:08d}.ckpt"


def checkpoint_step(path: str | Path) -> int | None:
    """The optimizer step a checkpoint's name says (``step00000005.ckpt``, ``epoch=0-step=5.ckpt``,
    ``epoch=0-step=5-v1.ckpt``); None if it says none."""
    name = Path(path).name
    match = _STEP_RE.match(name) or _LIGHTNING_STEP_RE.search(name)
    return int(match.group(1)) if match else None


def staging_path(final: Path, generation: int) -> Path:
    """Where generation ``generation`` writes the checkpoint that becomes ``final`` once committed."""
    return final.with_name(f"{final.name}.partial-g{generation}")


def commit_checkpoint(staging: Path, final: Path, *, current: bool) -> bool:
    """Rank 0, after a complete save into ``staging``: rename it to ``final`` if ``current`` (the job is
    still in the generation that wrote it), replacing an older ``final`` of the same step; else leave
    it where no resume looks and say so. True when committed."""
    if not current:
        print(
            f"not committing checkpoint {final.name}: the job left the generation that wrote it "
            f"(left in {staging}, which no resume reads)",
            file=sys.stderr,
        )
        return False
    assert is_complete_checkpoint(staging), staging
    old = None
    if final.exists():  # the same step saved by an earlier generation (steps redone after a fault)
        old = final.with_name(f"{final.name}.replaced-{os.getpid()}")
        final.rename(old)
    staging.rename(final)
    if old is not None:
        shutil.rmtree(old)
    return True


def is_complete_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / "meta.pt").is_file()


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in ``directory``, or None."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        return None
    found = [
        (step, p)
        for p in directory.glob(CHECKPOINT_GLOB)
        if (step := checkpoint_step(p)) is not None and is_complete_checkpoint(p)
    ]
    return max(found)[1] if found else None


def quarantine_checkpoints(directory: str | Path | None, *, after_step: int, tag: str) -> list[Path]:
    """Rename the checkpoints of steps after ``after_step`` to ``<name>.suspect-<tag>``, so that no
    resume picks them (they may hold state found corrupt); kept, not deleted. Safe to call from
    every rank at once (a folder another rank renamed first is skipped). Returns what this call moved.
    """
    if directory is None or not Path(directory).is_dir():
        return []
    moved = []
    for path in sorted(Path(directory).glob(CHECKPOINT_GLOB)):
        step = checkpoint_step(path)
        if step is None or step <= after_step:
            continue
        target = path.with_name(f"{path.name}.suspect-{tag}")
        try:
            path.rename(target)
        except FileNotFoundError:  # another rank moved it first
            continue
        moved.append(target)
    return moved


def resolve_resume(resume: str, directory: str | Path) -> Path | None:
    """Turn ``checkpoint.resume`` into a checkpoint path (or None to start fresh).

    ``auto``: the latest complete checkpoint in ``directory`` if any; ``never``:
    None; anything else must be a complete checkpoint folder.
    """
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(directory)
    path = Path(resume).expanduser()
    if not is_complete_checkpoint(path):
        raise FileNotFoundError(
            f"checkpoint.resume={resume!r} is not a complete checkpoint folder "
            "(needs .metadata and meta.pt); "
            f"use checkpoint.resume=auto to pick the latest one in checkpoint.dir, or never to start fresh"
        )
    return path
