"""Tier 4's recovery stall against torchft's own, on this machine, in one run (issue #33).

    python bench/peers.py [--recipe llama3_tiny] [--steps 30] [--fault-step 20] [--timeout 240]
                          [--only ours|torchft]

Both sides train the recipe's model (the same ``Llama3`` class and shape, ``llama3_tiny``: 0.9M
parameters) and lose one process to a SIGKILL:

- ours: ``launch.py`` at tier 4 (buddy copies, a warm spare), the recipe's 4 ranks, rank 1 killed
  in the forward of step ``--fault-step``; the stall is the run's summary figure, the fault to the
  first completed step after it (every rank), from its ``events.jsonl``;
- torchft (``torchft-nightly``, the ``bench`` extra): its lighthouse, started as torchft's
  ``examples/slurm/README.md`` starts it, and 2 replica groups of one rank each
  (``ProcessGroupGloo``, torchft's ``DistributedDataParallel`` and ``Optimizer`` wrappers, AdamW,
  the recipe's micro-batch per replica); replica 1 is SIGKILLed after its step ``--fault-step`` and
  started again, and the stall is the kill to the restarted replica's first committed step (it
  heals from replica 0 first). Two restarts are measured: ``cold`` (a new process, imports
  included) and ``pre-imported`` (a standby process with torch and torchft imported, let go at the
  kill: the same head start as our warm spare).

Prints both stalls and ours / torchft's (target, issue #33: at most 1/3). Without torchft it says so
and exits 0. Every process it starts runs in its own session and is killed (the whole group) when
the script ends, fails or times out (``--timeout`` per run).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIGHTHOUSE_ARGS = ("--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Processes:
    """Every process this script starts, each in its own session; :meth:`close` kills them all."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []

    def start(self, cmd: list[str], *, env: dict[str, str] | None = None, log: Path) -> subprocess.Popen:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
            )
        self.started.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL ``proc``'s whole process group and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print(f"peers: process {proc.pid} did not end 10 s after SIGKILL", file=sys.stderr)

    def stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM ``proc``'s group (``launch.py`` then stops the ranks it started in their own
        sessions), SIGKILL what is left 15 s later."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
        self.kill(proc)

    def close(self) -> None:
        for proc in self.started:
            self.stop(proc)
        self.started.clear()


@contextlib.contextmanager
def processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.close()


# -- ours ------------------------------------------------------------------------------------------------
def run_ours(work: Path, args: argparse.Namespace) -> tuple[float, float, float]:
    """(fault -> first step after, its first step, the median step) of a tier-4 demo run, in seconds."""
    sys.path.insert(0, str(ROOT / "bench"))
    from recovery import job_overrides, only_fault  # bench/recovery.py: the same job and reading

    from ckless_lightning.record.events import read_events
    from ckless_lightning.record.loss_log import read_loss_records
    from ckless_lightning.record.summary import summarize

    run_dir = work / "ours"
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        f"hydra.run.dir={run_dir}",
        *job_overrides(args),
        "tier=4",
        "replication.source=buddy",
    ]
    print(f"peers: ours: {' '.join(cmd[2:])}", file=sys.stderr)
    with processes() as procs:
        proc = procs.start(cmd, log=work / "ours.log")
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(
                f"our run did not end within {args.timeout:g} s (log: {work / 'ours.log'})"
            ) from err
    if code:
        tail = (work / "ours.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"our run exited {code}:\n{tail}")
    fault, _ = only_fault(run_dir)
    summary = summarize(read_events(run_dir / "events.jsonl"), read_loss_records(run_dir / "losses.jsonl"))
    if fault.total_s is None:
        raise RuntimeError(f"our run did not recover from its fault ({fault.outcome})")
    nan = float("nan")
    return fault.total_s, fault.first_step_s or nan, summary.step_time_s or nan


def recipe_model(recipe: str) -> tuple[object, int, int]:
    """The recipe's model config (``recipes/<recipe>.yaml``), sequence length and micro-batch."""
    import yaml

    from ckless_lightning.models import Llama3Config

    spec = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())
    model = dict(spec["model"])
    if model.pop("_target_") != "ckless_lightning.models.Llama3Config":
        raise SystemExit(f"peers: --recipe must be a Llama 3 recipe, {recipe} is not")
    return Llama3Config(**model), int(spec["data"]["seq_len"]), int(spec["data"]["micro_batch_size"])


# -- torchft --------------------------------------------------------------------------------------------
def replica_main(args: argparse.Namespace) -> None:
    """One torchft replica group of one rank: train, one JSON line per step to ``--out``."""
    begun = time.time()
    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    from ckless_lightning.models import build_model

    out = Path(args.out)

    def write(**fields: object) -> None:
        with out.open("a") as f:
            f.write(
                json.dumps({"t": time.time(), "replica": args.replica, "pid": os.getpid(), **fields}) + "\n"
            )

    write(event="imported", seconds=time.time() - begun)
    if args.go:
        go = Path(args.go)
        while not go.exists():
            time.sleep(0.002)
        write(event="let_go")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg, seq_len, micro_batch = recipe_model(args.recipe)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    # The replica group's own store (torchrun's, in a real job); a restarted replica gets a new one.
    store = TCPStore("127.0.0.1", args.store_port, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"peers_{args.replica}",
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=args.store_port,
        lighthouse_addr=args.lighthouse,
        timeout=timedelta(seconds=10),
    )
    ddp = DistributedDataParallel(manager, model)
    wrapped = Optimizer(manager, optimizer)
    write(event="ready")
    while manager.current_step() < args.steps:
        step = manager.current_step()
        wrapped.zero_grad()
        g = torch.Generator().manual_seed(1000 * step + args.replica)
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=g)
        logits = ddp(tokens[:, :-1]).logits
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        wrapped.step()
        write(event="step", step=manager.current_step(), committed=manager.current_step() > step)
    manager.shutdown(wait=False)
    del store
    write(event="done")


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            lines.append(json.loads(line))
    return lines


