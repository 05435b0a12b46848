"""A private one-host Slurm cluster (munged, slurmctld, slurmd) in a temp dir, for tests.

``SlurmCluster()`` starts its own ``munged`` (own key, socket, pid, log and seed files), writes a
``slurm.conf`` with free ports and every state, spool, pid and log file under the temp dir, starts
``slurmctld -D`` and ``slurmd -D`` and waits until ``sinfo`` shows the node idle. Nothing of the
system's Slurm or MUNGE (``/etc/slurm``, ``/run/munge``) is used, so it clashes with nothing.
Clients find the cluster through ``cluster.env`` (``SLURM_CONF``); the helpers ``srun``,
``sbatch``, ``wait_job``, ``job_state`` and ``requeue_count`` use it. ``close()`` cancels every
job, stops the daemons (SIGTERM, a bounded wait, SIGKILL), kills whatever of the cluster is left
(every process started with this cluster's environment: job steps, their tasks) and removes the
temp dir; it runs on ``with``-exit, at interpreter exit, and in the fixture's teardown.

Tests get the session fixture ``slurm_cluster`` with ``pytest_plugins = ["slurm"]`` in the test
module (importing the fixture by name trips ruff's F811); it skips when Slurm or MUNGE is not
installed, or when not root (the daemons run as ``SlurmUser=root``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

__all__ = ["SlurmCluster", "SlurmError", "slurm_available", "slurm_cluster"]

DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("srun", "sbatch", "squeue", "scontrol", "sinfo", "scancel")
# Job states after which a job does not run again by itself (``scontrol show job`` JobState=).
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
# The daemons live in /usr/sbin, which a non-login PATH may lack.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])


class SlurmError(RuntimeError):
    """The cluster did not come up, or a Slurm command failed; the message carries the logs."""


def _which(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def slurm_available() -> str | None:
    """None when a private cluster can be started here, else why not (a pytest skip reason)."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if _which(name) is None]
    if missing:
        return f"Slurm/MUNGE not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the private Slurm cluster needs root (SlurmUser=root; slurmd starts jobs as their user)"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"  ({path.name}: {exc})"
    return "\n".join(f"  {line}" for line in text.splitlines()[-lines:]) or f"  ({path.name}: empty)"


