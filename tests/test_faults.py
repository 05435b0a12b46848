"""Fault plans, once-only claims, and the injection callback's phase semantics in a real Lightning run."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import psutil
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from ckless_lightning.runtime.faults import (
    PHASES,
    STEP_PHASES,
    FaultConfig,
    FaultSpec,
    claim_fault,
    marker_path,
    plan_faults,
)
from ckless_lightning.training.callbacks.fault_injection import FaultInjectionCallback, InjectedFault

SHAPE = {"world_size": 8, "nnodes": 2, "nproc_per_node": 4, "max_steps": 100}

# -- config validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"type": "explode"},
            r"fault\.type must be one of none \| kill .* reader_stall \| slot_lost, got 'explode'",
        ),
        ({"phase": "loss"}, r"fault\.phase must be one of data \| forward \| backward"),
        ({"injected_by": "agent"}, r"fault\.injected_by must be one of inside \| outside"),
        ({"type": "exception", "injected_by": "outside"}, r"exception cannot be injected from outside"),
        ({"type": "stall", "injected_by": "outside"}, r"stall cannot be injected from outside"),
        ({"type": "device_error", "injected_by": "outside"}, r"device_error cannot be injected from outside"),
        ({"type": "random", "injected_by": "outside"}, r"fault\.types contains exception.*outside"),
        ({"step": 0}, r"fault\.step .* must be >= 1"),
        ({"mtbf_steps": 0}, r"fault\.mtbf_steps must be > 0"),
        ({"types": ["kill", "node_loss"]}, r"fault\.types may only contain .*fault=node_loss"),
        ({"type": "chaos", "mtbf_s": 0}, r"fault\.mtbf_s .* must be > 0"),
        ({"type": "chaos", "targets": ["agent"]}, r"fault\.targets must be .* rank \| spare \| reader"),
        ({"type": "chaos", "signals": []}, r"fault\.signals must be a non-empty list of kill \| stop"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FaultConfig(**kwargs)


def test_config_accepts_outside_kill_and_random_without_exception() -> None:
    FaultConfig(type="kill", injected_by="outside")
    FaultConfig(type="random", injected_by="outside", types=["kill", "hang"])


@pytest.mark.parametrize(
    ("kwargs", "shape", "match"),
    [
        (
            {"type": "kill", "rank": 4},
            (4, 1, 4, 20),
            r"fault\.rank=4 is outside 0\.\.3: the world size is 4 "
            r"\(cluster\.nnodes=1 x cluster\.nproc_per_node=4\)",
        ),
        ({"type": "hang", "rank": -1}, (4, 1, 4, 20), r"fault\.rank=-1 is outside"),
        (
            {"type": "kill", "step": 21},
            (4, 1, 4, 20),
            r"fault\.step=21 is beyond trainer\.max_steps=20, so it would never fire",
        ),
        (
            {"type": "node_loss", "node": 0},
            (4, 1, 4, 20),
            r"a node loss needs cluster\.nnodes >= 2; on one node use fault=kill",
        ),
        (
            {"type": "node_loss", "node": 2},
            (8, 2, 4, 20),
            r"fault\.node=2 is outside 0\.\.1 \(cluster\.nnodes=2\)",
        ),
    ],
)
def test_validate_against_job_shape(kwargs: dict[str, Any], shape: tuple[int, ...], match: str) -> None:
    cfg = FaultConfig(**kwargs)
    world, nnodes, nproc, max_steps = shape
    with pytest.raises(ValueError, match=match):
        cfg.validate_against(world_size=world, nnodes=nnodes, nproc_per_node=nproc, max_steps=max_steps)
    with pytest.raises(ValueError, match=match):  # plan_faults validates too
        plan_faults(cfg, world_size=world, nnodes=nnodes, nproc_per_node=nproc, max_steps=max_steps)


def test_hydra_fault_groups_compose(compose) -> None:
    for name in ("none", "kill", "hang", "stall", "exception", "node_loss", "random"):
        section = compose(f"fault={name}", "fault.rank=2", "fault.step=20")["fault"]
        cfg = FaultConfig(**section)
        assert (cfg.type, cfg.rank, cfg.step) == (name, 2, 20)
    # The default recipe carries a demo fault (conf/demo_fault/llama3_tiny.yaml); other recipes none.
    demo = FaultConfig(**compose()["fault"])
    assert (demo.type, demo.rank, demo.step) == ("kill", 1, 25)
    assert FaultConfig(**compose("fault=none")["fault"]).type == "none"
    assert FaultConfig(**compose("recipe=llama3_8b")["fault"]).type == "none"


# -- plans -----------------------------------------------------------------------------------------------


def test_plan_none_and_targeted() -> None:
    assert plan_faults(FaultConfig(), **SHAPE) == []
    cfg = FaultConfig(type="hang", rank=5, step=7, phase="backward", injected_by="outside")
    assert plan_faults(cfg, **SHAPE) == [
        FaultSpec(index=0, fault_type="hang", rank=5, step=7, phase="backward", injected_by="outside")
    ]


def test_plan_node_loss_targets_first_rank_of_node() -> None:
    (spec,) = plan_faults(FaultConfig(type="node_loss", node=1, step=3), **SHAPE)
    assert (spec.fault_type, spec.rank, spec.node, spec.step) == ("node_loss", 4, 1, 3)
    shape = {**SHAPE, "world_size": 12, "nnodes": 3}
    (spec,) = plan_faults(FaultConfig(type="node_loss", node=2), **shape)
    assert (spec.rank, spec.node) == (8, 2)


def test_plan_random_is_deterministic_and_bounded() -> None:
    cfg = FaultConfig(type="random", mtbf_steps=10, seed=3, max_faults=5)
    plan = plan_faults(cfg, **SHAPE)
    assert plan == plan_faults(FaultConfig(type="random", mtbf_steps=10, seed=3, max_faults=5), **SHAPE)
    assert plan != plan_faults(FaultConfig(type="random", mtbf_steps=10, seed=4, max_faults=5), **SHAPE)
    assert 1 <= len(plan) <= 5
    steps = [s.step for s in plan]
    assert steps == sorted(set(steps)) and all(1 <= s <= 100 for s in steps)  # one fault per step at most
    assert [s.index for s in plan] == list(range(len(plan)))
    for spec in plan:
        assert 0 <= spec.rank < 8 and spec.phase in STEP_PHASES and spec.fault_type in cfg.types
        assert spec.node is None and spec.injected_by == "inside"

    # Over many seeds: bounds hold, every rank/phase/type shows up, gaps average about mtbf_steps.
    gaps, ranks, phases, types = [], set(), set(), set()
    for seed in range(200):
        plan = plan_faults(FaultConfig(type="random", mtbf_steps=10, seed=seed, max_faults=3), **SHAPE)
        assert len(plan) <= 3 and all(1 <= s.step <= 100 for s in plan)
        gaps.extend(b.step - a.step for a, b in itertools.pairwise(plan))
        ranks |= {s.rank for s in plan}
        phases |= {s.phase for s in plan}
        types |= {s.fault_type for s in plan}
    assert ranks == set(range(8)) and phases == set(STEP_PHASES) and types == {"kill", "exception", "hang"}
    assert min(gaps) >= 1 and 8 < sum(gaps) / len(gaps) < 13  # ceil(Exp(10)) has mean ~10.5

    short = plan_faults(FaultConfig(type="random", mtbf_steps=1000, seed=0), **{**SHAPE, "max_steps": 3})
    assert all(s.step <= 3 for s in short)  # usually empty: the first arrival is beyond max_steps


# -- once-only claims ------------------------------------------------------------------------------------


def _claim_worker(marker_dir: str, barrier: Any, results: Any) -> None:
    spec = FaultSpec(index=7, fault_type="kill", rank=0, step=1, phase="data", injected_by="inside")
    barrier.wait()
    results.put((os.getpid(), claim_fault(Path(marker_dir), spec)))


def test_claim_fault_has_exactly_one_winner_across_processes(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")  # the worker needs neither torch nor Lightning
    barrier, results = ctx.Barrier(8), ctx.Queue()
    marker_dir = tmp_path / "markers" / "not-yet-created"
    procs = [ctx.Process(target=_claim_worker, args=(str(marker_dir), barrier, results)) for _ in range(8)]
    try:
        for proc in procs:
            proc.start()
        outcomes = [results.get(timeout=30) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    winners = [pid for pid, won in outcomes if won]
    assert len(winners) == 1
    spec = FaultSpec(index=7, fault_type="kill", rank=0, step=1, phase="data", injected_by="inside")
    assert marker_path(marker_dir, spec).exists()
    assert f"pid={winners[0]}" in marker_path(marker_dir, spec).read_text()
    assert not claim_fault(marker_dir, spec)


# -- the callback in a real (single-process) Lightning run ----------------------------------------------


class TinyModule(pl.LightningModule):
    """Linear regression that records, per optimizer step (global_step), what ran."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.training_steps: list[int] = []  # global_step at each training_step entry
        self.forwards: list[int] = []  # global_step at each forward body
        self.backwards: list[int] = []  # global_step at each on_before_backward
        self.params_before: dict[int, list[torch.Tensor]] = {}  # step N -> params before step N

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards.append(self.trainer.global_step)
        return self.layer(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.training_steps.append(self.trainer.global_step)
        x, y = batch
        return F.mse_loss(self(x), y)

    @override
    def on_train_start(self) -> None:
        self.params_before[1] = self._params()

    @override
    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.backwards.append(self.trainer.global_step)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.params_before[self.trainer.global_step + 1] = self._params()

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.1)

    @override
    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 4, generator=gen), torch.randn(64, 1, generator=gen))
        return DataLoader(data, batch_size=4)

    def _params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.parameters()]

    def adam_steps(self) -> int:
        state = self.trainer.optimizers[0].state
        steps = {int(state[p]["step"]) if p in state else 0 for p in self.parameters()}
        assert len(steps) == 1, steps
        return steps.pop()

    def params_equal(self, ref: list[torch.Tensor]) -> bool:
        return all(torch.equal(p.detach(), r) for p, r in zip(self.parameters(), ref, strict=True))


