"""Start this node's rank processes, stream rank 0's output, stop them all on the first failure.

The seed of the per-node agent: it owns every process it starts (each in its
own session, so a rank's children die with it) and leaves none behind, on a
normal end, a rank failure, Ctrl-C or SIGTERM. Restart policies, warm spares,
heartbeats and the job store come with the agent proper.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RankGroup", "RankSpec"]


@dataclass(frozen=True)
class RankSpec:
    """What a rank process is told: its ranks and where the job's rendezvous is."""

    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    def env(self) -> dict[str, str]:
        # The variables torchrun sets; Lightning's TorchElasticEnvironment reads them.
        return {
            "RANK": str(self.global_rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


class RankGroup:
    """The rank processes of one node.

    Rank 0's output goes to this console and to ``log_dir/rank0.log``; the
    others' to ``log_dir/rank<N>.log``. :meth:`wait` returns 0 when every rank
    ended cleanly, else the first failing rank's exit code (128+signal when
    killed), after stopping the rest.
    """

    def __init__(
        self, command: list[str], specs: list[RankSpec], log_dir: Path, *, grace_s: float = 5.0
    ) -> None:
        self.command = command
        self.specs = specs
        self.log_dir = Path(log_dir)
        self.grace_s = grace_s
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._pumps: list[threading.Thread] = []
        self.failed_rank: int | None = None

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in self.specs:
            env = {
                **os.environ,
                **spec.env(),
                "PYTHONUNBUFFERED": "1",
                "CKLESS_LAUNCHER_PID": str(os.getpid()),  # the rank dies with us (see rank.py)
            }
            log = open(self.log_dir / f"rank{spec.global_rank}.log", "wb")
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.procs[spec.global_rank] = proc
            echo = spec.global_rank == 0
            pump = threading.Thread(target=_pump, args=(proc, log, echo), daemon=True)
            pump.start()
            self._pumps.append(pump)

    def wait(self, poll_s: float = 0.1) -> int:
        while True:
            codes = {rank: proc.poll() for rank, proc in self.procs.items()}
            failed = [(rank, code) for rank, code in codes.items() if code not in (None, 0)]
            if failed:
                self.failed_rank, code = failed[0]
                self.stop()
                return _exit_code(code)
            if all(code == 0 for code in codes.values()):
                self._join_pumps()
                return 0
            time.sleep(poll_s)

    def stop(self) -> None:
        """SIGTERM every live rank's session, SIGKILL what is left after the grace period, reap all."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for proc in live:
            _signal_session(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_session(proc, signal.SIGKILL)
                proc.wait()
        for proc in self.procs.values():  # a rank's own children, even if the rank exited by itself
            _signal_session(proc, signal.SIGKILL)
        self._join_pumps()

    def log_tail(self, rank: int, lines: int = 30) -> str:
        path = self.log_dir / f"rank{rank}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _join_pumps(self) -> None:
        for pump in self._pumps:
            pump.join(timeout=5)


def _pump(proc: subprocess.Popen[bytes], log, echo: bool) -> None:
    assert proc.stdout is not None
    with log:
        while chunk := proc.stdout.read1(65536):
            log.write(chunk)
            log.flush()
            if echo:
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()


def _signal_session(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # the rank leads its own session: pgid == pid
    except ProcessLookupError:
        return


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code
