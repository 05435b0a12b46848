"""What ``launch.py`` does with a composed config: validate, plan, prepare data, start ranks, report.

Every check that can fail runs here, before any rank starts; then this
node's agent supervises the ranks. Exit codes: 0 done; 2 bad config or data
(the message names the key or the file); 3 the recipe does not fit this
machine; 75 the fault budget is spent (requeue); 130/143 interrupted.
"""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from ckless_lightning.runtime.contract import ExitCode

if TYPE_CHECKING:
    from ckless_lightning.agent.fork_server import ForkServer

__all__ = ["run_job"]


def _error(kind: str, err: BaseException) -> None:
    print(f"{kind}: {err}", file=sys.stderr)


def run_job(cfg: DictConfig) -> int:
    fork_server = _start_fork_server(cfg)
    try:
        return _run_job(cfg, fork_server)
    finally:
        if fork_server is not None:
            fork_server.close()


def _start_fork_server(cfg: DictConfig) -> ForkServer | None:
    """With ``agent.fork_server`` (and not a dry run), start it now, from the composed config: its
    imports of torch and Lightning run while this process validates, plans and prepares the data.
    None when it is off, or when ``run_dir`` cannot be created (validation reports that)."""
    if not OmegaConf.select(cfg, "agent.fork_server", default=True) or OmegaConf.select(
        cfg, "dry_run", default=False
    ):
        return None
    from ckless_lightning.agent.fork_server import ForkServer

    node = OmegaConf.select(cfg, "cluster.node_rank", default=0)
    try:
        log_dir = Path(str(cfg.run_dir)) / "rank_logs"
        log_dir.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError):
        return None
    server = ForkServer(log_dir / f"forkserver{node}.log")
    server.start()
    return server


def _run_job(cfg: DictConfig, fork_server: ForkServer | None) -> int:
    from ckless_lightning.runtime.config import job_config_from_dict

    try:
        container: Any = OmegaConf.to_container(cfg, resolve=True)
        job = job_config_from_dict(container)
    except ValueError as err:
        _error("config error", err)
        return ExitCode.CONFIG

    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Nodes of one job may share the run directory: node 0 owns config.yaml.
    node = job.cluster.node_rank
    config_path = run_dir / ("config.yaml" if node == 0 else f"config.node{node}.yaml")
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

    available, source = available_bytes_per_rank(job.cluster.accelerator, job.cluster.nproc_per_node)
    gpu = state_on_gpu(job.cluster.accelerator)
    host = host_bytes_per_rank(job.cluster.nproc_per_node) if gpu else None
    try:
        check_fits(plan, available, source, host_available=host)
    except MemoryError as err:
        _error("refused", err)
        return ExitCode.DOES_NOT_FIT

    from ckless_lightning.data import prepare_dataset
    from ckless_lightning.runtime.checkpointing import checkpoint_step, resolve_resume
    from ckless_lightning.runtime.memory_plan import resolve_accelerator

    try:
        resolve_accelerator(job.cluster.accelerator)
        prepared = prepare_dataset(job.data)
        global_batch = job.data.micro_batch_size * job.cluster.world_size
        if prepared.num_samples < global_batch:
            raise ValueError(
                f"data.source has {prepared.num_samples} sequences of "
                f"data.seq_len={job.data.seq_len}+1 tokens, "
                f"fewer than one step needs ({global_batch}); give more data or lower data.seq_len"
            )
        resume = resolve_resume(job.checkpoint.resume, job.checkpoint.dir)
    except (ValueError, FileNotFoundError) as err:
        _error("config error", err)
        return ExitCode.CONFIG

    print(plan.format())
    print(f"data: {prepared.num_samples:,} sequences ({prepared.num_tokens:,} tokens) in {prepared.path}")
    print(f"resuming from {resume}" if resume else "starting from step 0")
    code = _run_agent(job, config_path, prepared.path, checkpoint_step(resume) if resume else 0, fork_server)
    _report(job, run_dir, code)
    return code


def _run_agent(
    job: Any, config_path: Path, prepared_path: Path, start_step: int, fork_server: ForkServer | None
) -> int:
    from ckless_lightning.agent.node_agent import NodeAgent

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signum)

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return NodeAgent(
            job, config_path, prepared_path=prepared_path, start_step=start_step or 0, fork_server=fork_server
        ).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report(job: Any, run_dir: Path, code: int) -> None:
    from ckless_lightning.record.events import read_events
    from ckless_lightning.record.loss_log import read_loss_records, read_losses
    from ckless_lightning.record.summary import summarize

    losses = read_losses(run_dir / "losses.jsonl")
    events_path = run_dir / "events.jsonl"
    timeline: Path | None = None
    print()
    if job.cluster.node_rank == 0 and events_path.exists():
        print(summarize(read_events(events_path), read_loss_records(run_dir / "losses.jsonl")).format())
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
