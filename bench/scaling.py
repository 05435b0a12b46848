"""How tier 4's recovery scales with the model: Llama 3 shapes of about 1M, 25M, 100M and 300M
parameters on 4 CPU ranks, one SIGKILL each, against tier 0 on the same shapes (issue #11).

    python bench/scaling.py [--sizes 1M 25M 100M 300M] [--steps 4] [--skip-tier0] [--quick]
                            [--spare-wait 30] [--malloc-mmap-threshold BYTES] [--keep]

Every run is a real ``launch.py`` job on 4 local ranks (gloo): sequences of 64 tokens, micro-batch 1,
global batch 4, byte-level vocabulary (256), the built-in corpus. Per size:

- tier 0 (unless ``--skip-tier0``): a checkpoint every 3 steps, SIGKILL of rank 1 in the forward of
  step 4: the agent restarts every rank cold and they reload step 3 from disk (no step lost; the
  recovery is restart + reload). Gives the first-start init, the step time and the cold recovery.
- tier 4, buddy source (the default), a warm spare (``agent.spares=1``), no disk checkpoint at all:
  SIGKILL of rank 1 in the forward of step F; the spare takes rank 1's place and gets its shard from
  rank 2's host copy. The agent starts the spare once every rank has done a step, and it needs
  seconds to import, so F is chosen to fall ``--spare-wait`` seconds after the first step (from
  tier 0's step time, else an estimate); the table says whether the replacement was warm. Then
  ``--steps`` more steps.

While a job runs, this script samples VmRSS of every process of the job every 50 ms
(``/proc/<pid>/status``) and maps pids to ranks with the job's ``ranks_started`` events.

Printed: the recovery breakdown (seconds; detect: fault to the first rank leaving the generation;
spare: detection to the spare handed rank 1; comm: the new process groups; load = model (build: the
replaced rank allocates, survivors adopt their live shards) + restore (the rest of Lightning's
restore, the peers' state transfer included); first step: the first batch to the first completed
step; total: fault to the first completed step after it), the bytes one shard's state moves
(parameters + AdamW moments, the memory plan of the run's config), the transfer rate (the replaced
rank's model_ready -> memory_restore, which holds the transfer and the restore's other work; and
``bench/p2p_transfer.py`` for the same bytes against a memcpy measured in this process), VmRSS per
rank in steady state before the fault against the peak during the recovery, the first-start model
init per rank, step times, and the scaling ratios. A size whose tier 4 buddy run does not fit in the
memory available now runs HSDP 2x2 instead (``replication.source=hsdp``; marked), or is skipped if
that does not fit either; likewise tier 0; the tables say so. The estimate: per rank the process, the
state (16 B per local parameter; buddy copies: 4 slots of params + moments, 48 B more) and what glibc's
heap keeps (~80 B per local parameter: see ``MemoryModel``), learnt upwards from each run's peak.
On the 24 GB dev machine 300M needs ``--malloc-mmap-threshold 4194304``; there tier 0 fits and
tier 4 runs its HSDP fallback (buddy copies do not fit).

Progress goes to stderr, the tables to stdout. Run directories live in a temporary directory,
removed at the end unless ``--keep``. The machine is shared and noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from ckless_lightning.record.events import read_events
from ckless_lightning.record.loss_log import read_loss_records
from ckless_lightning.record.summary import FaultRecovery, summarize

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
GIB = 1 << 30


@dataclass(frozen=True)
class Shape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int

    def overrides(self) -> list[str]:
        return [
            f"model.dim={self.dim}",
            f"model.n_layers={self.n_layers}",
            f"model.n_heads={self.n_heads}",
            f"model.n_kv_heads={self.n_kv_heads}",
            f"model.ffn_dim={self.ffn_dim}",
        ]

    def num_params(self) -> int:
        from ckless_lightning.models import Llama3Config

        return Llama3Config(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=self.ffn_dim,
            vocab_size=256,
        ).num_params()


# Llama 3 shapes (vocab 256): 1.05M, 25.0M, 101M, 298M parameters.
SIZES: dict[str, Shape] = {
    "1M": Shape(128, 5, 4, 2, 384),
    "25M": Shape(512, 7, 8, 4, 1792),
    "100M": Shape(768, 13, 12, 4, 2688),
    "300M": Shape(1024, 21, 16, 8, 3584),
}
QUICK = ("1M", "25M")
WORLD = 4
COMMON = (
    "recipe=llama3_tiny",
    "data.seq_len=64",
    "data.micro_batch_size=1",
    f"trainer.global_batch_size={WORLD}",
    "trainer.enable_progress_bar=false",
    "checkpoint.save_final=false",
    # A step of the largest shape takes seconds on 2 cores; never take one for a hang.
    "agent.hang_timeout=900",
    "agent.startup_timeout=1800",
    "fault=kill",
    "fault.rank=1",
    "fault.phase=forward",
)
TIER0_FAULT_STEP = 4  # checkpoint every 3 steps: step 3 is on disk when rank 1 dies in step 4
PROCESS_BYTES = 0.55e9  # a rank or a spare without its model: torch, Lightning, datasets imported
# Resident bytes per parameter a rank holds (its shard), beyond the process: the state (params, grads,
# 2 AdamW moments: 16 B), tier 4 buddy's 4 host slots of params + moments (48 B), and what the
# allocator keeps: glibc's heap retains the freed all-gather / gradient buffers of every step (its
# mmap threshold grows to their size), ~80 B per local parameter measured at 25M and 100M, 5-9 B with
# MALLOC_MMAP_THRESHOLD_ fixed at 4 MiB (--malloc-mmap-threshold; 100M, 300M). Raised by what the
# runs measure.
STATE_BYTES = {"tier0": 16.0, "buddy": 64.0, "hsdp": 16.0}
HEAP_BYTES = {"default": 80.0, "fixed": 10.0}


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- memory ---------------------------------------------------------------------------------------


def available_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


def vm_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class RssSampler(threading.Thread):
    """Samples VmRSS of every descendant of ``root`` every ``interval`` s: ``samples[pid] = [(t, bytes)]``."""

    def __init__(self, root: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.interval = interval
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        pids: list[int] = []
        tick = 0
        while not self._stop_event.is_set():
            if tick % 10 == 0:  # look for new processes every ~0.5 s
                with contextlib.suppress(psutil.Error):
                    pids = [p.pid for p in psutil.Process(self.root).children(recursive=True)]
            tick += 1
            now = time.time()
            for pid in pids:
                rss = vm_rss(pid)
                if rss is not None:
                    self.samples.setdefault(pid, []).append((now, rss))
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def peak(self, pid: int | None, start: float, end: float) -> int | None:
        values = [rss for t, rss in self.samples.get(pid or -1, []) if start <= t < end]
        return max(values) if values else None


# --- runs -----------------------------------------------------------------------------------------


@dataclass
class Run:
    """One finished ``launch.py`` job (``error`` set if it failed), with its VmRSS samples."""

    name: str
    run_dir: Path
    rss: RssSampler | None = None
    error: str | None = None
    wall_s: float = 0.0

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.run_dir / "events.jsonl")

    def of(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e for e in self.events() if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())
        ]

    def phases(self, phase: str, gen: int) -> dict[int, dict[str, Any]]:
        """{rank: the rank's first ``phase`` event of generation ``gen``}."""
        out: dict[int, dict[str, Any]] = {}
        for e in sorted(self.of("rank_phase", phase=phase, gen=gen), key=lambda e: e["t"]):
            out.setdefault(int(e["rank"]), e)
        return out

    def pids(self, gen: int) -> dict[int, int]:
        """{rank: pid} of the processes that ran generation ``gen`` (started in it or before)."""
        out: dict[int, int] = {}
        for e in sorted(self.of("ranks_started"), key=lambda e: e["gen"]):
            if e["gen"] <= gen:
                out.update(zip(e["ranks"], e["pids"], strict=True))
        return out

    def losses(self) -> list[dict[str, Any]]:
        return read_loss_records(self.run_dir / "losses.jsonl")

    def max_rank_rss(self) -> int | None:
        """The largest VmRSS sampled of any rank process of the run."""
        if self.rss is None:
            return None
        pids = {pid for e in self.of("ranks_started") for pid in e["pids"]}
        values = [rss for pid in pids for _, rss in self.rss.samples.get(pid, [])]
        return max(values) if values else None


class MemoryModel:
    """Predicts a job's resident memory (all ranks and a spare) from its parameters; learns the heap
    share per local parameter from the runs it sees."""

    def __init__(self, fixed_threshold: bool) -> None:
        self.heap = HEAP_BYTES["fixed" if fixed_threshold else "default"]

    @staticmethod
    def local_params(params: int, setup: str) -> float:
        return params / (2 if setup == "hsdp" else WORLD)  # HSDP 2x2: each rank holds half the model

    def needed(self, params: int, setup: str) -> float:
        per_rank = PROCESS_BYTES + self.local_params(params, setup) * (STATE_BYTES[setup] + self.heap)
        return 1.05 * (WORLD * per_rank + PROCESS_BYTES) + 0.5e9

    def learn(self, run: Run, params: int, setup: str) -> None:
        peak = run.max_rank_rss()
        if peak:
            observed = (peak - PROCESS_BYTES) / self.local_params(params, setup) - STATE_BYTES[setup]
            self.heap = max(self.heap, observed)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM: unwind like Ctrl-C, so that the running job is stopped and the temp dir removed."""
    raise SystemExit(128 + signum)


def launch(run_dir: Path, overrides: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Run:
    """Run ``launch.py`` with ``overrides`` (and ``env`` added to its environment) while sampling its
    processes' memory."""
    cmd = [sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", *COMMON, *overrides]
    run = Run(run_dir.name, run_dir)
    started = time.monotonic()
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    environ = {**os.environ, **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=environ)
    run.rss = RssSampler(proc.pid)
    run.rss.start()
    try:
        last = started
        while proc.poll() is None:
            time.sleep(0.5)
            if time.monotonic() - last > 30:
                last = time.monotonic()
                steps = run.losses() if (run_dir / "losses.jsonl").exists() else []
                done = f"step {steps[-1]['step']}" if steps else "starting"
                progress(f"  {run_dir.name}: {done}, {last - started:.0f} s")
            if time.monotonic() - started > timeout_s:
                run.error = f"no result after {timeout_s:g} s"
                break
    finally:
        _stop_job(proc)
        run.rss.stop()
        log.close()
    run.wall_s = time.monotonic() - started
    if run.error is None and proc.returncode:
        tail = (run_dir.parent / f"{run_dir.name}.log").read_text().splitlines()[-40:]
        print(f"{' '.join(cmd)} failed:\n" + "\n".join(tail), file=sys.stderr)
        gave_up = [line.strip() for line in tail if line.startswith("giving up:")]
        errors = gave_up or [line.strip() for line in tail if "Error" in line or "error" in line]
        why = errors[-1][:160] if errors else "see stderr"
        run.error = f"failed (exit code {proc.returncode}): {why}"
    progress(f"  {run_dir.name}: {'done' if run.error is None else run.error} in {run.wall_s:.0f} s")
    return run


def _stop_job(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the agent (it stops every rank, spare and reader of its job), SIGKILL after 60 s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- measurements ---------------------------------------------------------------------------------


def memory_plan(run: Run) -> Any:
    """``memory_plan.plan_job`` of the run's resolved config: per-rank shard bytes, the mesh, the
    estimated init time."""
    from omegaconf import OmegaConf

    from ckless_lightning.runtime.config import job_config_from_dict
    from ckless_lightning.runtime.memory_plan import plan_job

    container = OmegaConf.to_container(OmegaConf.load(run.run_dir / "config.yaml"), resolve=True)
    assert isinstance(container, dict)
    return plan_job(job_config_from_dict(container))


def the_fault(run: Run) -> FaultRecovery:
    summary = summarize(run.events(), run.losses())
    assert len(summary.faults) == 1, f"{run.run_dir}: expected one fault, got {len(summary.faults)}"
    return summary.faults[0]


def step_time(run: Run) -> float | None:
    return summarize(run.events(), run.losses()).step_time_s


def init_seconds(run: Run) -> dict[int, float]:
    """Generation 0's model init per rank (``model_ready`` with weights="initialized")."""
    return {
        r: e["seconds"] for r, e in run.phases("model_ready", 0).items() if e.get("weights") == "initialized"
    }


def slowest(run: Run, gen: int, start: str, end: str) -> float | None:
    starts, ends = run.phases(start, gen), run.phases(end, gen)
    spans = [ends[r]["t"] - starts[r]["t"] for r in starts.keys() & ends.keys()]
    return max(spans) if spans else None


@dataclass
class Tier4:
    setup: str  # "buddy" or "hsdp"
    fault_step: int
    fault: FaultRecovery
    warm: bool
    spare: (
        float | None
    )  # detection -> the replacement handed rank 1 (its process_start in the new generation)
    model: float | None  # slowest rank's model_ready seconds in the new generation
    restore: float | None  # slowest rank: model_ready -> state_load_done
    first_step: float | None  # slowest rank: data_ready -> first_step_done
    moved_bytes: int
    params: int
    mesh: tuple[int, int]
    planned_init: float  # the memory plan's estimate of the seed-only init per rank
    restore_rank1: float | None  # rank 1: model_ready -> memory_restore (the transfer and the rest)
    transfer_s: float | None  # the library's own transfer time, where memory_restore reports it
    step_s: float | None
    init: dict[int, float]
    rss_steady: dict[int, int | None] = field(default_factory=dict)
    rss_recovery: dict[int, int | None] = field(default_factory=dict)
    rss_after: dict[int, int | None] = field(default_factory=dict)
    restored_step: int | None = None


def analyze_tier4(run: Run, setup: str, fault_step: int) -> Tier4:
    fault = the_fault(run)
    gen = fault.new_gen if fault.new_gen is not None else 1
    started = [e for e in run.of("ranks_started") if e["gen"] == gen]
    warm = bool(started) and all(all(e["warm"]) for e in started)
    handed = run.phases("process_start", gen)
    # Detection -> the spare handed rank 1 (its process_start in the new generation).
    t_detect = fault.t_fault + (fault.detection_s or 0.0)
    spare = max(e["t"] for e in handed.values()) - t_detect if handed else None
    model = run.phases("model_ready", gen)
    loaded = run.phases("state_load_done", gen)
    restore = [loaded[r]["t"] - model[r]["t"] for r in model.keys() & loaded.keys()]
    plan = memory_plan(run)
    restores = {int(e["rank"]): e for e in run.of("memory_restore", gen=gen)}
    restore_rank1 = restores[1]["t"] - model[1]["t"] if 1 in restores and 1 in model else None
    transfer = restores.get(1, {}).get("transfer_s")
    result = Tier4(
        setup=setup,
        fault_step=fault_step,
        fault=fault,
        warm=warm,
        spare=spare,
        model=max((e["seconds"] for e in model.values()), default=None),
        restore=max(restore) if restore else None,
        first_step=slowest(run, gen, "data_ready", "first_step_done"),
        moved_bytes=plan.param_bytes + plan.optim_bytes,  # one shard: params + AdamW moments
        params=plan.num_params,
        mesh=plan.mesh,
        planned_init=plan.init_seconds,
        restore_rank1=restore_rank1,
        transfer_s=transfer,
        step_s=step_time(run),
        init=init_seconds(run),
        restored_step=restores.get(1, {}).get("step"),
    )
    # Memory: steady state = from the end of step 2 (AdamW moments and the first host copies exist)
    # to the fault; the recovery = fault -> the last rank's first step after it; after = the rest.
    assert run.rss is not None
    losses = {int(r["step"]): r["t"] for r in run.losses() if "t" in r}
    steady_from = losses.get(min(2, fault_step - 1), fault.t_fault)
    recovered = fault.t_fault + (fault.total_s or 0.0)
    # Until the last step: not the save at the end of fit (see the note in the memory table).
    last_step = max(losses.values(), default=float("inf"))
    before, after = run.pids(0), run.pids(gen)
    for rank in range(WORLD):
        result.rss_steady[rank] = run.rss.peak(before.get(rank), steady_from, fault.t_fault)
        result.rss_recovery[rank] = run.rss.peak(after.get(rank), fault.t_fault, recovered + 0.05)
        result.rss_after[rank] = run.rss.peak(after.get(rank), recovered + 0.05, last_step + 0.05)
    return result


@dataclass
class Tier0:
    fault: FaultRecovery
    step_s: float | None
    init: dict[int, float]
    first_step: float | None
    rss_steady: int | None  # max over ranks of VmRSS from the end of step 2 to the fault


def analyze_tier0(run: Run) -> Tier0:
    fault = the_fault(run)
    gen = fault.new_gen if fault.new_gen is not None else 1
    losses = {int(r["step"]): r["t"] for r in run.losses() if "t" in r}
    steady_from = losses.get(2, fault.t_fault)
    assert run.rss is not None
    peaks = [run.rss.peak(pid, steady_from, fault.t_fault) for pid in run.pids(0).values()]
    return Tier0(
        fault,
        step_time(run),
        init_seconds(run),
        slowest(run, gen, "data_ready", "first_step_done"),
        max((p for p in peaks if p), default=None),
    )


@dataclass
class Transfer:
    nbytes: int
    p2p_gbps: float | None
    memcpy_gbps: float
    error: str | None = None


def measure_transfer(nbytes: int) -> Transfer:
    """``bench/p2p_transfer.py`` for ``nbytes``: 2 gloo ranks, and a memcpy in this process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from p2p_transfer import measure, measure_memcpy

    try:
        result = measure(nbytes)
        return Transfer(result.nbytes, result.p2p_gbps, result.memcpy_gbps)
    except Exception as err:  # report the memcpy alone; the rest of the tables stand
        return Transfer(nbytes, None, nbytes / measure_memcpy(nbytes) / 1e9, str(err)[:100])


# --- the bench ------------------------------------------------------------------------------------


@dataclass
class SizeResult:
    name: str
    params: int
    tier0: Tier0 | str | None = None
    tier4: Tier4 | str | None = None
    transfer: Transfer | None = None


def estimate_step_s(params: int) -> float:
    """Seconds per step on the 2-core dev machine (4 ranks, 64 tokens each; 2.0 s at 25M, 7.5 s at
    100M), where no tier 0 run measured it."""
    return 0.3 + 7.2e-8 * params


def tier4_fault_step(step_s: float, spare_wait: float) -> int:
    return max(4, 2 + math.ceil(spare_wait / step_s))


def run_size(
    name: str, shape: Shape, args: argparse.Namespace, work: Path, memory: MemoryModel
) -> SizeResult:
    params = shape.num_params()
    result = SizeResult(name, params)
    progress(f"{name}: {params / 1e6:.1f}M parameters")
    env = {"MALLOC_MMAP_THRESHOLD_": str(args.malloc_mmap_threshold)} if args.malloc_mmap_threshold else None
    step_s = None
    if not args.skip_tier0:
        need, free = memory.needed(params, "tier0"), available_bytes()
        if need > free:
            result.tier0 = f"skipped: needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB available now"
        else:
            overrides = [
                *shape.overrides(),
                "tier=0",
                f"checkpoint.every_n_steps={TIER0_FAULT_STEP - 1}",
                f"fault.step={TIER0_FAULT_STEP}",
                f"trainer.max_steps={TIER0_FAULT_STEP + args.steps}",
            ]
            progress(
                f"{name}: tier 0, checkpoint every {TIER0_FAULT_STEP - 1}, fault in step {TIER0_FAULT_STEP} "
                f"(~{need / GIB:.1f} GiB of {free / GIB:.1f} GiB available)"
            )
            run = launch(work / f"{name}-tier0", overrides, args.run_timeout, env)
            result.tier0 = run.error or analyze_tier0(run)
            if isinstance(result.tier0, Tier0):
                step_s = result.tier0.step_s
                memory.learn(run, params, "tier0")
        if isinstance(result.tier0, str):
            progress(f"{name}: tier 0 {result.tier0}")

    free = available_bytes()
    need = {setup: memory.needed(params, setup) for setup in ("buddy", "hsdp")}
    fits = [setup for setup in ("buddy", "hsdp") if need[setup] <= free]
    if not fits:
        result.tier4 = (
            f"skipped: buddy needs ~{need['buddy'] / GIB:.1f} GiB, hsdp ~{need['hsdp'] / GIB:.1f} GiB; "
            f"{free / GIB:.1f} GiB available now"
        )
        progress(f"{name}: tier 4 {result.tier4}")
        return result
    setup = fits[0]
    fault_step = args.fault_step or tier4_fault_step(step_s or estimate_step_s(params), args.spare_wait)
    overrides = [
        *shape.overrides(),
        "tier=4",
        "agent.spares=1",
        "checkpoint.every_n_steps=0",
        f"fault.step={fault_step}",
        f"trainer.max_steps={fault_step + args.steps}",
    ]
    if setup == "buddy":
        overrides.append("replication.source=buddy")
    else:
        overrides += ["cluster.replicate=2", "replication.source=hsdp"]
        progress(
            f"{name}: tier 4 buddy needs ~{need['buddy'] / GIB:.1f} GiB, {free / GIB:.1f} GiB available: "
            "HSDP 2x2 instead"
        )
    progress(
        f"{name}: tier 4 {setup}, warm spare, fault in step {fault_step} "
        f"(~{need[setup] / GIB:.1f} GiB of {free / GIB:.1f} GiB available)"
    )
    run = launch(work / f"{name}-tier4", overrides, args.run_timeout, env)
    result.tier4 = run.error or analyze_tier4(run, setup, fault_step)
    if isinstance(result.tier4, Tier4):
        memory.learn(run, params, setup)
        progress(f"{name}: p2p transfer of {result.tier4.moved_bytes:,} bytes")
        result.transfer = measure_transfer(result.tier4.moved_bytes)
    else:
        progress(f"{name}: tier 4 {result.tier4}")
    return result


# --- printing -------------------------------------------------------------------------------------


def f2(value: float | None, width: int = 7, digits: int = 2) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def mb(value: int | None, width: int = 6) -> str:
    return f"{value / MB:{width}.0f}" if value is not None else f"{'-':>{width}}"


def label(r: SizeResult) -> str:
    hsdp = isinstance(r.tier4, Tier4) and r.tier4.setup == "hsdp"
    return f"{r.name}{' hsdp' if hsdp else ''}"


def table_tier4(results: list[SizeResult]) -> list[str]:
    out = [
        "Tier 4 recovery (buddy source unless marked hsdp: 2 replicas x 2 shards), warm spare, SIGKILL of "
        "rank 1 in the forward of step F; seconds",
        f"{'size':<10}{'params':>8}{'F':>5}{'detect':>8}{'spare':>8}{'comm':>8}{'model':>8}{'restore':>8}"
        f"{'load':>8}{'1st step':>9}{'other':>8}{'total':>8}{'lost':>6}  spare",
    ]
    for r in results:
        t = r.tier4
        if not isinstance(t, Tier4):
            out.append(f"{label(r):<10}{r.params / 1e6:7.1f}M  {t or 'not run'}")
            continue
        f = t.fault
        parts = (f.detection_s, t.spare, f.comm_init_s, f.state_load_s, t.first_step)
        other = f.total_s - sum(p or 0.0 for p in parts) if f.total_s is not None else None
        lost = str(f.steps_lost) if f.steps_lost is not None else "-"
        out.append(
            f"{label(r):<10}{t.params / 1e6:7.1f}M{t.fault_step:>5}{f2(f.detection_s, 8)}{f2(t.spare, 8)}"
            f"{f2(f.comm_init_s, 8)}{f2(t.model, 8)}{f2(t.restore, 8)}{f2(f.state_load_s, 8)}"
            f"{f2(t.first_step, 9)}{f2(other, 8)}{f2(f.total_s, 8)}{lost:>6}  {'warm' if t.warm else 'COLD'}"
        )
    out.append(
        "detect: fault -> a rank leaves the generation; spare: -> the spare handed rank 1; comm: new "
        "process groups; load = model (replaced rank allocates, survivors adopt their live shards) + "
        "restore (the transfer and Lightning's restore); 1st step: first batch -> first completed step; "
        "other: the rest of total (join barrier, gaps); all the slowest rank's."
    )
    return out


def table_transfer(results: list[SizeResult]) -> list[str]:
    out = [
        "State moved to the replaced rank: one shard's params + AdamW moments (memory plan of the run)",
        f"{'size':<10}{'MB':>9}{'restore s':>10}{'GB/s':>7}{'p2p GB/s':>10}{'memcpy GB/s':>12}"
        f"{'restore/memcpy':>15}{'p2p/memcpy':>11}",
    ]
    for r in results:
        t = r.tier4
        if not isinstance(t, Tier4):
            continue
        seconds = t.transfer_s or t.restore_rank1
        gbps = t.moved_bytes / seconds / 1e9 if seconds else None
        x = r.transfer
        p2p = x.p2p_gbps if x else None
        memcpy = x.memcpy_gbps if x else None
        out.append(
            f"{label(r):<10}{t.moved_bytes / MB:9.2f}{f2(seconds, 10, 3)}{f2(gbps, 7, 3)}{f2(p2p, 10, 3)}"
            f"{f2(memcpy, 12)}{f2(gbps / memcpy if gbps and memcpy else None, 15, 4)}"
            f"{f2(p2p / memcpy if p2p and memcpy else None, 11, 4)}"
            + (f"  (p2p: {x.error})" if x and x.error else "")
        )
    transfer_field = any(isinstance(r.tier4, Tier4) and r.tier4.transfer_s for r in results)
    out.append(
        "restore s: "
        + (
            "the transfer time memory_restore reports (rank 1)"
            if transfer_field
            else "rank 1's model_ready -> memory_restore: the state transfer plus the rest of the restore "
            "(optimizer state allocated, reports gathered, loop state, waiting for peers): a lower bound "
            "of the rate"
        )
        + "; p2p: bench/p2p_transfer.py (transfer_tensors, 2 gloo ranks, checksums) of the same bytes; "
        "memcpy: torch copy_ of the same bytes in this process (best of 3)."
    )
    return out


def table_memory(results: list[SizeResult]) -> list[str]:
    out = [
        "VmRSS per rank (MB, sampled every 50 ms): steady before the fault -> peak during the recovery "
        "(x ratio); after = the rest of the run",
        f"{'size':<10}"
        + "".join(f"{f'rank {r}' + (' (new)' if r == 1 else ''):>24}" for r in range(WORLD))
        + f"{'max peak/steady':>17}",
    ]
    for r in results:
        t = r.tier4
        if not isinstance(t, Tier4):
            continue
        cells, ratios = [], []
        for rank in range(WORLD):
            steady, peak, after = t.rss_steady[rank], t.rss_recovery[rank], t.rss_after[rank]
            ratio = peak / steady if peak and steady else None
            if ratio:
                ratios.append(ratio)
            cells.append(f"{mb(steady, 5)}->{mb(peak, 5)} x{f2(ratio, 4)} {mb(after, 5)}".rjust(24))
        out.append(f"{label(r):<10}" + "".join(cells) + f"{f2(max(ratios) if ratios else None, 17)}")
    out.append(
        "each cell: steady -> recovery peak x ratio, then the peak after the recovery up to the last step."
    )
    return out


def table_start(results: list[SizeResult]) -> list[str]:
    out = [
        "First start (generation 0): model init per rank (model_ready, weights initialized; s), median "
        "step (s), steady VmRSS (max over ranks, MB)",
        f"{'size':<10}{'tier 4 init r0 r1 r2 r3':>28}{'t0 init max':>12}{'planned':>9}{'step t4':>9}"
        f"{'step t0':>9}{'RSS t4':>8}{'RSS t0':>8}",
    ]
    for r in results:
        t4 = r.tier4 if isinstance(r.tier4, Tier4) else None
        t0 = r.tier0 if isinstance(r.tier0, Tier0) else None
        init4 = " ".join(f"{t4.init.get(rank, float('nan')):.3f}" for rank in range(WORLD)) if t4 else "-"
        init0 = max(t0.init.values()) if t0 and t0.init else None
        rss4 = max((v for v in t4.rss_steady.values() if v), default=None) if t4 else None
        out.append(
            f"{label(r):<10}{init4:>28}{f2(init0, 12, 3)}{f2(t4.planned_init if t4 else None, 9, 3)}"
            f"{f2(t4.step_s if t4 else None, 9, 3)}{f2(t0.step_s if t0 else None, 9, 3)}"
            f"{mb(rss4, 8)}{mb(t0.rss_steady if t0 else None, 8)}"
        )
    out.append(
        "planned: the memory plan's estimate (a shard's random draws x INIT_NS_PER_ELEMENT); "
        "RSS: from the end of step 2 to the fault."
    )
    return out


def table_tier0(results: list[SizeResult]) -> list[str]:
    out = [
        f"Tier 0: SIGKILL of rank 1 in step {TIER0_FAULT_STEP}, every rank restarted cold, step "
        f"{TIER0_FAULT_STEP - 1} reloaded from disk; seconds",
        f"{'size':<10}{'detect':>8}{'restart':>8}{'imports':>8}{'comm':>8}{'load':>8}{'1st step':>9}"
        f"{'total':>8}{'lost':>6}",
    ]
    for r in results:
        t = r.tier0
        if not isinstance(t, Tier0):
            out.append(f"{r.name:<10}  {t or 'not run'}")
            continue
        f = t.fault
        restart = (f.stop_s or 0.0) + (f.process_start_s or 0.0)
        lost = str(f.steps_lost) if f.steps_lost is not None else "-"
        out.append(
            f"{r.name:<10}{f2(f.detection_s, 8)}{f2(restart, 8)}{f2(f.imports_s, 8)}{f2(f.comm_init_s, 8)}"
            f"{f2(f.state_load_s, 8)}{f2(t.first_step, 9)}{f2(f.total_s, 8)}{lost:>6}"
        )
    return out


def ratios(results: list[SizeResult]) -> list[str]:
    done = [r for r in results if isinstance(r.tier4, Tier4) and r.tier4.fault.state_load_s]
    out = ["Ratios:"]
    by_name = {r.name: r for r in done}
    small, large = by_name.get("1M"), by_name.get("100M")
    if small is None or large is None:
        small, large = (done[0], done[-1]) if len(done) >= 2 else (None, None)
    if small is not None and large is not None and small is not large:
        s, g = small.tier4, large.tier4
        assert isinstance(s, Tier4) and isinstance(g, Tier4)
        load = g.fault.state_load_s / s.fault.state_load_s  # type: ignore[operator]
        restore = g.restore / s.restore if g.restore and s.restore else None
        out.append(
            f"  state load {label(large)} / {label(small)}: {g.fault.state_load_s:.2f} / "
            f"{s.fault.state_load_s:.2f} s = {load:.1f}x (its restore part {f2(restore, 0, 1)}x); "
            f"bytes moved {g.moved_bytes / MB:.1f} / {s.moved_bytes / MB:.2f} MB = "
            f"{g.moved_bytes / s.moved_bytes:.0f}x"
        )
        if s.fault.total_s and g.fault.total_s:
            out.append(
                f"  total recovery {label(large)} / {label(small)}: {g.fault.total_s:.2f} / "
                f"{s.fault.total_s:.2f} s = {g.fault.total_s / s.fault.total_s:.1f}x"
            )
    for r in done:
        t = r.tier4
        assert isinstance(t, Tier4)
        ratio = {
            k: t.rss_recovery[k] / t.rss_steady[k]
            for k in range(WORLD)
            if t.rss_recovery[k] and t.rss_steady[k]
        }  # type: ignore[operator]
        values = list(ratio.values())
        base = r.tier0.fault.total_s if isinstance(r.tier0, Tier0) else None
        vs0 = f"; tier 4 / tier 0 total {t.fault.total_s / base:.2f}" if base and t.fault.total_s else ""
        if values:
            out.append(
                f"  {label(r)}: peak/steady VmRSS during the recovery: max {max(values):.2f}, "
                f"rank 1 (the new process against the old) {f2(ratio.get(1), 0)}{vs0}"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps after the faulted one")
    parser.add_argument("--skip-tier0", action="store_true", help="tier 4 runs only")
    parser.add_argument("--quick", action="store_true", help=f"only {' and '.join(QUICK)} (a few minutes)")
    parser.add_argument(
        "--spare-wait", type=float, default=30.0, help="s after the first step before tier 4's fault"
    )
    parser.add_argument("--fault-step", type=int, default=None, help="tier 4's fault step (else derived)")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="s per launch.py job")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="run the jobs with MALLOC_MMAP_THRESHOLD_=BYTES (glibc: buffers above it are mmapped and "
        "returned on free; e.g. 4194304)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directories (path printed)")
    args = parser.parse_args()
    sizes = [s for s in args.sizes if s in QUICK] if args.quick else args.sizes
    signal.signal(signal.SIGTERM, _exit_on_signal)

    started = time.monotonic()
    results: list[SizeResult] = []
    memory = MemoryModel(fixed_threshold=bool(args.malloc_mmap_threshold))
    tmp = tempfile.mkdtemp(prefix="ckless-scaling-")
    try:
        for name in sizes:
            results.append(run_size(name, SIZES[name], args, Path(tmp), memory))
    finally:
        if args.keep:
            progress(f"run directories kept in {tmp}")
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"Llama 3 shapes on {WORLD} CPU ranks (gloo), seq 64, micro-batch 1, global batch {WORLD}, fp32; "
        f"{os.cpu_count()} cores, {available_bytes() / GIB:.1f} GiB available at the end"
        + (
            f"; jobs ran with MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}."
            if args.malloc_mmap_threshold
            else "."
        )
    )
    for lines in (
        table_tier4(results),
        table_transfer(results),
        table_memory(results),
        table_start(results),
        [] if args.skip_tier0 else table_tier0(results),
        ratios(results),
    ):
        if lines:
            print()
            print("\n".join(lines))
    print(f"\n({time.monotonic() - started:.0f} s for this script.)")


if __name__ == "__main__":
    main()
