"""The GPU path, right by construction and tested on CPU: a rank's state spans devices (Adam keeps
``step`` on the CPU beside CUDA shards), NCCL survivors are freed, every wait is bounded, a rank
waiting on its device is not blamed for a hang, and a rank's own accelerator error ends it.

Where torch has a second device on CPU (``meta``), the test puts state there; where code sums or
copies on a device, the device branch runs on CPU tensors (``host_bytes`` made to decline them);
where the condition is an accelerator's (a CUDA error, an NCCL backend), its error type or backend
name is injected. ``pytest -k "device or cuda or accelerator or nccl"`` selects these.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ckless_lightning.agent.processes import reap
from ckless_lightning.recovery import sever
from ckless_lightning.recovery.digest import StateDigest
from ckless_lightning.recovery.where import WhereReporter, where_is
from ckless_lightning.replication import BucketLayout, SnapshotCopies
from ckless_lightning.replication import fingerprint as fingerprint_module
from ckless_lightning.replication.fingerprint import TensorSums, tensors_fingerprint
from ckless_lightning.replication.snapshots import FlatBuffer, _Exchange
from ckless_lightning.runtime.contract import ExitCode, is_device_fault, is_peer_failure
from ckless_lightning.training.strategy import _CommitThenStep


def _adam_like_state(device: str) -> list[torch.Tensor]:
    """A parameter shard and its AdamW state as torch keeps it: moments beside the shard on
    ``device``, the ``step`` counter on the CPU (``foreach`` AdamW, neither fused nor capturable)."""
    shard = torch.zeros(64, 8, device=device)
    return [shard, torch.tensor(3.0), torch.zeros_like(shard), torch.zeros_like(shard)]


def test_device_bucket_layout_and_host_copies_take_state_that_spans_devices():
    """Finding 1: a transfer's layout (and a buddy's host slot) is made from state on two devices
    (meta stands for CUDA); the layout depends on shapes and dtypes only."""
    spanning = _adam_like_state("meta")
    on_cpu = _adam_like_state("cpu")
    layout = BucketLayout(spanning, bucket_bytes=4096)
    assert layout.signature == BucketLayout(on_cpu, bucket_bytes=4096).signature
    assert layout.num_buckets == BucketLayout(on_cpu, bucket_bytes=4096).num_buckets
    slot = FlatBuffer(spanning, tail_bytes=64)
    assert slot.matches(on_cpu) and all(v.device.type == "cpu" for v in slot.views)


def test_device_sums_taken_where_tensors_live_equal_the_host_ones(monkeypatch):
    """Finding 2: the fingerprint and the HSDP digest of state summed partly on the host (numpy) and
    partly where it lives (torch, one device-to-host copy per device) are those of the host sums."""
    state = [*_adam_like_state("cpu"), torch.randn(33, 5), torch.randn(7).to(torch.bfloat16)]
    for t in state:
        t.add_(torch.randn_like(t.float()).to(t.dtype))
    digest = StateDigest(4)
    host = (tensors_fingerprint(state), [digest.of(state, part) for part in range(4)])
    on_device = {id(t) for t in state[::2]}  # every other tensor takes the device branch
    real = fingerprint_module.host_bytes
    monkeypatch.setattr(fingerprint_module, "host_bytes", lambda t: None if id(t) in on_device else real(t))
    from ckless_lightning.recovery import digest as digest_module

    monkeypatch.setattr(digest_module, "host_bytes", lambda t: None)  # all of it on the "device"
    split = StateDigest(4)
    assert (TensorSums(state).fingerprint(), [split.of(state, part) for part in range(4)]) == host


def test_nccl_fail_fast_aborts_the_nccl_groups_and_severs_the_gloo_side_group(monkeypatch):
    """Finding 3: on NCCL the default group is aborted and this process's TCP connections (the
    buddy exchanges' gloo group among them) are cut too: gloo's abort does nothing in torch 2.13."""
    calls: list[str] = []
    monkeypatch.setattr(sever.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sever.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(sever, "_abort_nccl", lambda: calls.append("abort"))
    monkeypatch.setattr(sever, "sever_connections", lambda keep_ports: calls.append("sever") or 0)
    sever.fail_fast(keep_ports={1234})
    assert calls == ["abort", "sever"]


def test_nccl_buddy_exchange_waits_are_bounded():
    """Finding 3: the buddy exchange's wait has a bound (the generation's collective timeout) also
    when the caller gives none, and a wait that runs out leaves the held copy incomplete."""
    seen: list[timedelta | None] = []

    class Work:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def wait(self, timeout: timedelta | None = None) -> bool:
            seen.append(timeout)
            if self.fail:
                raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
            return True

    copies = SnapshotCopies(rank=0, world_size=2, source="buddy", wait_timeout_s=3.0)
    held = SimpleNamespace(complete=False)
    copies._pending = _Exchange([Work(False)], held, 1)  # type: ignore[arg-type]
    assert copies.settle() and held.complete
    copies._pending = _Exchange([Work(True)], held, 2)  # type: ignore[arg-type]
    assert not copies.settle() and not held.complete
    assert seen == [timedelta(seconds=3.0)] * 2


def test_nccl_buddy_exchange_groups_are_gloo_pairs_with_the_generation_timeout(monkeypatch):
    """Finding 3: the side groups for host copies are gloo (NCCL cannot send CPU tensors) with the
    generation's collective timeout, not gloo's 30-minute default, formed on the generation's
    bounded store namespace: one pair group to the buddy and one from the ward."""
    from ckless_lightning.recovery import memory

    made: list = []

    def form(store, **kwargs):
        made.append((store, kwargs))
        return "links"

    monkeypatch.setattr(memory, "form_buddy_links", form)
    namespaces: list = []
    job_store = SimpleNamespace(
        process_group_store=lambda gen, init_timeout_s: namespaces.append((gen, init_timeout_s)) or "ns"
    )
    generation = SimpleNamespace(pg_timeout_s=42.0, store=job_store, number=3, init_timeout_s=7.0)
    copies = SnapshotCopies(rank=1, world_size=4, source="buddy", buddy_offset=2)
    restore = memory.MemoryRestore(copies, generation, checkpoint_dir=None, bucket_bytes=1 << 20)  # type: ignore[arg-type]
    restore.attach()
    assert namespaces == [(3, 7.0)]
    assert made == [("ns", {"rank": 1, "world_size": 4, "offset": 2, "timeout": timedelta(seconds=42.0)})]
    assert copies.links == "links" and copies.wait_timeout_s == 42.0


def test_device_wait_is_reported_as_device_and_blamed_after_a_running_rank():
    """Finding 4: a rank whose main thread waits in torch.cuda (a stream or event synchronize), or
    is in its own code while its device has unfinished work (``.item()`` behind a hung NCCL
    kernel), reports ``device``, which the agent blames after ``running`` and ``data``."""
    frame = SimpleNamespace(f_code=SimpleNamespace(co_filename="/x/site-packages/torch/cuda/streams.py"))
    assert where_is(frame) == "device"  # type: ignore[arg-type]
    own = SimpleNamespace(f_code=SimpleNamespace(co_filename="/x/site-packages/lightning/loop.py"))
    assert where_is(own) == "running"  # type: ignore[arg-type]
    assert where_is(own, device_busy=True) == "device"  # type: ignore[arg-type]
    reporter = WhereReporter(None, 0, device_busy=lambda: True)  # type: ignore[arg-type]
    sampled: list[str] = []
    sampler = threading.Thread(target=lambda: sampled.append(reporter.sample()))
    sampler.start()
    sampler.join()  # the main thread waits in threading.py: "running", but its device is busy
    assert sampled == ["device"]
    from ckless_lightning.agent.policies import BLAME_ORDER

    assert BLAME_ORDER["running"] < BLAME_ORDER["data"] < BLAME_ORDER["device"] <= BLAME_ORDER["peers"]


def test_device_reaping_a_process_that_does_not_die_is_bounded():
    """Finding 4: a process the agent SIGKILLed but that stays (state D, stuck in the driver) is
    waited for a bounded time and reported, never for ever."""

    class StuckInDriver:
        pid = 4242

        def wait(self, timeout: float | None = None) -> int:
            assert timeout is not None, "an unbounded wait"
            time.sleep(timeout)
            raise subprocess.TimeoutExpired("rank", timeout)

    start = time.monotonic()
    assert reap(StuckInDriver(), "rank 3", timeout_s=0.2) is False  # type: ignore[arg-type]
    assert time.monotonic() - start < 5
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.send_signal(signal.SIGKILL)
    assert reap(child, "a child", timeout_s=10) is True and child.returncode == -signal.SIGKILL


def test_cuda_vote_comes_after_the_device_finished_the_step():
    """Finding 5: "every rank voted" must mean every rank's gradients are reduced, not that its
    reduce-scatter was queued: the device is synchronized between the closure and the vote."""
    order: list[str] = []
    optimizer = SimpleNamespace(step=lambda **kwargs: order.append("update"))
    stand_in = _CommitThenStep(
        optimizer,  # type: ignore[arg-type]
        lambda: order.append("vote"),
        wait_for_device=lambda: order.append("device synchronized"),
    )
    stand_in.step(lambda: order.append("forward and backward"))
    assert order == ["forward and backward", "device synchronized", "vote", "update"]


@pytest.mark.parametrize(
    ("error", "device", "peer"),
    [
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True, False),
        (RuntimeError("CUDA error: uncorrectable ECC error encountered"), True, False),
        (dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled cuda error"), True, False),
        (dist.DistBackendError("[Gloo] Connection closed by peer [127.0.0.1]:1234"), False, True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False, False),
        (ValueError("a bug in the user's module"), False, False),
    ],
)
def test_accelerator_error_of_the_rank_itself_is_not_a_peers_failure(error, device, peer):
    """Finding 6: a rank's own CUDA error (illegal address, ECC, NCCL reporting a CUDA error) is
    its own fault and poisons its CUDA context; a peer's loss is not; out-of-memory is neither."""
    assert (is_device_fault(error), is_peer_failure(error)) == (device, peer)
    wrapped = RuntimeError("in a callback")
    wrapped.__cause__ = error
    assert is_device_fault(wrapped) == device


