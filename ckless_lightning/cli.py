"""What ``launch.py`` does with a composed config: validate, plan, prepare data, start ranks, report.

Every check that can fail runs here, before any rank starts; then this
node's agent supervises the ranks. Exit codes: 0 done; 2 bad config or data
(the message names the key or the file); 3 the recipe does not fit this
machine; 75 the fault budget is spent (requeue); 130/143 interrupted.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from ckless_lightning.runtime.contract import ExitCode

if TYPE_CHECKING:
    from ckless_lightning.agent.fork_server import ForkServer
    from ckless_lightning.agent.peer_reach import ReachListener
    from ckless_lightning.runtime.config import JobConfig

__all__ = ["command_line_keys", "run_job"]


def command_line_keys() -> set[str]:
    """The keys the running Hydra app's command line set (``run_job``'s ``explicit``); call it from
    the ``@hydra.main`` function (launch.py's, the runner's)."""
    from hydra.core.hydra_config import HydraConfig

    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}


def _error(kind: str, err: BaseException) -> None:
    print(f"{kind}: {err}", file=sys.stderr)


def run_job(cfg: DictConfig, *, env: Mapping[str, str] | None = None, explicit: Collection[str] = ()) -> int:
    """Run the job ``cfg`` describes on this node; returns the exit code.

    ``env``: the launcher's environment (a scheduler's variables, the job store's secret;
    ``launch.py`` passes ``os.environ``); ``explicit``: the keys set on the command line, which
    a scheduler's values never override.
    """
    env = {} if env is None else env
    # Validation imports no torch (about a second): a bad value is reported before anything starts.
    from ckless_lightning.runtime.config import job_config_from_dict

    try:
        _place_from_scheduler(cfg, env, explicit)
        container: Any = OmegaConf.to_container(cfg, resolve=True)
        job = job_config_from_dict(container)
        _check_data_source(job)
    except (ValueError, FileNotFoundError) as err:
        _error("config error", err)
        return ExitCode.CONFIG
    fork_server = _start_fork_server(job)
    try:
        return _run_job(job, container, fork_server, env)
    finally:
        if fork_server is not None:
            fork_server.close()


def _check_data_source(job: JobConfig) -> None:
    """``data.source`` names files of a format the built-in pipeline reads (torch-free: before
    the fork server starts)."""
    if job.datamodule.builtin and job.script is None and job.data.source is not None:
        from ckless_lightning.data.source import resolve_source

        resolve_source(job.data)


def _place_from_scheduler(cfg: DictConfig, env: Mapping[str, str], explicit: Collection[str]) -> None:
    """Fill ``cluster.node_rank``/``nnodes``/``master_addr``/``master_port`` from Slurm (see
    :mod:`ckless_lightning.runtime.launcher`) and say so."""
    from ckless_lightning.runtime.launcher import place_from_scheduler

    cluster = OmegaConf.select(cfg, "cluster")
    if cluster is None:
        return
    changes = place_from_scheduler(OmegaConf.to_container(cluster, resolve=True), env, explicit=explicit)
    for key, value in changes.items():
        OmegaConf.update(cfg, f"cluster.{key}", value)
    if changes:
        placed = " ".join(f"cluster.{k}={v}" for k, v in changes.items())
        print(f"slurm: {placed} (from SLURM_*; cluster.launcher=manual to turn off)")


def _start_fork_server(job: JobConfig) -> ForkServer | None:
    """With ``agent.fork_server`` (and not a dry run or a ``k8s.render``), start it now, once the
    config is valid: its imports of torch and Lightning run while this process plans, prepares the
    data and starts the store. None when it is off, or when ``run_dir`` cannot be created (reported
    next)."""
    if not job.agent.fork_server or job.dry_run or job.k8s.render:
        return None
    from ckless_lightning.agent.fork_server import ForkServer

    # A standby agent has a node number only once it takes a node over.
    node = f".standby{os.getpid()}" if job.cluster.standby else job.cluster.node_rank
    try:
        log_dir = Path(job.run_dir) / "rank_logs"
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    server = ForkServer(log_dir / f"forkserver{node}.log")
    server.start()
    return server


def _run_job(
    job: JobConfig, container: dict[str, Any], fork_server: ForkServer | None, env: Mapping[str, str]
) -> int:
    from ckless_lightning.comm.secret import job_secret

    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Nodes of one job may share the run directory: node 0 owns config.yaml.
    node = job.cluster.node_rank
    config_path = run_dir / ("config.yaml" if node == 0 else f"config.node{node}.yaml")
    if job.cluster.standby:
        config_path = run_dir / f"config.standby{os.getpid()}.yaml"
    OmegaConf.save(OmegaConf.create(container), config_path)

    from ckless_lightning.runtime.memory_plan import (
        available_bytes_per_rank,
        check_fits,
        host_bytes_per_rank,
        plan_job,
        state_on_gpu,
    )

    plan = plan_job(job)
    if job.dry_run:
        print(plan.format())
        print(f"resolved config: {config_path}")
        print(
            "to start the ranks yourself: torchrun --nnodes "
            f"{job.cluster.nnodes} --nproc-per-node {job.cluster.nproc_per_node} "
            f"-m ckless_lightning.rank --config {shlex.quote(str(config_path))}"
        )
        return 0
    if job.k8s.render:
        return _render_k8s(job, container, plan)

    available, source = available_bytes_per_rank(job.cluster.accelerator, job.cluster.nproc_per_node)
    gpu = state_on_gpu(job.cluster.accelerator)
    host = host_bytes_per_rank(job.cluster.nproc_per_node) if gpu else None
    try:
        check_fits(plan, available, source, host_available=host)
    except MemoryError as err:
        _error("refused", err)
        if not gpu:
            print(
                f"no GPU here: cluster.accelerator={job.cluster.accelerator} found no CUDA device, so the "
                "state would live in host RAM; on this machine try recipe=llama3_tiny (sized for a "
                "2-core CPU), or see this recipe's plan with dry_run=true",
                file=sys.stderr,
            )
        return ExitCode.DOES_NOT_FIT

    from ckless_lightning.data import prepare_dataset
    from ckless_lightning.runtime.checkpointing import checkpoint_step, resolve_resume
    from ckless_lightning.runtime.memory_plan import resolve_accelerator

    try:
        resolve_accelerator(job.cluster.accelerator)
        _check_bitflip_tensors(job)
        job.module.check()
        job.datamodule.check()
        # The built-in pipeline is prepared (tokenized, packed) here, once; a user's DataModule
        # prepares its own data in its hooks, in the ranks.
        _check_tokenizer(job)
        builtin_data = job.datamodule.builtin and job.script is None
        prepared = prepare_dataset(job.data) if builtin_data else None
        global_batch = job.data.micro_batch_size * job.cluster.world_size
        if prepared is not None and prepared.num_samples < global_batch:
            raise ValueError(
                f"data.source has {prepared.num_samples} sequences of "
                f"data.seq_len={job.data.seq_len}+1 tokens, "
                f"fewer than one step needs ({global_batch}); give more data or lower data.seq_len"
            )
        resume = resolve_resume(job.checkpoint.resume, job.checkpoint.dir)
        # A one-node job whose agent hosts the store makes its secret; other agents must be given it.
        alone = job.cluster.nnodes == 1 and job.cluster.store is None
        secret = job_secret(
            env,
            may_generate=alone,
            why_needed=f"cluster.nnodes={job.cluster.nnodes}"
            if job.cluster.store is None
            else f"cluster.store={job.cluster.store}",
        )
    except (ValueError, FileNotFoundError) as err:
        _error("config error", err)
        return ExitCode.CONFIG

    print(plan.format())
    if prepared is not None:
        print(f"data: {prepared.num_samples:,} sequences ({prepared.num_tokens:,} tokens) in {prepared.path}")
    elif job.script is not None:
        print(f"script: {shlex.join(job.script)} (runs as each rank; its own data, no batch cache)")
    else:
        print(f"data: {job.datamodule.target} (your DataModule; no batch cache)")
    print(f"resuming from {resume}" if resume else "starting from step 0")
    listener = _reach_listener(job, env)
    try:
        if job.cluster.standby:
            taken = _stand_by(job, container, run_dir, secret, listener)
            if taken is None:
                return 0
            job, config_path = taken
            resume = resolve_resume(job.checkpoint.resume, job.checkpoint.dir)
        start_step = checkpoint_step(resume) if resume else 0
        code = _run_agent(
            job, config_path, prepared and prepared.path, start_step, fork_server, secret, listener
        )
    finally:
        if listener is not None:
            listener.close()
    _report(job, run_dir, code)
    return code


def _reach_listener(job: Any, env: Mapping[str, str]) -> ReachListener | None:
    """Multi-node jobs with ``agent.peer_probe``: this agent's :class:`ReachListener` on its node's
    peer address (``agent/peer_reach.py``); None otherwise, or when that address cannot be found."""
    if job.cluster.nnodes < 2 or not job.agent.peer_probe:
        return None
    from ckless_lightning.agent.peer_reach import ReachListener, peer_host

    try:
        return ReachListener(peer_host(env))
    except OSError as err:
        print(
            f"warning: no peer probes from this node ({err}): a node cut off from the others but not from "
            "the store is found by the hang timeout alone; set GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) "
            "to the interface the ranks use, or agent.peer_probe=false to silence this",
            file=sys.stderr,
        )
        return None


def _stand_by(
    job: Any, container: dict[str, Any], run_dir: Path, secret: str, listener: ReachListener | None
) -> tuple[Any, Path] | None:
    """``cluster.standby``: wait, prepared, until a node goes silent, then become its agent: the job
    as that node's (and its config file), or None when the job ended without needing this one.
    ``listener``: answers the node agents' peer probes meanwhile (None: none)."""
    from ckless_lightning.agent.standby import stand_by
    from ckless_lightning.runtime.config import job_config_from_dict

    host, port = job.cluster.store_address
    print(f"standing by: taking the place of any of the {job.cluster.nnodes} nodes that goes silent")
    node = stand_by(
        host,
        port,
        secret=secret,
        nnodes=job.cluster.nnodes,
        node_timeout_s=job.agent.node_timeout,
        agent_id=f"{socket.gethostname()}:{os.getpid()}",
        interval_s=job.agent.store_interval,
        reach_address=listener.address if listener is not None else None,
    )
    if node is None:
        print("standby: the job ended without needing this agent")
        return None
    print(f"standby: node {node} went silent; this agent takes its place")
    container["cluster"] = {**container["cluster"], "node_rank": node, "standby": False}
    config_path = run_dir / f"config.node{node}.standby{os.getpid()}.yaml"
    OmegaConf.save(OmegaConf.create(container), config_path)
    return job_config_from_dict(container), config_path


