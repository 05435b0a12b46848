"""Typed job configuration, built from the Hydra-composed config.

Hydra composes YAML (``conf/`` + ``recipes/`` + command-line overrides); this
module turns the result into dataclasses that validate themselves in
``__post_init__``. Every user error is a ``ValueError`` that names the config
key and the fix, and it is raised in ``launch.py`` before any rank starts.

Nothing here imports torch or Lightning: ``launch.py --help`` and the dry run's
config checks stay cheap. The model section is instantiated with Hydra
(``_target_`` names the model family's config class).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckless_lightning.data.config import DataConfig
from ckless_lightning.deploy import K8sConfig
from ckless_lightning.runtime.component_config import BUILTIN_DATAMODULE, BUILTIN_MODULE, ComponentConfig
from ckless_lightning.runtime.faults import FaultConfig, FaultSpec, plan_faults
from ckless_lightning.runtime.logger_config import LoggerConfig

__all__ = [
    "AgentConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "CommConfig",
    "ElasticConfig",
    "JobConfig",
    "LoggerConfig",
    "OptimConfig",
    "ReplicationConfig",
    "TrainerConfig",
    "build_section",
    "job_config_from_dict",
]

_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
_ACCELERATORS = ("auto", "cpu", "gpu")
_LAUNCHERS = ("auto", "slurm", "manual")


@dataclass
class ClusterConfig:
    """Shape of the job: nodes x ranks per node, and the (replicate, shard) mesh over them.

    ``replicate > 1`` is HSDP (each replica holds 1/shard of the state);
    ``replicate == 1`` is plain FSDP. ``shard = -1`` means world_size // replicate.
    """

    nnodes: int = 1
    nproc_per_node: int = 4
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (single node only)
    replicate: int = 1
    shard: int = -1
    accelerator: str = "auto"
    # Memory per rank (GiB) assumed by the recipe's plan, e.g. 80 for an H100 80GB; informational.
    device_memory_gib: float | None = None
    # Where node rank, node count and master_addr come from (ckless_lightning.runtime.launcher):
    # auto (Slurm's variables inside an srun step, else the config) | slurm | manual.
    launcher: str = "auto"
    # "host:port" of a standalone job store (python -m ckless_lightning.store); null: node 0's agent
    # hosts it on master_addr:master_port (then losing node 0 restarts the job).
    store: str | None = None
    # Standby agents the job has beyond its nodes (ckless_lightning.agent.standby): under Slurm the
    # last spare_nodes tasks stand by; by hand, start them with cluster.standby=true.
    spare_nodes: int = 0
    standby: bool = False  # this agent stands by and takes the place of a node that goes silent

    def __post_init__(self) -> None:
        for key in ("nnodes", "nproc_per_node", "replicate"):
            if getattr(self, key) < 1:
                raise ValueError(f"cluster.{key} must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"cluster.node_rank={self.node_rank} is outside 0..{self.nnodes - 1} "
                f"(cluster.nnodes={self.nnodes})"
            )
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"cluster.master_port must be in 0..65535, got {self.master_port}")
        if self.master_port == 0 and self.nnodes > 1 and self.store is None:
            raise ValueError(
                "cluster.master_port=0 (pick a free port) only works on one node; "
                "set cluster.master_port to a port every node can reach (under Slurm, launch.py picks "
                "one from the job id), or give a standalone store with cluster.store=host:port"
            )
        if self.accelerator not in _ACCELERATORS:
            raise ValueError(f"cluster.accelerator must be one of {_ACCELERATORS}, got {self.accelerator!r}")
        if self.spare_nodes < 0:
            raise ValueError(f"cluster.spare_nodes must be >= 0, got {self.spare_nodes}")
        if self.launcher not in _LAUNCHERS:
            raise ValueError(f"cluster.launcher must be one of {_LAUNCHERS}, got {self.launcher!r}")
        if self.store is not None:
            _ = self.store_address  # raises on anything but "host:port"
        from ckless_lightning.models.mesh import resolve_mesh

        self.replicate, self.shard = resolve_mesh(
            self.world_size,
            self.replicate,
            self.shard,
            key="cluster.",
            world=f"cluster.nnodes={self.nnodes} x cluster.nproc_per_node={self.nproc_per_node}",
        )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def store_address(self) -> tuple[str, int]:
        """The job store's (host, port): ``store`` if set, else node 0's agent on ``master_addr``."""
        if self.store is None:
            return self.master_addr, self.master_port
        host, sep, port = str(self.store).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"cluster.store={self.store!r} is not host:port; give the address that "
                "`python -m ckless_lightning.store` printed, e.g. cluster.store=10.0.0.5:29400"
            )
        return host.strip("[]"), int(port)

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.replicate, self.shard)


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr`` at ``trainer.max_steps``."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    # Length of the schedule; null: trainer.max_steps. Set it to stop a run early
    # on the same schedule as a longer one (e.g. stop at step 10 of a 20-step run).
    decay_steps: int | None = None

    def __post_init__(self) -> None:
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(
                f"optim.decay_steps must be >= 1 or null (= trainer.max_steps), got {self.decay_steps}"
            )
        self.betas = tuple(self.betas)  # type: ignore[assignment]  # YAML gives a list
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {list(self.betas)}")


@dataclass
class TrainerConfig:
    """The Lightning ``Trainer`` arguments a recipe sets, plus the global batch size.

    ``devices``, ``num_nodes``, ``strategy`` and ``accumulate_grad_batches`` are
    derived from ``cluster`` and the batch sizes, so they are not keys here.

    ``warm_first_step`` (tiers 3-4, not a Trainer argument): a replaced rank's new process warms
    DTensor's sharding caches for its first step's gradient clipping (``gradient_clip_val`` by norm)
    and optimizer step before that step (tier 4: while its state moves), so that the survivors do
    not wait for it in the first step after a recovery; no bit of the computation changes
    (ckless_lightning.replication.warmup).
    """

    max_steps: int = 20
    global_batch_size: int = 16
    gradient_clip_val: float | None = 1.0
    precision: str = "32-true"
    log_every_n_steps: int = 1
    enable_progress_bar: bool = True
    warm_first_step: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.warm_first_step, bool):
            raise ValueError(f"trainer.warm_first_step must be true or false, got {self.warm_first_step!r}")
        if self.max_steps < 1:
            raise ValueError(f"trainer.max_steps must be >= 1, got {self.max_steps}")
        if self.global_batch_size < 1:
            raise ValueError(f"trainer.global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.gradient_clip_val is not None and self.gradient_clip_val <= 0:
            raise ValueError(
                f"trainer.gradient_clip_val must be > 0 or null (no clipping), got {self.gradient_clip_val}"
            )
        if self.precision not in _PRECISIONS:
            raise ValueError(f"trainer.precision must be one of {_PRECISIONS}, got {self.precision!r}")
        if self.log_every_n_steps < 1:
            raise ValueError(f"trainer.log_every_n_steps must be >= 1, got {self.log_every_n_steps}")


@dataclass
class CheckpointConfig:
    """Sharded torch.distributed.checkpoint (DCP) checkpoints: the fallback of every tier.

    ``resume``: ``auto`` resumes from the latest complete checkpoint in ``dir``
    if there is one, ``never`` starts fresh, anything else is a checkpoint path.
    """

    dir: str = "checkpoints"
    every_n_steps: int = 0  # 0: no periodic checkpoints
    keep_last: int = 3
    save_final: bool = True  # a checkpoint of the final step, whatever every_n_steps says
    resume: str = "auto"

    def __post_init__(self) -> None:
        if self.every_n_steps < 0:
            raise ValueError(f"checkpoint.every_n_steps must be >= 0 (0 disables), got {self.every_n_steps}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")


@dataclass
class AgentConfig:
    """The per-node agent: warm spares, the fork server, failure detection and the restart budget.

    With ``fork_server`` the agent starts one process that imports torch, Lightning and the
    project once and forks each rank from it (:mod:`ckless_lightning.forkserver`); a rank it
    cannot fork in time starts cold.

    A rank is declared hung when it sends no heartbeat for ``hang_timeout``
    seconds once it has completed a step, for ``startup_timeout`` seconds
    before its first step (imports, rendezvous, model build and restore), or
    for ``recovery_timeout`` seconds while it recovers in-process (tiers 3-4:
    from leaving a generation to its next step), or for ``save_timeout`` seconds
    while it saves a checkpoint (a long save is not a hang). A stopped process (state T)
    is killed at once, in any phase; so is a stopped batch-cache reader or spare.
    More than ``max_restarts`` restarts within ``restart_window_s`` spends the
    fault budget: the agents stop the job and exit with code 75 (EX_TEMPFAIL),
    for Slurm or Kubernetes to requeue it. ``replace_timeout`` (elastic jobs,
    ``elastic.enabled``): how long the job waits for a lost rank's replacement before
    it goes on without that rank's replica.

    The agent looks at its node (exit codes, its ranks' heartbeats) every ``monitor_interval``
    and goes to the job store (its own beat, the job's generation and give-up, the other agents'
    beats) every ``store_interval``, at most ``node_timeout / 3`` so that a live node's beats are
    seen well within ``node_timeout``; a generation move wakes it at once. It reads the beats of
    ``watch_nodes`` other agents, not all: the next nodes after its own, past any found silent
    (``agent/store_look.py``), so every node is watched by that many and a pass costs the store the
    same at 2 nodes as at 2,000; a silent node's watchers move the job, the others follow the move.

    ``fence_after`` (default ``node_timeout / 2``): an agent that has had no answer from the job
    store for this long kills its ranks itself (a node cut off from the network), so that they are
    gone before the job counts the node as lost (``agent/store_lease.py``); no answer for
    ``node_timeout`` twice more: it exits 75.

    ``peer_probe`` (multi-node jobs): an agent whose ranks have been silent in a step for
    ``probe_after`` (default ``hang_timeout / 4``) probes the other agents over the peer network; a
    node cut off from the others (it still reaches the store) kills its ranks and leaves its place
    to a standby (``agent/peer_reach.py``).
    """

    spares: int = 0
    fork_server: bool = True
    hang_timeout: float = 60.0
    startup_timeout: float = 600.0
    recovery_timeout: float = 300.0
    save_timeout: float = 600.0
    node_timeout: float = 30.0
    local_beats: bool = True
    max_restarts: int = 3
    restart_window_s: float = 3600.0
    monitor_interval: float = 0.1
    store_interval: float = 1.0
    watch_nodes: int = 2
    stop_grace_s: float = 10.0
    replace_timeout: float = 60.0
    fence_after: float | None = None
    peer_probe: bool = True
    probe_after: float | None = None

    def __post_init__(self) -> None:
        if self.spares < 0:
            raise ValueError(f"agent.spares must be >= 0, got {self.spares}")
        if self.watch_nodes < 1:
            raise ValueError(
                f"agent.watch_nodes must be at least 1 (how many other nodes' agents each agent watches "
                f"for a lost node), got {self.watch_nodes}: leave it at 2, or raise it for more watchers"
            )
        if self.max_restarts < 0:
            raise ValueError(f"agent.max_restarts must be >= 0, got {self.max_restarts}")
        for key in (
            "hang_timeout",
            "startup_timeout",
            "recovery_timeout",
            "save_timeout",
            "node_timeout",
            "restart_window_s",
            "monitor_interval",
            "store_interval",
            "replace_timeout",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(
                    f"agent.{key} must be a positive number of seconds, got {getattr(self, key)}"
                )
        if self.store_interval > self.node_timeout / 3:
            raise ValueError(
                f"agent.store_interval={self.store_interval:g} must be at most agent.node_timeout/3 = "
                f"{self.node_timeout / 3:.2f} s (an agent beats once per store_interval, and another node "
                "is declared lost after node_timeout without beats): lower agent.store_interval or raise "
                f"agent.node_timeout to at least {3 * self.store_interval:g}"
            )
        if self.stop_grace_s < 0:
            raise ValueError(f"agent.stop_grace_s must be >= 0 seconds, got {self.stop_grace_s}")
        if self.fence_after is None:
            self.fence_after = self.node_timeout / 2
        if not self.store_interval < self.fence_after < self.node_timeout:
            raise ValueError(
                f"agent.fence_after={self.fence_after:g} must be above agent.store_interval="
                f"{self.store_interval:g} s (a live agent reaches the store once per store_interval) and "
                f"below agent.node_timeout={self.node_timeout:g} s (a cut-off node's ranks must be stopped "
                "before the job counts the node as lost): leave it unset (node_timeout / 2) or pick a "
                "value in that range"
            )
        if self.probe_after is None:
            self.probe_after = self.hang_timeout / 4
        if not 0 < self.probe_after < self.hang_timeout:
            raise ValueError(
                f"agent.probe_after={self.probe_after:g} must be above 0 and below agent.hang_timeout="
                f"{self.hang_timeout:g} s (the probe decides which node is cut off before a hung rank is "
                "blamed): leave it unset (hang_timeout / 4) or pick a value in that range"
            )


VOTES = ("auto", "store", "collective")  # comm.vote: how the ranks decide a step's commit


@dataclass
class CommConfig:
    """How ranks form their process groups.

    ``rootless`` (tier 1): the job store lives in node 0's agent, not in rank 0;
    each generation creates its groups under its own store prefix, so a
    restarted rank joins the running store directly and no rank is the root.
    Off (tier 0): rank 0 hosts the rendezvous store on a fresh port per
    generation, as torchrun's workers do.

    Bounds (tiers 1+; docs/design.md "Every wait is bounded"): ``pg_timeout_s`` is torch's collective
    timeout; ``init_timeout_s`` bounds each store read while a generation's
    process groups form (a peer that died or stopped before publishing its
    address: the rank moves to the next generation); ``join_timeout_s`` bounds
    the join barrier of tiers 3-4 (a rank that never comes, e.g. a lost node
    nobody replaces: the job gives up with exit 75 for the scheduler to requeue);
    ``stuck_grace_s`` (tiers 3-4) is how long a rank may stay in a generation the
    job has left before its generation watch cuts its connections; ``stuck_exit_s``
    how long it may then stay blocked waiting on peers (a wait in C++ the cut does
    not reach, such as gloo connecting to a peer that left) before it exits for its
    agent to replace it.

    ``vote`` (tiers 3-4): how the ranks decide each step's commit. ``store``: through the job store
    (three requests per rank and step at the one store of the job); ``collective``: a one-element
    all-reduce on the generation's process group, no store request (a fault inside it can leave
    the survivors one step apart; the recovery then resumes where all of them can, from copies or
    the disk). ``collective`` does not carry the HSDP state digest (``replication.digest_every``).
    ``auto`` (the default): ``collective``, but ``store`` where the HSDP digest is on or the job is
    elastic (:meth:`JobConfig.resolved_vote`; the job's config holds the resolved value).
    """

    rootless: bool = False
    pg_timeout_s: float = 600.0
    init_timeout_s: float = 60.0
    join_timeout_s: float = 900.0
    stuck_grace_s: float = 0.25
    stuck_exit_s: float = 10.0
    vote: str = "auto"

    def __post_init__(self) -> None:
        for key in ("pg_timeout_s", "init_timeout_s", "join_timeout_s", "stuck_grace_s", "stuck_exit_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"comm.{key} must be a positive number of seconds, got {getattr(self, key)}")
        if self.vote not in VOTES:
            raise ValueError(f"comm.vote must be one of {', '.join(VOTES)}, got {self.vote!r}")


@dataclass
class ReplicationConfig:
    """Tier 4's in-memory redundancy (see ckless_lightning.replication).

    ``source``: ``hsdp`` restores a rank from its replica peer (needs
    ``cluster.replicate >= 2``); ``buddy`` copies each rank's shard to the host
    memory of rank ``(r + buddy_offset) % world`` every ``every_n_steps``
    committed steps; ``auto`` is ``hsdp`` when ``cluster.replicate >= 2``, else
    ``buddy``. ``buddy_offset`` null: ``nproc_per_node`` with 2+ nodes (the next
    node), else 1.
    """

    source: str = "auto"
    every_n_steps: int = 1
    buddy_offset: int | None = None
    bucket_mb: float = 64.0
    loop_capacity_mb: float = 1.0
    # Tiers 3-4 with HSDP (cluster.replicate >= 2): replicas compare a digest of their state in
    # each commit vote, 1/digest_every of it per step, every byte once per digest_every steps;
    # 0 switches it off (ckless_lightning.recovery.digest).
    digest_every: int = 10

    def __post_init__(self) -> None:
        if self.digest_every < 0:
            raise ValueError(
                f"replication.digest_every must be >= 0 (0: no state digest), got {self.digest_every}"
            )
        if self.source not in ("auto", "hsdp", "buddy"):
            raise ValueError(f"replication.source must be auto | hsdp | buddy, got {self.source!r}")
        if self.every_n_steps < 1:
            raise ValueError(f"replication.every_n_steps must be >= 1, got {self.every_n_steps}")
        if self.bucket_mb <= 0 or self.loop_capacity_mb <= 0:
            raise ValueError("replication.bucket_mb and replication.loop_capacity_mb must be positive")

    def resolved_source(self, replicate: int) -> str:
        return ("hsdp" if replicate >= 2 else "buddy") if self.source == "auto" else self.source

    def resolved_offset(self, nnodes: int, nproc_per_node: int) -> int:
        if self.buddy_offset is not None:
            return self.buddy_offset
        return nproc_per_node if nnodes >= 2 else 1


@dataclass
class ElasticConfig:
    """Elastic HSDP: keep training on the complete replicas when a lost rank has no replacement.

    With ``enabled`` (tier 4, ``cluster.replicate >= 2``), a rank lost with nothing to replace it
    within ``agent.replace_timeout`` takes its replica out of the job: its surviving ranks stand by
    and the others train on, at least ``min_replicas`` replicas, with the same global batch (more
    gradient accumulation: ``trainer.global_batch_size`` must divide by every width it can reach).
    When the lost rank is back, its replica rejoins with its state from a live replica.
    """

    enabled: bool = False
    min_replicas: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"elastic.enabled must be true or false, got {self.enabled!r}")
        if self.min_replicas < 1:
            raise ValueError(f"elastic.min_replicas must be >= 1, got {self.min_replicas}")


AVAILABLE_TIERS = (0, 1, 2, 3, 4)


@dataclass
class JobConfig:
    """The whole job, validated. Built by :func:`job_config_from_dict`."""

    recipe: str
    model: Any  # a model family's config dataclass (Llama3Config, MixtralConfig); None: a user's module
    fsdp: Any  # ckless_lightning.models.FSDPConfig
    data: DataConfig
    optim: OptimConfig
    trainer: TrainerConfig
    cluster: ClusterConfig
    checkpoint: CheckpointConfig
    run_dir: str
    agent: AgentConfig = field(default_factory=AgentConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    tier: int = 0
    seed: int = 1234
    dry_run: bool = False
    # Draw <run_dir>/timeline.png when the job ends (``python -m ckless_lightning.report`` draws it later).
    timeline: bool = True
    # The experiment logger (the ``logger`` group); None: the default, CSV under run_dir.
    logger: LoggerConfig | None = None
    # Render Kubernetes manifests instead of running (ckless_lightning.deploy.k8s); off by default.
    k8s: K8sConfig = field(default_factory=K8sConfig)
    # The LightningModule and LightningDataModule every rank builds (``module:`` / ``datamodule:``).
    module: ComponentConfig = field(default_factory=lambda: ComponentConfig("module", BUILTIN_MODULE))
    datamodule: ComponentConfig = field(
        default_factory=lambda: ComponentConfig("datamodule", BUILTIN_DATAMODULE)
    )
    # ``python -m ckless_lightning.run``: the user's script (an absolute path) and its arguments, run
    # as each rank instead of the module and DataModule above; None: a recipe's job.
    script: list[str] | None = None

    def __post_init__(self) -> None:
        self._check_components()
        if self.logger is None:
            self.logger = LoggerConfig.csv(self.run_dir)
        if not isinstance(self.timeline, bool):
            raise ValueError(f"timeline must be true or false, got {self.timeline!r}")
        if self.tier not in range(5):
            raise ValueError(f"tier must be 0..4, got {self.tier}")
        if self.tier not in AVAILABLE_TIERS:
            raise ValueError(
                f"tier={self.tier} is not available yet (available: {', '.join(map(str, AVAILABLE_TIERS))}); "
                "tier 4 (checkpointless) comes with its issue"
            )
        if self.tier >= 2 and self.datamodule.builtin and self.script is None and not self.data.mmap_cache:
            raise ValueError(f"tier={self.tier} includes the batch cache: data.mmap_cache must stay true")
        if self.tier >= 3 and not self.comm.rootless:
            raise ValueError(
                f"tier={self.tier} rejoins through the agent's store: comm.rootless must stay true"
            )
        if self.tier == 4:
            self._check_redundancy()
        if self.comm.vote == "auto":
            self.comm.vote = self.resolved_vote()
        if (
            self.comm.vote == "collective"
            and self.tier >= 3
            and self.cluster.replicate >= 2
            and self.replication.digest_every
        ):
            raise ValueError(
                "comm.vote=collective does not carry the HSDP replicas' state digest "
                f"(replication.digest_every={self.replication.digest_every}, cluster.replicate="
                f"{self.cluster.replicate}): use comm.vote=store, or replication.digest_every=0"
            )
        if self.elastic.enabled:
            self._check_elastic()
        faults = self.fault_entries()
        if self.tier < 3 and any(f.type == "slot_lost" for f in faults):
            raise ValueError(
                f"fault.type=slot_lost leaves a rank without a process, but tier={self.tier} restarts every "
                "rank on a fault; use tier=3 or 4 (with elastic.enabled the job goes on without it)"
            )
        if self.tier != 4 and any(f.type == "corrupt" for f in faults):
            raise ValueError(
                f"fault.type=corrupt corrupts a tier-4 peer-to-peer transfer, but tier={self.tier}; "
                "use tier=4"
            )
        if any(f.type == "bitflip" for f in faults) and (self.tier < 3 or self.cluster.replicate < 2):
            raise ValueError(
                "fault.type=bitflip is found by the HSDP replicas' state digest in the commit vote: it needs "
                f"tier=3 or 4 and cluster.replicate >= 2 (tier={self.tier}, "
                f"cluster.replicate={self.cluster.replicate})"
            )
        if any(f.type == "bitflip" for f in faults) and not self.replication.digest_every:
            raise ValueError(
                "fault.type=bitflip would go unnoticed with replication.digest_every=0; set it to N >= 1"
            )
        copies = [f for f in faults if f.type == "corrupt_copy"]
        if copies and (self.tier != 4 or self.replication.resolved_source(self.cluster.replicate) != "buddy"):
            raise ValueError(
                "fault.type=corrupt_copy corrupts a buddy copy held in host memory: it needs tier=4 and "
                f"replication.source=buddy (tier={self.tier}, replication.source={self.replication.source})"
            )
        every = self.replication.every_n_steps
        if any(f.step <= every for f in copies):
            raise ValueError(
                f"fault.type=corrupt_copy needs a copy to corrupt: the first arrives after step {every} "
                f"(replication.every_n_steps); set fault.step > {every}"
            )
        if not self.data.mmap_cache and any(f.type == "reader_stall" for f in faults):
            raise ValueError(
                "fault.type=reader_stall stalls the batch-cache reader, but data.mmap_cache is off; "
                "use tier=2 or higher (or data.mmap_cache=true)"
            )
        if self.tier != 4 and any(f.phase == "transfer" for f in faults):
            raise ValueError(
                f"fault.phase=transfer hits tier 4's peer-to-peer state transfer, but tier={self.tier}; "
                "use tier=4"
            )
        if self.tier < 3:
            for phase in ("recovery", "comm_init"):
                if any(f.phase == phase for f in faults):
                    raise ValueError(
                        f"fault.phase={phase} needs in-process recovery (tier >= 3), but tier={self.tier}: "
                        "at tiers 0-2 no rank survives a fault to recover; choose another phase or tier=3"
                    )
        self.fault.validate_against(
            world_size=self.cluster.world_size,
            nnodes=self.cluster.nnodes,
            nproc_per_node=self.cluster.nproc_per_node,
            max_steps=self.trainer.max_steps,
        )
        per_step = self.data.micro_batch_size * self.cluster.world_size
        if self.script is None and self.trainer.global_batch_size % per_step:
            raise ValueError(
                f"trainer.global_batch_size={self.trainer.global_batch_size} is not a multiple of "
                f"data.micro_batch_size={self.data.micro_batch_size} x world size {self.cluster.world_size}; "
                f"use a multiple of {per_step}"
            )
        if self.model is None or not self.datamodule.builtin or self.script is not None:
            return  # a user's module or data: their own sizes
        if self.model.vocab_size < 256 and self.data.format != "tokenized" and self.data.tokenizer is None:
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} is smaller than the byte tokenizer's 256; "
                "raise model.vocab_size or give pre-tokenized data (data.format=tokenized)"
            )
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                "lower data.seq_len or raise model.max_seq_len"
            )

    def _check_components(self) -> None:
        """The built-in module needs ``model``; a user's DataModule reads its own data, so the batch
        cache (tier 2's ``data.mmap_cache``, built for the built-in pipeline) is off for it. A
        script builds its own module and data: ``module``/``datamodule`` must stay the defaults."""
        if self.script is not None:
            self._check_script()
            return
        if self.module.builtin and self.model is None:
            raise ValueError(
                f"model is missing: {BUILTIN_MODULE} (module._target_) trains a model a recipe "
                "configures; pick a recipe (recipe=llama3_tiny) or name your own LightningModule "
                "in module._target_"
            )
        if not self.datamodule.builtin:
            self._without_builtin_data(
                f" ({BUILTIN_DATAMODULE}); datamodule._target_={self.datamodule.target} is your own: "
                "set {key}=false"
            )

    def _check_script(self) -> None:
        assert self.script is not None
        if not self.script or not Path(self.script[0]).is_file():
            raise ValueError(
                f"script={self.script[:1]} is not a file: give python -m ckless_lightning.run the path of "
                "your training script (train.py) after its options"
            )
        for component in (self.module, self.datamodule):
            if not component.builtin:
                raise ValueError(
                    f"{component.key}._target_={component.target} and a script exclude each other: the "
                    f"script builds its own; drop {component.key} or run the recipe with launch.py"
                )
        self._without_builtin_data(
            ", which a script does not use: set {key}=false (or name your classes in a recipe's "
            "module:/datamodule: and use launch.py)"
        )

    def _without_builtin_data(self, fix: str) -> None:
        """The user's own data: the options of the built-in pipeline are refused (``fix``, with
        ``{key}``, says what to do), and its batch cache is off."""
        for key, value in (
            ("data.record_samples", self.data.record_samples),
            ("elastic.enabled", self.elastic.enabled),
        ):
            if value:
                raise ValueError(f"{key}=true needs the built-in data pipeline" + fix.format(key=key))
        if self.data.mmap_cache:
            self.data = dataclasses.replace(self.data, mmap_cache=False)

    def fault_entries(self) -> list[FaultConfig]:
        """The targeted faults of ``fault`` (a plan's entries, or the one fault; none for random/none)."""
        if self.fault.type == "plan":
            return self.fault.plan_entries()
        return [self.fault] if self.fault.type not in ("none", "random", "chaos") else []

    def _check_redundancy(self) -> None:
        """Tier 4 needs a live copy of every shard somewhere else; fail before ranks start if not."""
        cluster, rep = self.cluster, self.replication
        source = rep.resolved_source(cluster.replicate)
        if source == "hsdp" and cluster.replicate < 2:
            raise ValueError(
                "tier=4 with replication.source=hsdp needs cluster.replicate >= 2 (a replica of every "
                f"shard), got cluster.replicate={cluster.replicate}; set cluster.replicate=2 (HSDP) "
                "or replication.source=buddy"
            )
        if cluster.world_size < 2:
            raise ValueError(
                f"tier=4 keeps each rank's state in another rank's memory, and this job has one rank "
                f"(cluster.nnodes={cluster.nnodes}, cluster.nproc_per_node={cluster.nproc_per_node}): "
                "use tier=3 (in-process recovery from disk checkpoints) or 2 ranks or more"
            )
        if source == "buddy":
            from ckless_lightning.replication.source_map import buddy_survives_node_loss

            offset = rep.resolved_offset(cluster.nnodes, cluster.nproc_per_node)
            if offset % cluster.world_size == 0:
                raise ValueError(
                    f"replication.buddy_offset={offset} makes every rank its own buddy "
                    f"(world size {cluster.world_size}); use an offset in 1..{cluster.world_size - 1}, "
                    "or null for the default"
                )
            if cluster.nnodes >= 2 and not buddy_survives_node_loss(
                offset, cluster.nnodes, cluster.nproc_per_node
            ):
                raise ValueError(
                    f"replication.buddy_offset={offset} puts some rank's buddy on its own node "
                    f"(cluster.nproc_per_node={cluster.nproc_per_node}), so a node loss would take a "
                    "shard and its copy together; use a multiple of cluster.nproc_per_node "
                    "(null picks the next node)"
                )

    def resolved_vote(self) -> str:
        """What ``comm.vote=auto`` is for this job: ``collective`` (no store request per step), but
        ``store`` where the vote carries the HSDP replicas' state digest (tiers 3-4,
        ``cluster.replicate >= 2``, ``replication.digest_every > 0``), in an elastic job (the
        collective has not run its grows and shrinks), and at tiers 0-2 (no vote)."""
        digest = self.cluster.replicate >= 2 and self.replication.digest_every > 0
        if self.tier < 3 or digest or self.elastic.enabled:
            return "store"
        return "collective"

    def _check_elastic(self) -> None:
        """Elastic HSDP's needs: tier 4's replica restore, and a global batch every width divides."""
        cluster, elastic = self.cluster, self.elastic
        if (
            self.tier != 4
            or cluster.replicate < 2
            or self.replication.resolved_source(cluster.replicate) != "hsdp"
        ):
            raise ValueError(
                "elastic.enabled needs tier=4, cluster.replicate >= 2 and replication.source=hsdp (a replica "
                f"that rejoins takes its state from a live one); got tier={self.tier}, "
                f"cluster.replicate={cluster.replicate}, replication.source={self.replication.source}"
            )
        if not elastic.min_replicas < cluster.replicate:
            raise ValueError(
                f"elastic.min_replicas={elastic.min_replicas} leaves no replica to lose with "
                f"cluster.replicate={cluster.replicate}; choose 1..{cluster.replicate - 1}"
            )
        for replicas in range(elastic.min_replicas, cluster.replicate + 1):
            per_step = self.data.micro_batch_size * replicas * cluster.shard
            if self.trainer.global_batch_size % per_step:
                raise ValueError(
                    f"trainer.global_batch_size={self.trainer.global_batch_size} does not divide into "
                    f"{replicas} replicas x {cluster.shard} ranks x data.micro_batch_size="
                    f"{self.data.micro_batch_size}, a width elastic.min_replicas={elastic.min_replicas} "
                    "allows; "
                    f"use a multiple of {per_step} or raise elastic.min_replicas"
                )
        if self.agent.replace_timeout >= self.comm.join_timeout_s:
            raise ValueError(
                f"agent.replace_timeout={self.agent.replace_timeout:g} must be shorter than "
                f"comm.join_timeout_s={self.comm.join_timeout_s:g}: the join barrier gives the job up first"
            )

    @property
    def accumulate_grad_batches(self) -> int:
        return self.accumulate_at(self.cluster.world_size)

    def accumulate_at(self, dp_size: int) -> int:
        """Micro-batches per optimizer step at data-parallel width ``dp_size`` (elastic: fewer ranks,
        more micro-batches, the same global batch)."""
        return self.trainer.global_batch_size // (self.data.micro_batch_size * dp_size)

    def fault_specs(self) -> list[FaultSpec]:
        """The job's fault schedule (``fault:``), the same on every rank and agent."""
        return plan_faults(
            self.fault,
            world_size=self.cluster.world_size,
            nnodes=self.cluster.nnodes,
            nproc_per_node=self.cluster.nproc_per_node,
            max_steps=self.trainer.max_steps,
        )


def build_section(cls: type, values: dict[str, Any] | None, key: str) -> Any:
    """Build dataclass ``cls`` from ``values``; unknown keys raise ValueError naming ``key.<name>``."""
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(f'{key}.{name}' for name in unknown)}; "
            f"known keys under {key}: {', '.join(sorted(known))}"
        )
    for name, value in values.items():
        _check_type(cls, name, value, key)
    return cls(**values)


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _check_type(cls: type, name: str, value: Any, key: str) -> None:
    """A value of a plain type (int, float, bool, str, a list, each possibly null) that is not one is a
    config error naming ``key.name`` (a dataclass would take it and fail later with a traceback)."""
    try:
        hint = typing.get_type_hints(cls).get(name)
    except Exception:  # an annotation this module cannot resolve: the dataclass checks it itself
        return
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return
    plain = [t for t in allowed if t in _KINDS or typing.get_origin(t) in (list, tuple) or t in (list, tuple)]
    if not plain or len(plain) != len([t for t in allowed if t is not type(None)]):
        return  # Any, a nested dataclass, a Literal...: not checked here
    for kind in plain:
        origin = typing.get_origin(kind) or kind
        if origin in (list, tuple) and isinstance(value, list | tuple):
            return
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if kind in (bool, str) and isinstance(value, kind):
            return
    wanted = " or ".join(_KINDS.get(t, "a list") for t in plain)
    if type(None) in allowed:
        wanted += " or null"
    raise ValueError(f"{key}.{name} must be {wanted}, got {value!r}")