def _wait_for(path: Path, predicate: Callable[[dict], bool], timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in _lines(path):
            if predicate(record):
                return record
        time.sleep(0.01)
    raise TimeoutError(f"torchft: {what} not within {timeout:g} s ({path})")


@dataclass(frozen=True)
class TorchftStall:
    restart: str  # "cold" or "pre-imported"
    stall_s: float  # kill -> the restarted replica's first committed step
    ready_s: float  # kill -> its manager and model built (before the quorum and the heal)
    median_step_s: float  # replica 0's committed steps before the kill


def lighthouse_binary() -> str:
    """torchft's lighthouse server, installed beside this Python (or on PATH)."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise RuntimeError("torchft is installed but its torchft_lighthouse binary is not found")
    return found


def run_torchft(work: Path, args: argparse.Namespace, restart: str) -> TorchftStall:
    lighthouse_port, out = free_port(), work / f"torchft-{restart}.jsonl"
    lighthouse = f"http://127.0.0.1:{lighthouse_port}"
    log = work / f"torchft-{restart}.log"
    with processes() as procs:
        procs.start(
            [lighthouse_binary(), "--bind", f"127.0.0.1:{lighthouse_port}", *LIGHTHOUSE_ARGS], log=log
        )

        def replica(i: int, go: Path | None = None) -> subprocess.Popen:
            cmd = [sys.executable, __file__, "--replica", str(i), "--out", str(out)]
            cmd += ["--store-port", str(free_port()), "--lighthouse", lighthouse, "--recipe", args.recipe]
            cmd += ["--steps", str(args.steps), *(["--go", str(go)] if go else [])]
            return procs.start(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, log=log)

        replica(0)
        victim = replica(1)
        go = work / f"go-{restart}"
        standby = replica(1, go) if restart == "pre-imported" else None
        _wait_for(
            out,
            lambda r: r["replica"] == 1 and r.get("event") == "step" and r["step"] >= args.fault_step,
            args.timeout,
            f"replica 1 at step {args.fault_step}",
        )
        if standby is not None:
            _wait_for(
                out, lambda r: r["pid"] == standby.pid and r["event"] == "imported", args.timeout, "standby"
            )
        procs.kill(victim)
        killed = time.time()
        if standby is not None:
            go.touch()
        else:
            replica(1)
        first = _wait_for(
            out,
            lambda r: r["replica"] == 1 and r["pid"] != victim.pid and r.get("committed") and r["t"] > killed,
            args.timeout,
            "the restarted replica's first committed step",
        )
        ready = _wait_for(
            out, lambda r: r["pid"] == first["pid"] and r["event"] == "ready", args.timeout, "its ready line"
        )
    steps = [r["t"] for r in _lines(out) if r["replica"] == 0 and r.get("committed") and r["t"] < killed]
    gaps = sorted(b - a for a, b in itertools.pairwise(steps))
    median = gaps[len(gaps) // 2] if gaps else float("nan")
    return TorchftStall(restart, first["t"] - killed, ready["t"] - killed, median)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="llama3_tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fault-step", type=int, default=20)
    parser.add_argument("--every", type=int, default=10, help="our run's checkpoint interval")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run before it is killed")
    parser.add_argument("--only", choices=("ours", "torchft"), help="run one side only")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for ours")
    # a torchft replica (started by this script)
    parser.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--go", help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica is not None:
        replica_main(args)
        return 0
    if importlib.util.find_spec("torchft") is None:
        print(
            "peers: torchft is not installed (pip install -e '.[bench]'): nothing to compare against, skipped"
        )
        return 0
    with tempfile.TemporaryDirectory(prefix="ckless-peers-") as tmp:
        work = Path(tmp)
        nan = float("nan")
        try:
            skip_ours = args.only == "torchft"
            ours, ours_first, ours_median = (nan, nan, nan) if skip_ours else run_ours(work, args)
            restarts = ("cold", "pre-imported") if args.only != "ours" else ()
            theirs = [run_torchft(work, args, restart) for restart in restarts]
        except (RuntimeError, TimeoutError):
            for log in sorted(work.glob("*.log")):  # before the directory goes
                print(f"--- {log.name} (last 3000 characters)", file=sys.stderr)
                print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
    print(f"\n{args.recipe}, one SIGKILL, kill -> the replaced process's first step after it (seconds):")
    if not skip_ours:
        print(
            f"  ours, tier 4 buddy, 4 ranks, warm spare   {ours:6.2f}  "
            f"(first step {ours_first:.2f}, median step {ours_median:.2f})"
        )
    for t in theirs:
        print(
            f"  torchft, 2 replicas x 1 rank, {t.restart:<12}  {t.stall_s:6.2f}  (model and manager ready "
            f"{t.ready_s:.2f}, median step {t.median_step_s:.2f})"
        )
    for t in theirs if not skip_ours else ():
        print(f"  ours / torchft ({t.restart}): {ours / t.stall_s:.2f} (target <= 0.33)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