def _render_k8s(job: Any, container: dict[str, Any], plan: Any) -> int:
    """``k8s.render=DIR``: write the job's Kubernetes manifests to DIR; no rank starts, no data is read."""
    from ckless_lightning.deploy.k8s import render_manifests, render_notes

    out_dir = Path(job.k8s.render).expanduser()
    try:
        written = render_manifests(job, container, out_dir, plan=plan)
    except (ValueError, OSError) as err:  # OSError: k8s.render cannot be written
        _error("config error", err)
        return ExitCode.CONFIG
    print(plan.format())
    for path in written:
        print(f"wrote {path}")
    for note in render_notes(job):
        print(f"note: {note}")
    print(f"to start the job: kubectl apply -f {shlex.quote(str(out_dir))}")
    return 0


def _run_agent(
    job: Any,
    config_path: Path,
    prepared_path: Path | None,
    start_step: int,
    fork_server: ForkServer | None,
    secret: str,
    listener: ReachListener | None = None,
) -> int:
    from ckless_lightning.agent.node_agent import NodeAgent

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signum)

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return NodeAgent(
            job,
            config_path,
            prepared_path=prepared_path,
            secret=secret,
            start_step=start_step or 0,
            fork_server=fork_server,
            reach_listener=listener,
        ).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report(job: Any, run_dir: Path, code: int) -> None:
    from ckless_lightning.record.ending import what_next
    from ckless_lightning.record.events import read_events
    from ckless_lightning.record.loss_log import read_loss_records, read_losses
    from ckless_lightning.record.summary import summarize
    from ckless_lightning.runtime.checkpointing import latest_checkpoint

    losses = read_losses(run_dir / "losses.jsonl")
    events_path = run_dir / "events.jsonl"
    timeline: Path | None = None
    summary = None
    print()
    if job.cluster.node_rank == 0 and events_path.exists():
        summary = summarize(read_events(events_path), read_loss_records(run_dir / "losses.jsonl"))
        print(summary.format())
        print()
        timeline = _draw_timeline(run_dir) if job.timeline else None
    print("done" if code == 0 else f"failed (exit code {code})")
    if losses:
        first, last = min(losses), max(losses)
        print(f"loss: step {first}: {losses[first]:.4f} -> step {last}: {losses[last]:.4f}")
    print(f"run dir:      {run_dir}")
    print(f"config:       {run_dir / 'config.yaml'}")
    print(f"losses:       {run_dir / 'losses.jsonl'}")
    print(f"events:       {events_path}")
    if timeline is not None:
        print(f"timeline:     {timeline}")
    print(f"metrics:      {_metrics_location(job)}")
    print(f"rank logs:    {run_dir / 'rank_logs'}/rank<N>.log")
    print(f"checkpoints:  {job.checkpoint.dir}")
    if summary is not None:  # last: what the scheduler does now, and what the operator can change
        latest = latest_checkpoint(job.checkpoint.dir)
        for line in what_next(summary, None if latest is None else str(latest)):
            print(line)