def _run(spec: FaultSpec, marker_dir: Path, accumulate: int = 1) -> tuple[TinyModule, pl.Trainer, list]:
    injected: list[FaultSpec] = []
    callback = FaultInjectionCallback([spec], rank=0, marker_dir=marker_dir, on_inject=injected.append)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    module = TinyModule()
    try:
        trainer.fit(module)
    except InjectedFault as err:
        assert err.spec == spec
        assert f"rank 0 at optimizer step {spec.step}, phase {spec.phase}" in str(err)
        injected.append("raised")  # type: ignore[arg-type]
    assert not callback._optimizer_handles and callback._forward_handle is None  # hooks removed
    return module, trainer, injected


# "commit" (after the vote) needs CheckpointlessStrategy, which runs the closure before the real
# optimizer.step(); "recovery", "comm_init" and "transfer" need the in-process loop: covered end to
# end (test_tier3.py, test_tier4.py).
@pytest.mark.parametrize(
    "phase", [p for p in PHASES if p not in ("commit", "recovery", "comm_init", "transfer")]
)
def test_exception_fires_in_phase_once(tmp_path: Path, phase: str) -> None:
    spec = FaultSpec(index=0, fault_type="exception", rank=0, step=3, phase=phase, injected_by="inside")
    module, trainer, injected = _run(spec, tmp_path)
    assert injected == [spec, "raised"]
    assert trainer.global_step == 2  # step 3 never completed
    assert marker_path(tmp_path, spec).exists()
    grads = [p.grad for p in module.parameters()]
    started = module.training_steps.count(2) == 1
    forwarded = module.forwards.count(2) == 1
    backward_started = module.backwards.count(2) == 1
    if phase == "data":
        assert (started, forwarded, backward_started) == (False, False, False)
        assert module.adam_steps() == 2 and module.params_equal(module.params_before[3])
    elif phase == "forward":
        assert (started, forwarded, backward_started) == (True, False, False)
        assert module.adam_steps() == 2 and module.params_equal(module.params_before[3])
    elif phase == "backward":
        assert (started, forwarded, backward_started) == (True, True, True)
        assert all(g is None for g in grads)  # zeroed for step 3, none computed yet
        assert module.adam_steps() == 2 and module.params_equal(module.params_before[3])
    elif phase == "grad_reduction":
        assert (started, forwarded, backward_started) == (True, True, True)
        assert all(g is not None and g.abs().sum() > 0 for g in grads)
        assert module.adam_steps() == 2 and module.params_equal(module.params_before[3])
    else:
        assert phase == "optimizer"
        assert (started, forwarded, backward_started) == (True, True, True)
        assert module.adam_steps() == 3 and not module.params_equal(module.params_before[3])

    # A restart passes step 3 again with the same marker dir: no second fault.
    module, trainer, injected = _run(spec, tmp_path)
    assert injected == [] and trainer.global_step == 6 and module.adam_steps() == 6


