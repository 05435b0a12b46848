"""The first-step warm-up (ckless_lightning.replication.warmup): no bit changes, the real mesh, fast.

Each case runs in fresh spawned processes (tests/dist.py), whose DTensor caches are cold as a
replaced rank's are; this pytest process may have warm ones from other tests.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ckless_lightning.recovery.memory import MemoryRestore
from ckless_lightning.replication.warmup import WarmUp, warm_first_step, warm_optimizer_step
from tests.dist import run_ranks

STEPS = 3


def _model(width: int, mesh: object) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(16)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _train(rank: int, world_size: int, warm: bool) -> dict:
    """Two 16-layer FSDP2 models on 2 gloo ranks: AdamW (two groups, foreach, as the built-in module)
    and, of another width (its own cache entries), SGD with momentum; ``warm``: warm both up first.
    Returns the state after ``STEPS`` steps, AdamW's first step's seconds, the warm-up's collectives
    and whether every DTensor is on the real mesh object."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    models = [_model(32, mesh), _model(48, mesh)]
    optimizers = [
        torch.optim.AdamW(_groups(models[0]), lr=1e-2, foreach=True),
        torch.optim.SGD(_groups(models[1]), lr=1e-2, momentum=0.9),
    ]
    comms = None
    warmed = None
    if warm:
        with CommDebugMode() as counter:
            warmed = warm_optimizer_step(optimizers)
        comms = counter.get_total_counts()
    first = 0.0
    for step in range(STEPS):
        for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            width = model[0].in_features
            x = torch.randn(8, width, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x).square().mean().backward()
            start = time.perf_counter()
            optimizer.step()
            if step == 0 and i == 0:
                first = time.perf_counter() - start
            optimizer.zero_grad()
    on_mesh = all(p.device_mesh is mesh for m in models for p in m.parameters()) and all(
        v.device_mesh is mesh
        for o in optimizers
        for s in o.state.values()
        for v in s.values()
        if isinstance(v, DTensor)
    )
    state = {
        f"{i}/{name}/{key}": (value.to_local() if isinstance(value, DTensor) else value).clone()
        for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True))
        for name, param in model.named_parameters()
        for key, value in [("param", param), *sorted(optimizer.state[param].items())]
    }
    return {"state": state, "first_s": first, "comms": comms, "on_mesh": on_mesh, "warmed": warmed}


def _assert_bitwise_equal(cold: dict[str, torch.Tensor], warm: dict[str, torch.Tensor]) -> None:
    assert cold.keys() == warm.keys()
    for key in cold:
        a, b = cold[key].reshape(-1), warm[key].reshape(-1)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key


def test_warm_up_changes_no_bit_keeps_the_real_mesh_and_makes_the_first_step_fast() -> None:
    cold = run_ranks(_train, 2, False)
    warm = run_ranks(_train, 2, True)
    for c, w in zip(cold, warm, strict=True):
        _assert_bitwise_equal(c["state"], w["state"])
        assert w["on_mesh"] and c["on_mesh"]
        assert w["comms"] == 0  # the throwaway steps made no collective
        assert w["warmed"].params == 64 and w["warmed"].skipped == ()
    # The cold first step pays DTensor's sharding propagation; the warmed one finds it cached.
    # Wide margin (measured 30-80x on 2 cores): only the ratio, no wall-clock bound.
    cold_s = max(c["first_s"] for c in cold)
    warm_s = max(w["first_s"] for w in warm)
    assert cold_s > 3 * warm_s, (cold_s, warm_s)