def _instantiate_model(values: dict[str, Any]) -> Any:
    from hydra.utils import get_class

    values = dict(values)
    target = values.pop("_target_", None)
    if target is None:
        raise ValueError(
            "model._target_ is missing: a recipe must name the model family's config class, "
            "e.g. ckless_lightning.models.Llama3Config"
        )
    try:
        cls = get_class(target)
    except Exception as err:
        raise ValueError(f"model._target_={target!r} cannot be imported: {err}") from err
    return build_section(cls, values, "model")


def load_job_config(path: str | Path) -> JobConfig:
    """The resolved YAML that launch.py (or the runner) wrote into the run directory, validated."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(container, dict)
    return job_config_from_dict(container)  # type: ignore[arg-type]


def job_config_from_dict(cfg: dict[str, Any]) -> JobConfig:
    """Validate a resolved config (``OmegaConf.to_container(cfg, resolve=True)``) into a JobConfig."""
    from ckless_lightning.models import FSDPConfig

    known_top = {
        "recipe",
        "model",
        "fsdp",
        "data",
        "optim",
        "trainer",
        "cluster",
        "checkpoint",
        "run_dir",
        "seed",
        "dry_run",
        "timeline",
        "tier",
        "fault",
        "agent",
        "comm",
        "replication",
        "elastic",
        "logger",
        "k8s",
        "module",
        "datamodule",
        "script",
    }
    unknown = sorted(set(cfg) - known_top)
    if unknown:
        raise ValueError(
            f"unknown top-level config key(s): {', '.join(unknown)}; known: {', '.join(sorted(known_top))}"
        )
    model = cfg.get("model")
    return JobConfig(
        recipe=str(cfg.get("recipe", "")),
        model=None if model in (None, "???") else _instantiate_model(model),
        fsdp=build_section(FSDPConfig, cfg.get("fsdp"), "fsdp"),
        data=build_section(DataConfig, cfg.get("data"), "data"),
        optim=build_section(OptimConfig, cfg.get("optim"), "optim"),
        trainer=build_section(TrainerConfig, cfg.get("trainer"), "trainer"),
        cluster=build_section(ClusterConfig, cfg.get("cluster"), "cluster"),
        checkpoint=build_section(CheckpointConfig, cfg.get("checkpoint"), "checkpoint"),
        run_dir=str(cfg.get("run_dir", ".")),
        agent=build_section(AgentConfig, cfg.get("agent"), "agent"),
        comm=build_section(CommConfig, cfg.get("comm"), "comm"),
        fault=build_section(FaultConfig, cfg.get("fault"), "fault"),
        replication=build_section(ReplicationConfig, cfg.get("replication"), "replication"),
        elastic=build_section(ElasticConfig, cfg.get("elastic"), "elastic"),
        tier=int(cfg.get("tier", 0)),
        seed=int(cfg.get("seed", 1234)),
        dry_run=bool(cfg.get("dry_run", False)),
        timeline=cfg.get("timeline", True),
        logger=LoggerConfig.from_mapping(cfg["logger"]) if cfg.get("logger") is not None else None,
        k8s=build_section(K8sConfig, cfg.get("k8s"), "k8s"),
        module=ComponentConfig.from_mapping("module", cfg.get("module"), BUILTIN_MODULE),
        datamodule=ComponentConfig.from_mapping("datamodule", cfg.get("datamodule"), BUILTIN_DATAMODULE),
        script=_script(cfg.get("script")),
    )


def _script(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(arg, str) for arg in value):
        raise ValueError(
            f"script must be a list of strings (the script's path and its arguments), got {value!r}; "
            "python -m ckless_lightning.run sets it"
        )
    return list(value)