def test_fault_fires_on_last_micro_batch_with_accumulation(tmp_path: Path) -> None:
    spec = FaultSpec(index=0, fault_type="exception", rank=0, step=3, phase="forward", injected_by="inside")
    module, trainer, injected = _run(spec, tmp_path, accumulate=2)
    assert injected == [spec, "raised"] and trainer.global_step == 2
    assert module.training_steps.count(2) == 2 and module.forwards.count(2) == 1  # 2nd micro-batch's forward


def test_callback_ignores_other_ranks_and_outside_faults(tmp_path: Path) -> None:
    specs = [
        FaultSpec(index=0, fault_type="exception", rank=1, step=2, phase="data", injected_by="inside"),
        FaultSpec(index=1, fault_type="kill", rank=0, step=2, phase="data", injected_by="outside"),
    ]
    callback = FaultInjectionCallback(specs, rank=0, marker_dir=tmp_path)
    assert callback.specs == []
    node_loss = FaultSpec(
        index=0, fault_type="node_loss", rank=4, step=2, phase="data", injected_by="inside", node=1
    )
    with pytest.raises(ValueError, match="node_agent_pid is None"):
        FaultInjectionCallback([node_loss], rank=4, marker_dir=tmp_path)
    FaultInjectionCallback([node_loss], rank=3, marker_dir=tmp_path)  # not this rank's fault