def _metrics_location(job: Any) -> str:
    """Where the chosen logger (the ``logger`` group) writes the metrics."""
    logger = job.logger
    kwargs = logger.kwargs
    save_dir = kwargs.get("save_dir", job.run_dir)
    if logger.target.endswith("CSVLogger"):
        return f"{Path(save_dir) / kwargs.get('name', 'lightning_logs')}/version_<N>/metrics.csv"
    if logger.target.endswith("TensorBoardLogger"):
        return f"{Path(save_dir) / kwargs.get('name', 'lightning_logs')}/version_<N>/ (TensorBoard events)"
    if logger.target.endswith("MLFlowLogger"):
        return f"{kwargs.get('tracking_uri', 'mlruns')} (MLflow)"
    if logger.target.endswith("WandbLogger"):
        return f"{Path(save_dir) / 'wandb'} (W&B)"
    return f"{logger.target} (see its documentation)"


def _draw_timeline(run_dir: Path) -> Path | None:
    """``<run_dir>/timeline.png``, or ``None`` after a one-line warning: the picture never fails the job."""
    from ckless_lightning.record.timeline_plot import render_timeline

    try:
        return render_timeline(run_dir)
    except (ImportError, ValueError, OSError) as err:
        print(f"warning: no timeline picture ({type(err).__name__}: {err})", file=sys.stderr)
        return None


