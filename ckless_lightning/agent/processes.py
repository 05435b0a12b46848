"""Rank and spare processes of one node: start (cold or from a warm spare), stream output, stop.

Every process runs in its own session, so a stop reaches whatever it started,
and carries ``CKLESS_LAUNCHER_PID`` so that it dies with the agent
(PR_SET_PDEATHSIG, see ``ckless_lightning.runtime.contract``). Rank 0's output goes to this
console and to ``rank_logs/rank0.log``; the others' to ``rank_logs/rank<N>.log``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from ckless_lightning.runtime.contract import RankSpec, launcher_env

__all__ = ["RankProcess", "SparePool", "is_stopped", "signal_session"]


def signal_session(pid: int, sig: signal.Signals) -> None:
    """Signal the session (process group) that ``pid`` leads; gone already is fine."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (SIGSTOP/SIGTSTP: state ``T`` in ``/proc/<pid>/stat``).

    Nothing in a job stops its own processes, so a stopped one is a fault: the agent kills it at
    once instead of waiting for its heartbeat to go stale (ptrace stops, state ``t``, do not count).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


class RankProcess:
    """One rank's process: ``spawn`` a cold one, or ``adopt`` a warm spare and assign it the rank."""

    def __init__(self, spec: RankSpec, proc: subprocess.Popen[bytes], log_dir: Path, *, warm: bool) -> None:
        self.spec = spec
        self.proc = proc
        self.warm = warm
        self.started_at = time.time()
        self.log_path = Path(log_dir) / f"rank{spec.global_rank}.log"
        self._pump = threading.Thread(target=self._copy_output, daemon=True)
        self._pump.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def spawn(cls, spec: RankSpec, command: list[str], log_dir: Path) -> RankProcess:
        env = {**launcher_env(), **spec.env(time.time())}
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        return cls(spec, proc, log_dir, warm=False)

    @classmethod
    def adopt(
        cls, spec: RankSpec, spare: subprocess.Popen[bytes], argv: list[str], log_dir: Path
    ) -> RankProcess:
        assert spare.stdin is not None
        assignment = {"env": spec.env(time.time()), "argv": argv}
        spare.stdin.write((json.dumps(assignment) + "\n").encode())
        spare.stdin.close()
        return cls(spec, spare, log_dir, warm=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        signal_session(self.pid, signal.SIGKILL)

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; reap; also kill anything left in its session."""
        if self.proc.poll() is None:
            signal_session(self.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
            try:
                self.proc.wait(timeout=grace_s if grace_s > 0 else None)
            except subprocess.TimeoutExpired:
                signal_session(self.pid, signal.SIGKILL)
                self.proc.wait()
        signal_session(self.pid, signal.SIGKILL)
        self._pump.join(timeout=5)

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        echo = self.spec.global_rank == 0
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            _copy(self.proc.stdout, log, echo)


def _copy(stream: IO[bytes], log: IO[bytes], echo: bool) -> None:
    while chunk := stream.read1(65536):  # type: ignore[attr-defined]
        log.write(chunk)
        log.flush()
        if echo:
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()


class SparePool:
    """Warm processes with torch, Lightning and the project imported, waiting on stdin for a rank.

    ``take`` hands one out (or None) and starts a replacement in the background,
    so the pool stays at ``size``. A spare's imports overlap training.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._spares: list[subprocess.Popen[bytes]] = []

    def fill(self) -> None:
        while len(self._spares) < self.size:
            self._spares.append(
                subprocess.Popen(
                    [sys.executable, "-m", "ckless_lightning.spare"],
                    env=launcher_env(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def take(self) -> subprocess.Popen[bytes] | None:
        """A running spare (dead or stopped ones are dropped, a stopped one killed), or None."""
        for proc in self._spares:
            if proc.poll() is None and is_stopped(proc.pid):
                signal_session(proc.pid, signal.SIGKILL)
                proc.wait()
        self._spares = [p for p in self._spares if p.poll() is None]
        return self._spares.pop(0) if self._spares else None

    def close(self) -> None:
        for proc in self._spares:
            signal_session(proc.pid, signal.SIGKILL)
            proc.wait()
        self._spares.clear()
