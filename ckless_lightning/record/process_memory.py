"""This process's memory as Linux reports it: current and peak RSS, and a peak that can be reset.

A recovery's memory cost is its peak above the steady state, not the process's all-time peak
(a training step's transients are usually higher): the recovery loop resets the peak once the
old generation is released, and the restore reports the peak since (``memory_restore``'s
``peak_rss`` against ``state_released``'s ``rss``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["peak_rss_bytes", "reset_peak_rss", "rss_bytes"]

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        text = _STATUS.read_text()
    except OSError:  # not Linux
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def rss_bytes() -> int | None:
    """Resident set size now (None where /proc is not available)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else None


def peak_rss_bytes() -> int | None:
    """Peak resident set size since the process started or :func:`reset_peak_rss` (``VmHWM``)."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0: ``5`` to ``/proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