class SlurmCluster:
    """One slurmctld and one slurmd (node ``<short hostname>``, ``cpus`` CPUs) with a private munged.

    Start it with ``with SlurmCluster() as cluster:`` or ``cluster = SlurmCluster().start()`` and
    ``cluster.close()``.
    """

    def __init__(
        self, cpus: int = 8, real_memory_mb: int = 1024, start_timeout: float = 60.0, cred_expire: int = 10
    ) -> None:
        self.cpus = cpus
        self.real_memory_mb = real_memory_mb
        self.start_timeout = start_timeout
        # AuthInfo cred_expire: a step credential's lifetime, and how long a requeued job waits
        # before it may start again (cred_expire + 1 s; Slurm's default is 120 s, its minimum 5).
        self.cred_expire = cred_expire
        self.node = socket.gethostname().split(".")[0]
        self.dir: Path | None = None
        self.env: dict[str, str] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._closed = False

    # -- paths -----------------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        assert self.dir is not None, "cluster not started"
        return self.dir / name

    @property
    def conf_path(self) -> Path:
        return self._path("slurm.conf")

    @property
    def munge_socket(self) -> Path:
        return self._path("munge/munge.socket")

    # -- start -----------------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        reason = slurm_available()
        if reason:
            raise SlurmError(reason)
        # A short path: the munge socket's path must fit in sun_path (108 bytes).
        self.dir = Path(tempfile.mkdtemp(prefix="ckless-slurm-"))
        atexit.register(self.close)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        # Searchable by all (munged warns otherwise; jobs of other users need its socket); the key
        # stays 0400 and state, spool and logs 0700.
        assert self.dir is not None
        self.dir.chmod(0o755)
        self._path("munge").mkdir(mode=0o755)
        for sub in ("state", "spool", "log"):
            self._path(sub).mkdir(mode=0o700)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env.update(
            SLURM_CONF=str(self.conf_path),
            PATH=_SEARCH_PATH,
            # Marks every process of this cluster (daemons, steps, tasks inherit it): close() kills
            # whatever still carries it.
            CKLESS_SLURM_CLUSTER=str(self.dir),
        )
        self._start_munged()
        self._write_conf()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf_path)])
        self._wait("slurmctld answers", self._slurmctld_up)
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf_path), "-N", self.node])
        self._wait(f"node {self.node} idle", self._node_idle)

    def _start_munged(self) -> None:
        key = self._path("munge/munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        # munged runs as the current user (root here), which owns the key; --force: munged
        # declines to run as root, and warns about the temp dir's parents, without it.
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self._path('munge/munged.pid')}",
                f"--log-file={self._path('log/munged.log')}",
                f"--seed-file={self._path('munge/munged.seed')}",
                "--num-threads=2",
            ],
        )
        self._wait("munged socket", self.munge_socket.exists)

    def _write_conf(self) -> None:
        d = self.dir
        conf = f"""\
ClusterName=ckless
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={d}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=5
MailProg=/bin/true
InactiveLimit=0
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.real_memory_mb} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        self.conf_path.write_text(conf)
        self._path("plugstack.conf").write_text("")  # not /etc/slurm's

    def _spawn(self, name: str, argv: Sequence[str | None]) -> None:
        out = open(self._path(f"log/{name}.out"), "wb")  # closed below; the child keeps its copy
        try:
            self._procs[name] = subprocess.Popen(
                [str(a) for a in argv],
                env=self.env,
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            out.close()

    def _wait(self, what: str, ready: Any) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmError(
                        f"{name} exited with {proc.returncode} while waiting for {what}\n{self.logs()}"
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                raise SlurmError(
                    f"timed out after {self.start_timeout:.0f} s waiting for {what}\n{self.logs()}"
                )
            time.sleep(0.2)

    def _slurmctld_up(self) -> bool:
        result = self._run(["scontrol", "ping"], check=False, timeout=15)
        return "UP" in result.stdout and "DOWN" not in result.stdout

    def _node_idle(self) -> bool:
        result = self._run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"], check=False, timeout=15)
        return result.stdout.strip() == "idle"

    def logs(self, lines: int = 40) -> str:
        """The tails of the daemons' logs and captured output (for error messages)."""
        if self.dir is None or not self.dir.exists():
            return "(no cluster dir)"
        parts = []
        for path in sorted(self._path("log").iterdir()):
            parts.append(f"--- {path.name} (last {lines} lines):\n{_tail(path, lines)}")
        return "\n".join(parts)

    # -- clients ---------------------------------------------------------------------------------

    def _run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, **kwargs
        )
        if check and result.returncode != 0:
            raise SlurmError(
                f"{' '.join(argv)} exited with {result.returncode}\n"
                f"stdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-2000:]}"
            )
        return result

    def run(self, *argv: str, timeout: float = 60) -> str:
        """Run a Slurm client (``scontrol``, ``squeue``, ...) against this cluster; its stdout."""
        return self._run(argv, timeout=timeout).stdout

    def srun(
        self, args: Sequence[str], timeout: float = 60, **popen_kwargs: Any
    ) -> subprocess.CompletedProcess:
        """``srun *args`` to the end (killed after ``timeout``); output captured as text unless
        ``popen_kwargs`` redirect it. The return code is not checked."""
        kwargs: dict[str, Any] = {"env": self.env}
        if not {"stdout", "stderr", "capture_output"} & popen_kwargs.keys():
            kwargs.update(capture_output=True, text=True)
        kwargs.update(popen_kwargs)
        return subprocess.run(["srun", *args], timeout=timeout, **kwargs)

    def sbatch(
        self,
        script_path: str | os.PathLike[str],
        *args: str,
        script_args: Sequence[str] = (),
        cwd: str | os.PathLike[str] | None = None,
    ) -> int:
        """Submit ``script_path`` with sbatch options ``args`` (and ``script_args`` for the script);
        the job id. Without ``--output``/``-o`` the job's output goes to ``slurm-<id>.out`` in the
        cluster's dir (not the caller's cwd)."""
        extra = []
        if not any(a == "-o" or a.startswith("--output") for a in args):
            extra.append(f"--output={self._path('slurm-%j.out')}")
        result = self._run(["sbatch", "--parsable", *extra, *args, str(script_path), *script_args], cwd=cwd)
        return int(result.stdout.strip().split(";")[0])

    def show_job(self, job_id: int) -> str | None:
        """``scontrol show job -o`` of the job (one line), or None once Slurm has forgotten it."""
        result = self._run(["scontrol", "show", "job", "-o", str(job_id)], check=False, timeout=30)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return None
            raise SlurmError(f"scontrol show job {job_id}: {result.stderr.strip()}")
        return result.stdout.strip()

    def _field(self, job_id: int, key: str) -> str | None:
        line = self.show_job(job_id)
        if line is None:
            return None
        match = re.search(rf"(?:^|\s){key}=(\S*)", line)
        return match.group(1) if match else None

    def job_state(self, job_id: int) -> str | None:
        """The job's JobState (PENDING, RUNNING, COMPLETED, ...); None when unknown."""
        return self._field(job_id, "JobState")

    def requeue_count(self, job_id: int) -> int:
        """How often the job was requeued (``Restarts=``; the job sees it as SLURM_RESTART_COUNT)."""
        value = self._field(job_id, "Restarts")
        if value is None:
            raise SlurmError(f"job {job_id} unknown")
        return int(value)

    def wait_job(self, job_id: int, timeout: float = 120) -> str:
        """Wait until the job is in a final state (COMPLETED, FAILED, ...; a requeued job is not
        final) and return it; SlurmError on timeout."""
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in FINAL_STATES:
                return state
            time.sleep(0.5)
        raise SlurmError(
            f"job {job_id} still {state} after {timeout:.0f} s\n{self.show_job(job_id)}\n{self.logs()}"
        )

    # -- stop ------------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        return self.start() if self.dir is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel all jobs, stop the daemons and what they started, remove the temp dir. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            with contextlib.suppress(Exception):
                self._cancel_all()
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.get(name)
            if proc is not None:
                _stop(proc, grace=10)
        self._kill_leftovers()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _cancel_all(self, timeout: float = 20) -> None:
        jobs = self._run(["squeue", "-h", "-o", "%A"], timeout=15).stdout.split()
        if not jobs:
            return
        self._run(["scancel", *jobs], check=False, timeout=15)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # until no job is running or completing
            if not self._run(["squeue", "-h", "-o", "%A"], check=False, timeout=15).stdout.split():
                return
            time.sleep(0.3)

    def _kill_leftovers(self) -> None:
        """SIGTERM, then SIGKILL, every process that carries this cluster's marker (job steps'
        slurmstepd and tasks outlive slurmd); this process never does (only its children's env)."""
        if self.dir is None:
            return
        marker = f"CKLESS_SLURM_CLUSTER={self.dir}".encode()
        for sig, pause in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 0.5)):
            pids = [pid for pid in _pids_with_env(marker) if pid != os.getpid()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + pause
            while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
                time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _pids_with_env(marker: bytes) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A started private Slurm cluster for the session (per pytest-xdist worker); skips when
    :func:`slurm_available` says it cannot run here."""
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
