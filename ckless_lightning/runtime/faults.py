"""Fault plans: what to break, on which rank, at which optimizer step and in which phase.

``FaultConfig`` is the ``fault:`` config section (``conf/fault/*.yaml``).
:func:`plan_faults` turns it into a list of :class:`FaultSpec` — one for a
targeted fault, a deterministic schedule for ``fault.type=random`` — that the
rank (``FaultInjectionCallback``, ``injected_by=inside``) or the agent
(``injected_by=outside``: it signals the rank's pid) carries out.

A restarted job passes the same step again; a fault must not fire twice.
:func:`claim_fault` makes each fault once-only across processes and restarts
with a marker file per fault, created atomically (``O_CREAT | O_EXCL``).

Nothing here imports torch or Lightning: the agent process uses this module.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "CHAOS_SIGNALS",
    "CHAOS_TARGETS",
    "FAULT_TYPES",
    "INJECTORS",
    "NODE_FAULT_TYPES",
    "PHASES",
    "RANDOM_FAULT_TYPES",
    "STEP_PHASES",
    "FaultConfig",
    "FaultSpec",
    "claim_fault",
    "injected_event",
    "marker_path",
    "plan_faults",
]

# "corrupt" (tier 4, phase "transfer"): the rank, as a transfer source, flips a byte of a bucket in flight.
# "stall": the rank stops making progress while running (sleeps in its own code; not stopped, state S):
# only hang detection finds it, and only the report of where each rank waits tells it from its peers.
# "chaos": the node agent sends SIGKILL or SIGSTOP to a random process of its node (a rank, a warm
# spare, the batch-cache reader) at random wall-clock times from the job's start: start-up, steps,
# recoveries and process-group formation alike (ckless_lightning.runtime.outside_faults.ChaosInjector).
# "bitflip" (tiers 3-4, HSDP): flips one bit of rank fault.rank's local shard of parameter fault.tensor
# (null: the first parameter by name) in phase fault.phase of step fault.step: silent corruption, found
# by the replicas' state digest in the commit vote (ckless_lightning.recovery.digest).
# "corrupt_copy" (tier 4, buddy copies): rank fault.rank flips a byte of the loop state (data
# position, RNG, step counters) in the newest complete copy it holds of its ward, in phase fault.phase
# of step fault.step: corruption in host memory after the copy arrived, which no checksum in flight
# sees; a restore from that copy fails its verification against the ward's recorded fingerprint.
# "reader_stall" (tier 2+): node fault.node's batch-cache reader stops building when it reaches the
# batch of step fault.step, still running: only the agent's progress check of the reader finds it.
# "device_error": rank fault.rank's own accelerator fails in phase fault.phase of step fault.step: it
# raises torch.AcceleratorError as CUDA does on an illegal address or an ECC error (its CUDA context
# would be unusable): the rank ends (exit code 7) and is replaced, never recovered in-process.
# "slot_lost" (tiers 3-4, from outside): rank fault.rank's device is lost in step fault.step: its
# agent kills the rank and has nothing to start in its place until the job has completed step
# fault.return_step (null: never), as with no spare and no free GPU (elastic.enabled: the job goes on
# without the rank's replica meanwhile).
FAULT_TYPES = (
    "none",
    "kill",
    "hang",
    "stall",
    "exception",
    "device_error",
    "node_loss",
    "corrupt",
    "bitflip",
    "corrupt_copy",
    "random",
    "plan",
    "chaos",
    "reader_stall",
    "slot_lost",
)
NODE_FAULT_TYPES = ("node_loss", "reader_stall")  # they name a node, not a rank
CHAOS_TARGETS = ("rank", "spare", "reader", "forkserver")
CHAOS_SIGNALS = ("kill", "stop")
# Phases of an optimizer step, in order ("commit": after the step-commit vote, before the update),
# then "recovery": while the rank recovers in-process from an earlier fault (tiers 3 and 4), between
# leaving a generation and joining the next; "comm_init": after joining, as the rank starts forming
# the generation's process groups; "transfer": as the ranks start tier 4's state transfer.
STEP_PHASES = ("data", "forward", "backward", "grad_reduction", "commit", "optimizer")
PHASES = (*STEP_PHASES, "recovery", "comm_init", "transfer")
INJECTORS = ("inside", "outside")
# Types a random schedule may draw from (node_loss is targeted only: it names a node).
RANDOM_FAULT_TYPES = ("kill", "hang", "stall", "exception")


def _choices(values: tuple[str, ...]) -> str:
    return " | ".join(values)


@dataclass
class FaultConfig:
    """The ``fault:`` section. ``step`` is the N-th optimizer step (1-based) during which the fault fires.

    ``node`` is used by ``node_loss``; ``mtbf_steps``, ``seed``, ``max_faults`` and
    ``types`` by ``random``; ``mtbf_s``, ``seed``, ``max_faults``, ``targets`` and ``signals``
    by ``chaos`` (per node agent: at most ``max_faults``, mean ``mtbf_s`` seconds apart);
    ``plan`` by ``plan``: a list of faults, each a mapping of
    this section's targeted keys (``type``, ``rank``, ``step``, ``phase``, ``injected_by``, ``node``).
    A ``recovery``-phase fault of step N fires in the first in-process recovery (tiers 3-4)
    that begins once the rank has started step N; a ``comm_init``-phase one as the rank starts
    forming the process groups of such a recovery's generation; a ``transfer``-phase one as the
    ranks start tier 4's state transfer in such a recovery.
    Checks that need the job's shape are in :meth:`validate_against`.
    """

    type: str = "none"
    rank: int = 1
    step: int = 10
    phase: str = "forward"
    injected_by: str = "inside"
    node: int = 1
    mtbf_steps: float = 40.0
    seed: int = 0
    max_faults: int = 3
    types: list[str] = field(default_factory=lambda: ["kill", "exception", "hang"])
    plan: list[dict[str, Any]] = field(default_factory=list)
    mtbf_s: float = 10.0
    targets: list[str] = field(default_factory=lambda: list(CHAOS_TARGETS))
    signals: list[str] = field(default_factory=lambda: list(CHAOS_SIGNALS))
    tensor: str | None = None  # bitflip: the parameter (its name in the model); null: the first by name
    return_step: int | None = None  # slot_lost: the completed step after which the device is back

    def __post_init__(self) -> None:
        self.types = list(self.types)  # YAML gives a ListConfig or a tuple
        self.plan = [dict(entry) for entry in self.plan]
        self.targets, self.signals = list(self.targets), list(self.signals)
        for key, allowed in (("targets", CHAOS_TARGETS), ("signals", CHAOS_SIGNALS)):
            values = getattr(self, key)
            if not values or any(v not in allowed for v in values):
                raise ValueError(f"fault.{key} must be a non-empty list of {_choices(allowed)}, got {values}")
        if not self.mtbf_s > 0:
            raise ValueError(
                f"fault.mtbf_s (mean seconds between chaos faults) must be > 0, got {self.mtbf_s}"
            )
        if self.type not in FAULT_TYPES:
            raise ValueError(f"fault.type must be one of {_choices(FAULT_TYPES)}, got {self.type!r}")
        if self.phase not in PHASES:
            raise ValueError(f"fault.phase must be one of {_choices(PHASES)}, got {self.phase!r}")
        if self.injected_by not in INJECTORS:
            raise ValueError(
                f"fault.injected_by must be one of {_choices(INJECTORS)}, got {self.injected_by!r}"
            )
        if self.step < 1:
            raise ValueError(
                f"fault.step is the 1-based optimizer step of the fault; must be >= 1, got {self.step}"
            )
        if not self.mtbf_steps > 0:
            raise ValueError(f"fault.mtbf_steps must be > 0, got {self.mtbf_steps}")
        if self.max_faults < 1:
            raise ValueError(f"fault.max_faults must be >= 1, got {self.max_faults}")
        if not self.types:
            raise ValueError(f"fault.types must list at least one of {_choices(RANDOM_FAULT_TYPES)}")
        unknown = [t for t in self.types if t not in RANDOM_FAULT_TYPES]
        if unknown:
            raise ValueError(
                f"fault.types may only contain {_choices(RANDOM_FAULT_TYPES)}, got {unknown}; "
                "a node loss is targeted: use fault=node_loss"
            )
        if self.type == "corrupt" and (self.phase != "transfer" or self.injected_by != "inside"):
            raise ValueError(
                "fault.type=corrupt flips bytes of a tier-4 recovery transfer sent by fault.rank: "
                "set fault.phase=transfer and fault.injected_by=inside"
            )
        if self.type == "bitflip" and (self.phase not in STEP_PHASES or self.injected_by != "inside"):
            raise ValueError(
                "fault.type=bitflip flips a bit in fault.rank's parameters from inside the rank, during a "
                f"step: set fault.injected_by=inside and fault.phase to one of {_choices(STEP_PHASES)}"
            )
        if self.type == "corrupt_copy" and (self.phase not in STEP_PHASES or self.injected_by != "inside"):
            raise ValueError(
                "fault.type=corrupt_copy corrupts a copy fault.rank holds, from inside the rank, during a "
                f"step: set fault.injected_by=inside and fault.phase to one of {_choices(STEP_PHASES)}"
            )
        if self.type == "slot_lost" and self.injected_by != "outside":
            raise ValueError(
                "fault.type=slot_lost takes a device away from the rank's node agent: set "
                "fault.injected_by=outside (or use fault=slot_lost)"
            )
        if self.return_step is not None and (self.type != "slot_lost" or self.return_step <= self.step):
            raise ValueError(
                f"fault.return_step={self.return_step} is read by fault.type=slot_lost only, and must come "
                f"after fault.step={self.step} (null: the device never comes back)"
            )
        if self.type == "reader_stall" and self.injected_by != "outside":
            raise ValueError(
                "fault.type=reader_stall is armed by the node agent in the reader it starts: "
                "set fault.injected_by=outside (or use fault=reader_stall)"
            )
        if self.injected_by == "outside":
            if self.type in ("exception", "stall", "device_error"):
                raise ValueError(
                    f"fault.type={self.type} cannot be injected from outside (it happens in the rank's own "
                    "code); use fault.injected_by=inside, or fault.type=kill or hang from outside"
                )
            inside_only = sorted({"exception", "stall", "device_error"} & set(self.types))
            if self.type == "random" and inside_only:
                raise ValueError(
                    f"fault.types contains {', '.join(inside_only)}, which cannot be injected from outside; "
                    "remove them from fault.types or use fault.injected_by=inside"
                )

        if self.type == "plan":
            if not self.plan:
                raise ValueError(
                    "fault.type=plan needs fault.plan: a list of faults, e.g. "
                    "'fault.plan=[{type:kill,rank:1,step:5},{type:exception,rank:2,step:9}]'"
                )
            self.plan_entries()  # validates each entry
        elif self.plan:
            raise ValueError(f"fault.plan is only read with fault.type=plan (fault.type={self.type})")

    def plan_entries(self) -> list[FaultConfig]:
        """``plan``'s entries as targeted FaultConfigs (each validated); ValueError naming the entry."""
        allowed = {"type", "rank", "step", "phase", "injected_by", "node", "tensor", "return_step"}
        entries = []
        for i, entry in enumerate(self.plan):
            unknown = sorted(set(entry) - allowed)
            if unknown:
                raise ValueError(f"fault.plan[{i}] has unknown keys {unknown}; allowed: {sorted(allowed)}")
            if entry.get("type") in (None, "none", "random", "plan", "chaos"):
                raise ValueError(
                    f"fault.plan[{i}].type must be one of kill | hang | stall | exception | device_error | "
                    f"node_loss | corrupt | bitflip | corrupt_copy | slot_lost, got {entry.get('type')!r}"
                )
            try:
                entries.append(FaultConfig(**entry))
            except ValueError as err:
                raise ValueError(f"fault.plan[{i}]: {err}") from err
        return entries

    @property
    def enabled(self) -> bool:
        return self.type != "none"

    def validate_against(self, world_size: int, nnodes: int, nproc_per_node: int, max_steps: int) -> None:
        """Checks against the job's shape (``cluster.*``) and length (``trainer.max_steps``); ValueError."""
        assert world_size == nnodes * nproc_per_node, (world_size, nnodes, nproc_per_node)
        if self.type == "plan":
            for i, entry in enumerate(self.plan_entries()):
                try:
                    entry.validate_against(world_size, nnodes, nproc_per_node, max_steps)
                except ValueError as err:
                    raise ValueError(f"fault.plan[{i}]: {err}") from err
            return
        if self.type in ("none", "random", "chaos"):
            return
        if self.step > max_steps:
            raise ValueError(
                f"fault.step={self.step} is beyond trainer.max_steps={max_steps}, so it would never fire; "
                f"choose fault.step in 1..{max_steps}, or fault=none for no fault"
            )
        if self.type in NODE_FAULT_TYPES:
            if self.type == "node_loss" and nnodes < 2:
                raise ValueError(
                    "a node loss needs cluster.nnodes >= 2; on one node use fault=kill "
                    f"(cluster.nnodes={nnodes})"
                )
            if not 0 <= self.node < nnodes:
                raise ValueError(
                    f"fault.node={self.node} is outside 0..{nnodes - 1} (cluster.nnodes={nnodes}); "
                    "choose an existing node"
                )
            return
        if not 0 <= self.rank < world_size:
            raise ValueError(
                f"fault.rank={self.rank} is outside 0..{world_size - 1}: the world size is {world_size} "
                f"(cluster.nnodes={nnodes} x cluster.nproc_per_node={nproc_per_node}); choose a rank in it"
            )


