"""The built-in corpus: real text that every Python install already has on disk.

Smoke runs and tests need a few MB of non-random text without network access; the
standard library's sources and docs (``.py``, ``.txt``, ``.rst``) fit that. Test suites,
third-party packages and build-specific files are left out so the corpus is the same on
every install of one Python version.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DefaultCorpus", "default_corpus", "file_fingerprints"]

_SUFFIXES = (".py", ".txt", ".rst")
# Directory names never descended into: test suites, installed packages, bytecode, build config.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Files whose content depends on the build machine rather than the Python version.
_SKIP_PREFIXES = ("_sysconfigdata",)


@dataclass(frozen=True)
class DefaultCorpus:
    """The stdlib files chosen for one ``max_source_bytes``, in reading order."""

    root: Path
    files: tuple[Path, ...]
    num_bytes: int


def _keep_dir(name: str) -> bool:
    return name not in _SKIP_DIRS and not name.startswith((".", "config-"))


def default_corpus(max_source_bytes: int | None = None, root: str | Path | None = None) -> DefaultCorpus:
    """Pick the stdlib text files, sorted by relative path, until ``max_source_bytes`` is reached.

    Files are taken whole and in order while the running total stays within the cap; the
    first file is always taken, so a tiny cap still yields a non-empty corpus. ``root``
    overrides the stdlib directory (for tests).
    """
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"standard library directory {base} not found; set data.source to your data.")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if _keep_dir(d)]
        for name in filenames:
            if name.endswith(_SUFFIXES) and not name.startswith(_SKIP_PREFIXES):
                path = Path(dirpath) / name
                found.append((path.relative_to(base).as_posix(), path))
    found.sort()
    files: list[Path] = []
    total = 0
    for _, path in found:
        size = path.stat().st_size
        if max_source_bytes is not None and files and total + size > max_source_bytes:
            break
        files.append(path)
        total += size
    if not files:
        raise FileNotFoundError(f"no .py/.txt/.rst files under {base}; set data.source to your data.")
    return DefaultCorpus(root=base, files=tuple(files), num_bytes=total)


def file_fingerprints(paths: Iterable[Path]) -> list[tuple[str, int, int]]:
    """``(absolute path, size, mtime_ns)`` per file: what the prepared-data cache key hashes."""
    out = []
    for path in paths:
        st = path.stat()
        out.append((str(path.resolve()), st.st_size, st.st_mtime_ns))
    return out
