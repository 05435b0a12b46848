"""Where a job's text comes from: ``data.source`` resolved to files and a format.

Torch-, numpy- and pyarrow-free, so that ``launch.py`` checks ``data.source`` before it starts the
fork server or prepares anything; :mod:`.packing` tokenizes what this finds.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from ckless_lightning.data.config import DataConfig
from ckless_lightning.data.corpus import default_corpus

__all__ = ["Source", "resolve_source"]

_EXTENSIONS = {
    ".txt": "text", ".text": "text", ".md": "text", ".rst": "text", ".py": "text",
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
    ".parquet": "parquet", ".pq": "parquet",
}  # fmt: skip


@dataclass(frozen=True)
class Source:
    format: str  # text | jsonl | parquet | tokenized
    files: tuple[Path, ...]  # what the cache key fingerprints
    label: str  # for messages
    directory: Path | None = None  # the save_to_disk directory of a tokenized source


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _list_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        files.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
    return sorted(files)


def resolve_source(cfg: DataConfig) -> Source:
    """Find the files behind ``cfg.source`` and settle its format; ``FileNotFoundError`` or
    ``ValueError`` naming ``data.source``/``data.format`` when they do not fit."""
    if cfg.source is None:
        corpus = default_corpus(cfg.max_source_bytes)
        return Source("text", corpus.files, f"built-in stdlib corpus ({len(corpus.files)} files)")
    raw = os.path.expanduser(cfg.source)
    fix = "fix the path, or set data.source=null to use the built-in corpus."
    if any(c in raw for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(raw, recursive=True) if os.path.isfile(p))
        if not files:
            raise FileNotFoundError(f"data.source={cfg.source!r}: the glob matches no files; {fix}")
    else:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"data.source={cfg.source!r}: {path.resolve()} does not exist; {fix}")
        auto_saved = cfg.format == "auto" and _is_saved_dataset(path)
        if path.is_dir() and (cfg.format == "tokenized" or auto_saved):
            if not _is_saved_dataset(path):
                raise ValueError(
                    f"data.source={cfg.source!r} is not a Dataset.save_to_disk directory (no state.json); "
                    "point it at one or set data.format to the files' format."
                )
            return Source("tokenized", tuple(_list_files(path)), str(path), directory=path)
        files = _list_files(path) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"data.source={cfg.source!r}: directory {path.resolve()} is empty; {fix}")
    if cfg.format == "tokenized":
        raise ValueError(
            "data.format=tokenized needs data.source to be a Dataset.save_to_disk directory, "
            f"got {cfg.source!r}."
        )
    if cfg.format != "auto":
        return Source(cfg.format, tuple(files), cfg.source)
    formats = {_EXTENSIONS.get(f.suffix.lower()) for f in files}
    if None in formats:
        unknown = sorted({f.suffix or f.name for f in files if f.suffix.lower() not in _EXTENSIONS})
        raise ValueError(
            f"data.source={cfg.source!r}: cannot tell the format of {', '.join(unknown)} files by extension; "
            "set data.format to text, jsonl or parquet."
        )
    if len(formats) > 1:
        raise ValueError(
            f"data.source={cfg.source!r} mixes {', '.join(sorted(formats))} files; "
            "narrow data.source with a glob or set data.format."
        )
    return Source(formats.pop(), tuple(files), cfg.source)