@dataclass(frozen=True)
class FaultSpec:
    """One planned fault: ``fault_type`` on global ``rank`` in optimizer step ``step`` (1-based), ``phase``.

    ``index`` numbers the faults of a plan (the marker file's name); ``node`` is set for ``node_loss``.
    """

    index: int
    fault_type: str
    rank: int
    step: int
    phase: str
    injected_by: str
    node: int | None = None
    tensor: str | None = None  # bitflip: the parameter's name (None: the first by name)
    return_step: int | None = None  # slot_lost: the completed step after which the device is back

    def __post_init__(self) -> None:
        assert self.index >= 0 and self.step >= 1 and self.rank >= 0, self
        assert self.fault_type in FAULT_TYPES and self.fault_type not in ("none", "random"), self
        assert self.phase in PHASES and self.injected_by in INJECTORS, self
        assert (self.node is not None) == (self.fault_type in NODE_FAULT_TYPES), self


def plan_faults(
    cfg: FaultConfig, *, world_size: int, nnodes: int, nproc_per_node: int, max_steps: int
) -> list[FaultSpec]:
    """The faults of a job, deterministic in its inputs (same inputs, same list); validates ``cfg`` first.

    ``random``: inter-arrival steps ~ Exponential(mean ``mtbf_steps``) rounded up (>= 1, so at most one
    fault per step), rank, phase and type drawn uniformly, at most ``max_faults``, steps <= ``max_steps``.
    """
    cfg.validate_against(world_size, nnodes, nproc_per_node, max_steps)
    if cfg.type in ("none", "chaos"):  # chaos is drawn by each node agent as the job runs
        return []
    if cfg.type == "plan":
        specs = []
        for index, entry in enumerate(cfg.plan_entries()):
            shape = {"world_size": world_size, "nnodes": nnodes, "nproc_per_node": nproc_per_node}
            (spec,) = plan_faults(entry, **shape, max_steps=max_steps)
            specs.append(replace(spec, index=index))
        return specs
    if cfg.type in NODE_FAULT_TYPES:
        return [
            FaultSpec(
                index=0,
                fault_type=cfg.type,
                rank=cfg.node * nproc_per_node,
                step=cfg.step,
                phase=cfg.phase,
                injected_by=cfg.injected_by,
                node=cfg.node,
            )
        ]
    if cfg.type != "random":
        return [
            FaultSpec(
                index=0,
                fault_type=cfg.type,
                rank=cfg.rank,
                step=cfg.step,
                phase=cfg.phase,
                injected_by=cfg.injected_by,
                tensor=cfg.tensor if cfg.type == "bitflip" else None,
                return_step=cfg.return_step if cfg.type == "slot_lost" else None,
            )
        ]
    rng = random.Random(cfg.seed)
    specs: list[FaultSpec] = []
    step = 0
    while len(specs) < cfg.max_faults:
        step += max(1, math.ceil(rng.expovariate(1.0 / cfg.mtbf_steps)))
        if step > max_steps:
            break
        rank = rng.randrange(world_size)
        phase = rng.choice(STEP_PHASES)
        fault_type = rng.choice(cfg.types)
        specs.append(
            FaultSpec(
                index=len(specs),
                fault_type=fault_type,
                rank=rank,
                step=step,
                phase=phase,
                injected_by=cfg.injected_by,
            )
        )
    return specs


def injected_event(spec: FaultSpec, injected_by: str) -> dict[str, object]:
    """The fields of the ``fault_injected`` event for ``spec`` (see ckless_lightning.record.events)."""
    return {
        "rank": spec.rank,
        "step": spec.step,
        "phase": spec.phase if injected_by == "inside" else None,
        "fault_type": spec.fault_type,
        "injected_by": injected_by,
    }


def marker_path(marker_dir: str | Path, spec: FaultSpec) -> Path:
    """``<marker_dir>/fault-<index>.fired``: exists once ``spec`` has fired."""
    return Path(marker_dir) / f"fault-{spec.index}.fired"


def claim_fault(marker_dir: str | Path, spec: FaultSpec) -> bool:
    """Atomically claim ``spec``: True if this call created its marker (fire it), False if it had fired.

    Safe across processes and restarts (``O_CREAT | O_EXCL``); creates ``marker_dir`` if missing.
    """
    path = marker_path(marker_dir, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, f"{spec!r} pid={os.getpid()}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True