# -- kill and hang in a subprocess -----------------------------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import lightning.pytorch as pl

    sys.path.insert(0, {tests!r})
    from test_faults import TinyModule
    from ckless_lightning.training.callbacks.fault_injection import FaultInjectionCallback
    from ckless_lightning.runtime.faults import FaultSpec

    fault_type, phase, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    spec = FaultSpec(index=0, fault_type=fault_type, rank=0, step=3, phase=phase, injected_by="inside")

    def on_inject(spec):
        with open(out / "events.txt", "a") as f:
            f.write(f"fault_injected {{spec.fault_type}} {{spec.step}}\\n")

    callback = FaultInjectionCallback([spec], rank=0, marker_dir=out / "markers", on_inject=on_inject)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(TinyModule())
    print("finished", trainer.global_step, flush=True)
    """
)


def _start(tmp_path: Path, fault_type: str, phase: str) -> subprocess.Popen[str]:
    script = tmp_path / "run_fault.py"
    script.write_text(SCRIPT.format(tests=str(ROOT / "tests")))
    return subprocess.Popen(
        [sys.executable, str(script), fault_type, phase, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out


def test_kill_sigkills_the_rank_after_recording_the_event(tmp_path: Path) -> None:
    proc = _start(tmp_path, "kill", "backward")
    try:
        proc.wait(timeout=120)
    finally:
        out = _stop(proc)
    assert proc.returncode == -signal.SIGKILL, out
    assert (tmp_path / "events.txt").read_text() == "fault_injected kill 3\n"
    assert (tmp_path / "markers" / "fault-0.fired").exists()

    # The restarted rank passes step 3 again and finishes.
    proc = _start(tmp_path, "kill", "backward")
    try:
        proc.wait(timeout=120)
    finally:
        out = _stop(proc)
    assert proc.returncode == 0 and "finished 6" in out, out
    assert (tmp_path / "events.txt").read_text() == "fault_injected kill 3\n"


def test_hang_stops_the_rank(tmp_path: Path) -> None:
    proc = _start(tmp_path, "hang", "grad_reduction")
    try:
        status, deadline = None, time.monotonic() + 30  # includes importing torch + Lightning (~3 s)
        while time.monotonic() < deadline and proc.poll() is None:
            status = psutil.Process(proc.pid).status()
            if status == psutil.STATUS_STOPPED:
                break
            time.sleep(0.1)
        assert status == psutil.STATUS_STOPPED, (status, proc.poll())
        assert (tmp_path / "events.txt").read_text() == "fault_injected hang 3\n"
        time.sleep(0.5)
        assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED  # no progress
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        _stop(proc)


@pytest.mark.timeout(60)
def test_chaos_hits_live_processes_of_every_target_kind_seeded(tmp_path: Path) -> None:
    """The chaos injector fires at its drawn times only, hits only the live processes it is shown,
    with the drawn signal, at most ``max_faults`` times; the same seed draws the same sequence."""
    from ckless_lightning.record.events import EventLog, read_events
    from ckless_lightning.runtime.outside_faults import ChaosInjector

    def draws(seed: int, log: Path) -> list[tuple[str, str]]:
        children = {k: subprocess.Popen(["sleep", "60"]) for k in ("rank", "spare", "reader")}
        try:
            chaos = ChaosInjector(
                FaultConfig(type="chaos", mtbf_s=0.01, max_faults=4, seed=seed), 0, EventLog(log, source="t")
            )
            processes = {"rank": {3: children["rank"].pid}, "spare": {}, "reader": {}}
            for kind in ("spare", "reader"):
                processes[kind] = {children[kind].pid: children[kind].pid}

            def settled(pid: int) -> bool:
                return psutil.Process(pid).status() in ("stopped", "zombie")

            deadline = time.monotonic() + 20
            while chaos.left and time.monotonic() < deadline:
                live = {k: {i: p for i, p in m.items() if not settled(p)} for k, m in processes.items()}
                if not any(live.values()):
                    break  # every process was hit: later arrivals have nothing to hit
                before = chaos.left
                chaos.inject_due(0, live, {})
                if chaos.left < before:
                    # A signal is delivered asynchronously: let the hit process reach its state before
                    # the next arrival looks, so that both runs offer the same candidates each time.
                    pid = read_events(log)[-1]["pid"]
                    while not settled(pid) and time.monotonic() < deadline:
                        time.sleep(0.001)
                time.sleep(0.002)
            for kind, proc in children.items():  # what was hit is stopped or dead; the rest runs
                status = "dead" if proc.poll() is not None else psutil.Process(proc.pid).status()
                hit = [e for e in read_events(log) if e.get("target", "rank") == kind]
                assert (status == "running" or status == "sleeping") == (not hit), (kind, status, hit)
        finally:
            for proc in children.values():
                proc.kill()
                proc.wait()
        events = read_events(log)
        assert len(events) <= 4
        return [(e.get("target", "rank"), e.get("signal", e.get("fault_type"))) for e in events]

    first = draws(7, tmp_path / "a.jsonl")
    assert first == draws(7, tmp_path / "b.jsonl")
    assert first, "nothing was hit"