def _clip_hsdp(rank: int, world_size: int, warm: bool) -> dict:
    """HSDP 2x2 (4 gloo ranks), AdamW in two groups, each step's gradients clipped as Lightning clips
    them (``clip_grad_norm_`` over the optimizer's parameters, max norm 0.01: every step scales);
    ``warm``: :func:`warm_first_step` first, under a dispatch mode that records every collective and
    the devices of its tensors. Returns the state after ``STEPS`` steps, the first clipping's seconds
    and what the warm-up did."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, set[str]]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor's own dispatch; its local ops come back here
            if func.namespace in ("_c10d_functional", "c10d", "c10d_functional"):
                flat = [*args, *(kwargs or {}).values()]
                tensors = [t for a in flat for t in (a if isinstance(a, (list, tuple)) else [a])]
                devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
                self.seen.append((str(func), devices))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model(32, mesh)
    optimizer = torch.optim.AdamW(_groups(model), lr=1e-2, foreach=True)
    warmed, collectives = None, None
    if warm:
        with Collectives() as recorder:
            warmed = warm_first_step([optimizer], 0.01)
        collectives = recorder.seen
    first = 0.0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for step in range(STEPS):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).square().mean().backward()
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 0.01)
        if step == 0:
            first = time.perf_counter() - start
        optimizer.step()
        optimizer.zero_grad()
    state = {
        f"{name}/{key}": (value.to_local() if isinstance(value, DTensor) else value).clone()
        for name, param in model.named_parameters()
        for key, value in [("param", param), *sorted(optimizer.state[param].items())]
    }
    on_mesh = all(p.device_mesh is mesh for p in model.parameters())
    return {
        "state": state,
        "first_s": first,
        "warmed": warmed,
        "collectives": collectives,
        "on_mesh": on_mesh,
    }


def test_the_clipping_warm_up_on_a_2d_mesh_changes_no_bit_reaches_no_process_group_and_is_fast() -> None:
    cold = run_ranks(_clip_hsdp, 4, False)
    warm = run_ranks(_clip_hsdp, 4, True)
    for c, w in zip(cold, warm, strict=True):
        _assert_bitwise_equal(c["state"], w["state"])
        assert w["on_mesh"]
        assert w["warmed"].clipped == 32 and w["warmed"].params == 32 and w["warmed"].skipped == ()
        # The total norm's reduction ran, on meta tensors only: torch's meta kernel, no process group.
        assert w["collectives"], "the throwaway clipping reduced no norm: not the real path"
        assert all(devices == {"meta"} for _, devices in w["collectives"]), w["collectives"]
    # Cold, the first clipping pays the norms' sharding propagation (0.3 s here); warmed, it finds it
    # cached (0.01 s). Wide margin: only the ratio, no wall-clock bound.
    cold_s = max(c["first_s"] for c in cold)
    warm_s = max(w["first_s"] for w in warm)
    assert cold_s > 3 * warm_s, (cold_s, warm_s)


def test_an_optimizer_not_known_to_be_elementwise_is_skipped_not_stepped() -> None:
    class Counting(torch.optim.SGD):
        steps = 0

        def step(self, closure=None):
            Counting.steps += 1
            return super().step(closure)

    param = nn.Parameter(torch.zeros(3))
    done = warm_optimizer_step([Counting([param], lr=0.1)])
    assert done.params == 0 and Counting.steps == 0
    assert "Counting is not known to step without collectives" in done.skipped[0]
    plain = warm_optimizer_step([torch.optim.SGD([param], lr=0.1)])  # not a DTensor: skipped
    assert plain.params == 0 and "not a Shard/Replicate DTensor" in plain.skipped[0]


def test_a_failed_transfer_beside_the_warm_up_raises_on_the_training_thread(monkeypatch) -> None:
    restore = MemoryRestore.__new__(MemoryRestore)
    restore.events = None
    restore.warmed = None
    announced: list[str] = []
    restore.on_transfer = lambda: announced.append(threading.current_thread().name)

    def fails(plan, rank, tensors):
        raise RuntimeError("peer gone")

    monkeypatch.setattr(restore, "_transfer", fails)
    with pytest.raises(RuntimeError, match="peer gone"):
        restore._receive_warming(SimpleNamespace(transfers=[object()]), 0, [], [])  # type: ignore[arg-type]
    assert isinstance(restore.warmed, WarmUp)
    assert announced == [threading.current_thread().name]  # the fault hook ran on the training thread
