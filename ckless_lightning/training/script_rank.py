"""A script of one's own as the job's ranks (``python -m ckless_lightning.run``), and its one call.

The runner starts the node agent as ``launch.py`` does; each rank process (cold, a warm spare
or forked by the fork server) runs the script as ``__main__`` (:func:`run_script`), with
the runner's resolved config named in ``CKLESS_JOB_CONFIG``. The script builds its module
and data as any Lightning script does and hands them to :func:`fit` where it would write
``pl.Trainer(...).fit(model, datamodule)``::

    from ckless_lightning.run import fit

    model = MyModule()
    trainer = fit(model, datamodule=MyData(), max_steps=1000, callbacks=[...])

Why one call and not ``Trainer.fit``: a recovery in the same process (tiers 3-4) builds a new
Trainer, strategy and module for the next generation (FSDP2's sharded parameters and the
process groups belong to the ranks of the generation that made them; Lightning cannot move a
Trainer to new ones), so ``fit`` takes what a Trainer takes and builds them itself. It keeps a
copy of ``model`` as given (a generation that starts over starts from it): build a large model
in ``configure_model``, or pass a function that returns a new module.

Started without the runner (``python train.py``), :func:`fit` is plain Lightning: one
``Trainer(**trainer_kwargs).fit``, no recovery.
"""

from __future__ import annotations

import copy
import os
import runpy
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import nn

from ckless_lightning.runtime.config import JobConfig, load_job_config
from ckless_lightning.runtime.contract import ENV_JOB_CONFIG, RankContext, UsageError, UsageTypeError

__all__ = ["RESERVED_TRAINER_KEYS", "fit", "run_script"]

# Trainer arguments the job sets (its ranks, devices and recovery), with what to use instead.
RESERVED_TRAINER_KEYS: Mapping[str, str] = {
    "strategy": "the runner sets CheckpointlessStrategy: cluster.replicate=/cluster.shard= for the mesh",
    "plugins": "the runner sets the cluster environment from its ranks",
    "devices": "python -m ckless_lightning.run --nproc-per-node N",
    "num_nodes": "python -m ckless_lightning.run --nnodes N",
    "accelerator": "cluster.accelerator=cpu|gpu|auto on the runner's command line",
    "use_distributed_sampler": "the strategy shards your train loader itself (docs: own module)",
}


def run_script(job: JobConfig, config_path: str | Path) -> None:
    """Run ``job.script`` in this process as ``python SCRIPT ARGS`` would: as ``__main__``, with
    ``sys.argv`` and ``sys.path[0]`` set so, and the job's config in ``CKLESS_JOB_CONFIG`` for
    :func:`fit`. Exceptions and ``SystemExit`` propagate."""
    assert job.script is not None
    script, *args = job.script
    os.environ[ENV_JOB_CONFIG] = str(Path(config_path).resolve())
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def fit(
    model: pl.LightningModule | Callable[[], pl.LightningModule],
    datamodule: pl.LightningDataModule | None = None,
    *,
    ckpt_path: str | Path | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer | None:
    """Train ``model`` on this rank of the runner's job, recovering faults per the job's tier;
    returns the Trainer of the generation that finished (its ``lightning_module`` is the trained
    module; None: an elastic job's rank that stood by at the end).

    ``model``: a LightningModule (copied before training: each generation that starts over gets
    a fresh copy) or a function that builds one. ``datamodule``: as ``Trainer.fit``'s (None: the
    module's own ``train_dataloader``); its train loader is sharded and positioned by the
    strategy. ``ckpt_path``: where the job starts (None: the job's ``checkpoint.resume``, by
    default the latest checkpoint in ``checkpoint.dir``). ``trainer_kwargs``: ``pl.Trainer``'s,
    but those in :data:`RESERVED_TRAINER_KEYS` (ValueError naming the key and the fix).
    At tiers 3-4 the last generation's process group stays until the script ends (the rank
    process destroys it then, :func:`~ckless_lightning.training.rank_process.run_rank_process`).
    """
    reserved = sorted(set(trainer_kwargs) & set(RESERVED_TRAINER_KEYS))
    if reserved:
        key = reserved[0]
        raise UsageError(
            f"ckless_lightning.run.fit: {key}= is the job's to set; {RESERVED_TRAINER_KEYS[key]}"
        )
    make_module = _module_factory(model)
    config = os.environ.get(ENV_JOB_CONFIG)
    if config is None:
        print(
            "ckless_lightning.run.fit: not started by python -m ckless_lightning.run: plain Trainer.fit, "
            "no recovery",
            file=sys.stderr,
        )
        trainer = pl.Trainer(**trainer_kwargs)
        trainer.fit(make_module(), datamodule=datamodule, ckpt_path=ckpt_path)
        return trainer

    from ckless_lightning.training.job import ScriptParts, train_rank

    job = load_job_config(config)
    # A script that seeded itself (pl.seed_everything) keeps its seed; else the job's ``seed``.
    seeded = "PL_GLOBAL_SEED" in os.environ
    parts = ScriptParts(make_module, datamodule, dict(trainer_kwargs), ckpt_path=ckpt_path, seed=not seeded)
    return train_rank(job, RankContext.from_env(), parts)


def _module_factory(
    model: pl.LightningModule | Callable[[], pl.LightningModule],
) -> Callable[[], pl.LightningModule]:
    if isinstance(model, pl.LightningModule):
        pristine = copy.deepcopy(model)
        given = [model]  # the first generation trains the caller's own object, as Trainer.fit does

        def fresh() -> pl.LightningModule:
            return given.pop() if given else copy.deepcopy(pristine)

        return fresh
    if not callable(model) or isinstance(model, nn.Module):
        raise UsageTypeError(
            f"ckless_lightning.run.fit: model must be a LightningModule or a function returning one, got "
            f"{type(model).__name__}"
        )

    def built() -> pl.LightningModule:
        module = model()
        if not isinstance(module, pl.LightningModule):
            raise UsageTypeError(
                f"ckless_lightning.run.fit: model() returned a {type(module).__name__}, not a LightningModule"
            )
        return module

    return built
