"""Per-rank memory plan of a job, for ``dry_run=true`` and the fit check before ranks start.

Counts what FSDP2 keeps sharded on every rank for the whole run: parameters,
gradients and AdamW's two moments, at the master-weight dtype (fp32 unless
``trainer.precision=bf16-true``). Each parameter is split over the ``shard``
ranks of its replica along the dim its FSDP2 plan shards, and the largest
rank's share is counted (FSDP2 pads uneven shards). Activations and the
transient all-gathered block are not counted: the fit check demands headroom
for them instead.

Tier 4 adds host memory: with ``replication.source=buddy`` every rank keeps
four copies of its shard's parameters and optimizer state in host memory (its
own two double-buffered slots and two of its buddy's), and copies and sends one
shard per snapshot; a recovery's transfer holds two buckets
(``replication.bucket_mb``) on the group's device. HSDP needs none of it (the
replica is the copy). On CPU that host memory comes out of the same RAM as the
state, so the fit check counts both; on GPU it is checked against host RAM.

It also estimates the seed-only weight init per rank: the random elements the
rank draws (about its shard, ``models.init``) times a per-element cost measured
on one core of the dev machine (``INIT_NS_PER_ELEMENT``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from ckless_lightning.runtime.config import JobConfig

__all__ = [
    "HEADROOM",
    "MemoryPlan",
    "available_bytes_per_rank",
    "check_fits",
    "host_bytes_per_rank",
    "plan_job",
    "resolve_accelerator",
    "state_on_gpu",
]

# The sharded state may use at most this share of a rank's memory; the rest is
# for activations, all-gathered blocks, communication buffers and the runtime.
HEADROOM = 0.6
_GIB = 1024**3


@dataclass(frozen=True)
class MemoryPlan:
    recipe: str
    model: str
    num_params: int
    world_size: int
    mesh: tuple[int, int]
    precision: str
    master_bytes: int  # bytes per parameter element of the master weights
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    init_draw_elements: int = 0  # random elements init_weights draws on shard rank 0 (the largest)
    init_ns_per_element: float = 0.0
    replication: str | None = None  # tier 4's source ("buddy" / "hsdp"); None below tier 4
    host_copy_bytes: int = 0  # tier 4 buddy: the four host slots (own two, the buddy's two)
    snapshot_bytes: int = 0  # tier 4 buddy: copied locally and sent to the buddy per snapshot
    recovery_peak_bytes: int = 0  # tier 4: a transfer's send and receive buckets
    unknowns: tuple[str, ...] = ()  # what the plan cannot know (a user's module), said in format()

    @property
    def host_slots(self) -> int:
        return 4 if self.replication == "buddy" else 0

    @property
    def init_seconds(self) -> float:
        """Estimated CPU seconds of ``init_weights`` on one rank."""
        return self.init_draw_elements * self.init_ns_per_element * 1e-9

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    def format(self) -> str:
        replicate, shard = self.mesh
        kind = "HSDP" if replicate > 1 else "FSDP"
        lines = [
            f"recipe:       {self.recipe} ({self.model})",
            f"parameters:   {self.num_params:,} ({_count(self.num_params)})",
            f"world size:   {self.world_size}",
            f"mesh:         replicate={replicate} x shard={shard} ({kind})",
            f"precision:    {self.precision} (master weights {self.master_bytes} B/param)",
            "per-rank sharded state:",
            f"  parameters       {_size(self.param_bytes)}",
            f"  gradients        {_size(self.grad_bytes)}",
            f"  optimizer state  {_size(self.optim_bytes)}  (AdamW exp_avg + exp_avg_sq)",
            f"  total            {_size(self.total_bytes)}  (activations not included)",
            *self._tier4_lines(),
        ]
        if self.init_ns_per_element:
            lines.append(
                f"weight init:  ~{_duration(self.init_seconds)} per rank (estimate: "
                f"{_count(self.init_draw_elements)} random draws x {self.init_ns_per_element} ns "
                "on one CPU core)"
            )
        lines.extend(f"not known:    {note}" for note in self.unknowns)
        return "\n".join(lines)

    def _tier4_lines(self) -> list[str]:
        if self.replication is None:
            return []
        if self.replication == "hsdp":
            return [
                "tier 4 (replication.source=hsdp): no host copies, the other replica holds each shard",
                f"  recovery peak    {_size(self.recovery_peak_bytes)}  (a transfer's send + receive bucket)",
            ]
        return [
            "tier 4 (replication.source=buddy), host memory per rank:",
            f"  host copies      {_size(self.host_copy_bytes)}  ({self.host_slots} slots x (parameters + "
            "optimizer state + loop state): own two, the buddy's two)",
            f"  per snapshot     {_size(self.snapshot_bytes)}  copied, and as much sent to the buddy",
            f"  recovery peak    {_size(self.recovery_peak_bytes)}  (a transfer's send + receive bucket)",
        ]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"


def _size(n: int) -> str:
    return f"{n / _GIB:10.2f} GiB" if n >= _GIB else f"{n / 1024**2:10.2f} MiB"


def plan_job(job: JobConfig) -> MemoryPlan:
    """Build ``job``'s model on the meta device (no memory) and size its per-rank shards.

    A user's module (``module._target_``) is built on the meta device too; what it creates only in
    ``configure_model``, its optimizer and its init cost are not known, and the plan says so."""
    from ckless_lightning.models import build_model, fsdp_shard_dims, init_draw_count
    from ckless_lightning.models.init import INIT_NS_PER_ELEMENT

    _, shard = job.cluster.mesh_shape
    unknowns: tuple[str, ...] = ()
    if job.script is not None:
        model = torch.nn.Module()
        dims: dict[str, int] = {}
        init_draws, init_ns = 0, 0.0
        unknowns = (f"the model: {job.script[0]} builds it (sizes, optimizer, init time are the script's)",)
    elif job.module.builtin:
        with torch.device("meta"), _ShapesOnly():
            model = build_model(job.model)
        dims = fsdp_shard_dims(model, shard)
        init_draws, init_ns = init_draw_count(model, dims, shard, shard_rank=0), INIT_NS_PER_ELEMENT
    else:
        model, unknowns = _user_module_on_meta(job)
        dims = {name: 0 for name, _ in model.named_parameters()}  # fully_shard's default, Shard(0)
        init_draws, init_ns = 0, 0.0
    num_params = 0
    shard_elems = 0
    for name, p in model.named_parameters():
        num_params += p.numel()
        dim = dims[name]
        size = p.shape[dim] if p.ndim else 1
        shard_elems += math.ceil(size / shard) * (p.numel() // max(size, 1))
    master = 2 if job.trainer.precision == "bf16-true" else 4
    replication = job.replication.resolved_source(job.cluster.replicate) if job.tier == 4 else None
    copied = 3 * shard_elems * master  # parameters + AdamW's two moments
    loop = int(job.replication.loop_capacity_mb * (1 << 20))
    return MemoryPlan(
        recipe=job.recipe,
        model=_model_name(job, model),
        num_params=num_params,
        world_size=job.cluster.world_size,
        mesh=job.cluster.mesh_shape,
        precision=job.trainer.precision,
        master_bytes=master,
        param_bytes=shard_elems * master,
        grad_bytes=shard_elems * master,
        optim_bytes=2 * shard_elems * master,
        init_draw_elements=init_draws,
        init_ns_per_element=init_ns,
        replication=replication,
        host_copy_bytes=4 * (copied + loop) if replication == "buddy" else 0,
        snapshot_bytes=copied if replication == "buddy" else 0,
        # buckets are as large as the state they carry, up to replication.bucket_mb
        recovery_peak_bytes=2 * min(int(job.replication.bucket_mb * (1 << 20)), copied) if replication else 0,
        unknowns=unknowns,
    )


class _ShapesOnly(TorchFunctionMode):
    """A model built only to be measured needs no values: the ``torch.nn.init`` fills of its
    constructors (and the module's own ``reset_parameters``) are skipped. On the meta device they
    compute nothing, but the first one imports torch's Python reference kernels (``torch._refs``,
    ~800 modules, about a second of CPU in every launch)."""

    _FILLS = frozenset(
        {"normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "trunc_normal_", "kaiming_uniform_",
         "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "constant_", "orthogonal_", "eye_"}
    )  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self._FILLS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def _model_name(job: JobConfig, model: torch.nn.Module) -> str:
    if job.script is not None:
        return Path(job.script[0]).name
    return type(model).__name__ if job.module.builtin else job.module.target


def _user_module_on_meta(job: JobConfig) -> tuple[torch.nn.Module, tuple[str, ...]]:
    """The user's LightningModule built on the meta device (no memory), and what the plan cannot
    know of it."""
    from hydra.utils import instantiate

    target = job.module.target
    unknowns = [
        "optimizer state: counted as AdamW's (2 x the parameters); another optimizer keeps other state",
        "weight init time: the module's own",
    ]
    try:
        with torch.device("meta"), _ShapesOnly():
            module = instantiate(job.module.to_mapping(), _convert_="all")
    except Exception as err:  # the user's constructor: the plan goes on without its sizes
        unknowns.insert(0, f"parameters: {target} could not be built on the meta device ({err})")
        return torch.nn.Module(), tuple(unknowns)
    if not any(True for _ in module.parameters()):
        unknowns.insert(
            0, f"parameters: {target} creates none in __init__ (configure_model's are not counted)"
        )
    return module, tuple(unknowns)


def resolve_accelerator(name: str) -> str:
    """``auto`` is ``gpu`` when CUDA is visible, else ``cpu``; ``gpu`` without CUDA is an error."""
    if name == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if name == "gpu" and not torch.cuda.is_available():
        raise ValueError(
            "cluster.accelerator=gpu but no CUDA device is visible; "
            "use cluster.accelerator=cpu (or cluster=local_cpu) to run on this machine"
        )
    return name


def host_bytes_per_rank(nproc_per_node: int) -> int:
    """A rank's share of this machine's available host RAM."""
    import psutil

    return psutil.virtual_memory().available // nproc_per_node


def state_on_gpu(accelerator: str) -> bool:
    """Whether the ranks' state lives in GPU memory (else in host RAM, with tier 4's host copies)."""
    return accelerator in ("gpu", "auto") and torch.cuda.is_available()


def available_bytes_per_rank(accelerator: str, nproc_per_node: int) -> tuple[int, str]:
    """Memory one rank of this machine can use, and where that figure comes from."""
    if state_on_gpu(accelerator):
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"GPU memory of {torch.cuda.get_device_name(0)}"
    return host_bytes_per_rank(nproc_per_node), f"available host RAM / {nproc_per_node} ranks per node"


def check_fits(plan: MemoryPlan, available: int, source: str, *, host_available: int | None = None) -> None:
    """Raise MemoryError (with the plan) if the sharded state leaves no room for activations, or
    tier 4's host copies do not fit.

    ``available``: a rank's share of the memory its state lives in (``source`` says which);
    ``host_available``: a rank's share of host RAM when that is other memory (GPU training), None
    when the state lives in host RAM too (then the host copies count against ``available``).
    """
    device = plan.total_bytes + plan.recovery_peak_bytes
    if host_available is None:
        device += plan.host_copy_bytes
    if device > HEADROOM * available:
        host = " and tier 4's host copies and recovery buckets" if plan.replication else ""
        raise MemoryError(
            f"recipe {plan.recipe!r} does not fit this machine: its per-rank state{host} need "
            f"{device / _GIB:.2f} GiB, but a rank here has {available / _GIB:.2f} GiB ({source}) "
            f"and they may use at most {HEADROOM:.0%} of it.\n{plan.format()}\n"
            "Run with dry_run=true to inspect the plan, shard over more ranks (cluster.*), "
            + ("use replication.source=hsdp with cluster.replicate=2 (no host copies), " if host else "")
            + "or pick a smaller recipe (e.g. recipe=llama3_tiny)."
        )
    if host_available is not None and plan.host_copy_bytes > HEADROOM * host_available:
        raise MemoryError(
            f"recipe {plan.recipe!r}: tier 4's buddy copies need {plan.host_copy_bytes / _GIB:.2f} GiB of "
            f"host memory per rank, but a rank's share of host RAM is {host_available / _GIB:.2f} GiB "
            f"(at most {HEADROOM:.0%} of it).\n{plan.format()}\n"
            "Use replication.source=hsdp with cluster.replicate=2 (no host copies), shard over more "
            "ranks (cluster.*), or tier=3 (disk checkpoints only)."
        )