def test_accelerator_error_exit_code_names_it():
    from ckless_lightning.record.faults import how_it_ended

    assert ExitCode.DEVICE_FAULT == 7
    assert how_it_ended(7) == "exited with code 7 (its accelerator failed)"


def test_device_fault_exit_is_bounded_when_the_abort_hangs(monkeypatch):
    """Finding 6: a rank whose CUDA context is poisoned exits even if aborting its communicators
    hangs (the abort runs in a thread with a bound)."""
    from ckless_lightning.recovery import device_fault

    hung = threading.Event()
    monkeypatch.setattr(device_fault, "fail_fast", lambda keep_ports: hung.wait(30))
    exits: list[int] = []
    monkeypatch.setattr(device_fault.os, "_exit", lambda code: exits.append(code))
    start = time.monotonic()
    device_fault.exit_on_device_fault(RuntimeError("CUDA error: x"), rank=2, keep_ports=set(), abort_s=0.2)
    assert exits == [ExitCode.DEVICE_FAULT] and time.monotonic() - start < 5
    hung.set()


def test_device_gpu_check_record_and_restore_logic_runs_on_cpu():
    """``bench/gpu_check.py``'s record / restore / digest checks, on the CPU (its state then spans
    one device): the script's own logic is tested here; a GPU run checks the devices."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    gpu_check.check_record_restore_digest(4, torch.device("cpu"))
    assert not gpu_check.FAILED, gpu_check.RESULTS
    assert {"1 state spans devices", "3 restore from the host copy through buckets"} <= set(gpu_check.RESULTS)


def test_nccl_groups_form_on_the_ranks_own_device(monkeypatch):
    """On NCCL a generation's group is formed after ``set_device`` and bound to the rank's GPU
    (``device_id``): without it, every rank's communicators would form lazily on whichever device
    is current at the first collective (device 0 for all of them)."""
    from ckless_lightning.comm import process_group

    made: dict = {}
    current: list[torch.device] = []
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        process_group.dist, "init_process_group", lambda backend, **kw: made.update(kw, backend=backend)
    )
    monkeypatch.setattr(process_group.torch.cuda, "set_device", current.append)
    store = SimpleNamespace(process_group_store=lambda generation, init_timeout_s: "store")
    gpu = torch.device("cuda", 3)
    process_group.init_generation_process_group(
        store,
        backend="nccl",
        rank=3,
        world_size=4,
        generation=2,
        timeout_s=60,
        device=gpu,  # type: ignore[arg-type]
    )
    assert current == [gpu] and made["device_id"] == gpu and made["backend"] == "nccl"
    made.clear()
    process_group.init_generation_process_group(
        store,
        backend="gloo",
        rank=3,
        world_size=4,
        generation=2,
        timeout_s=60,
        device=torch.device("cpu"),  # type: ignore[arg-type]
    )
    assert "device_id" not in made and current == [gpu]  # gloo on CPU: nothing bound