def _check_tokenizer(job: JobConfig) -> None:
    """``data.tokenizer`` loads, and the model's embedding holds every id it emits."""
    if job.data.tokenizer is None or not job.datamodule.builtin:
        return
    from ckless_lightning.data import check_vocab
    from ckless_lightning.data.hf_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(job.data.tokenizer)
    print(
        f"tokenizer: {job.data.tokenizer} ({tokenizer.vocab_size:,} ids, end of text {tokenizer.eod_token})"
    )
    if job.model is not None:
        check_vocab(tokenizer.vocab_size, job.model.vocab_size)


def _check_bitflip_tensors(job: JobConfig) -> None:
    """A ``bitflip`` fault's ``tensor`` names a parameter of the model (built on the meta device), so
    that a typo fails here rather than inside a rank in the middle of training."""
    wanted = {f.tensor for f in job.fault_entries() if f.type == "bitflip" and f.tensor is not None}
    if not wanted or job.model is None:  # a user's module: its names are known once a rank built it
        return
    import torch

    from ckless_lightning.models import build_model

    with torch.device("meta"):
        names = sorted(name for name, _ in build_model(job.model).named_parameters())
    unknown = sorted(wanted - set(names))
    if unknown:
        raise ValueError(
            f"fault.tensor={unknown[0]!r} is not a parameter of {job.recipe}'s model; some are: "
            f"{', '.join(names[:6])}, ...; fault.tensor=null takes the first by name"
        )
