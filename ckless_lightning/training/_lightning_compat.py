"""The one place that touches private Lightning APIs (written against Lightning 2.6.6).

Why: ``ModelParallelStrategy`` builds a fixed 2-D ("data_parallel",
"tensor_parallel") mesh inside ``setup_environment`` and stores it in private
attributes; HSDP needs a ("replicate", "shard") mesh instead. Lightning has no
public hook for a custom mesh, so the strategy calls these two helpers.
Tier 4 also needs Lightning's own checkpoint dict of the current state
(loops, callbacks, schedulers, data position) after every committed step,
without writing a file: ``dump_training_state`` calls the Trainer's checkpoint
connector, the same code ``trainer.save_checkpoint`` runs. An elastic job resumes a
checkpoint at another gradient accumulation, and Lightning counts micro-batches in the fit
loop's state (an optimizer step ends when that count divides by the accumulation):
``rescale_micro_batches`` rewrites those counters in the checkpoint dict. ``ModelCheckpoint``
keeps the step it saved last only in a private attribute its checkpoint state leaves out, so a
resumed fit would write the checkpoint it resumed from again: ``mark_checkpoint_saved`` sets it
(``training/callbacks/step_checkpoint.py``). Re-check these helpers when upgrading Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "dump_training_state",
    "init_distributed",
    "install_device_mesh",
    "mark_checkpoint_saved",
    "rescale_micro_batches",
]


def init_distributed(strategy: ModelParallelStrategy) -> None:
    """Set up the accelerator and the default process group the way ModelParallelStrategy does."""
    strategy._setup_distributed()


def install_device_mesh(strategy: ModelParallelStrategy, mesh: DeviceMesh) -> None:
    """Make ``mesh`` the strategy's ``device_mesh`` and the LightningModule's ``device_mesh``."""
    strategy._device_mesh = mesh
    assert strategy.lightning_module is not None
    strategy.lightning_module._device_mesh = mesh


def dump_training_state(trainer: pl.Trainer) -> dict:
    """The dict ``trainer.save_checkpoint`` would write now (weights as the strategy gives them)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def rescale_micro_batches(checkpoint: dict, saved: int, now: int) -> None:
    """In place: the fit loop's micro-batch counters of ``checkpoint``, saved at ``saved`` micro-batches
    per optimizer step, as they would read at ``now`` (Lightning 2.6.6: ``loops.fit_loop``'s
    ``epoch_loop.batch_progress``; optimizer steps are counted elsewhere and stay).

    A checkpoint taken within the last micro-batch's end hooks (tier 4's snapshot) has that batch
    ready, started and processed but not yet completed: each counter is the optimizer steps done
    times ``saved``, or one less; the same lag is kept at ``now``.
    """
    loop = checkpoint["loops"]["fit_loop"]
    steps = loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"][
        "completed"
    ]
    progress = loop["epoch_loop.batch_progress"]
    for counter, total in progress["total"].items():
        lag = total - steps * saved
        earlier = total - progress["current"][counter]  # micro-batches of earlier epochs
        if lag not in (-1, 0) or earlier % saved:
            raise ValueError(
                f"the checkpoint's fit loop counted {total} micro-batches ({counter}) for {steps} optimizer "
                f"steps at {saved} per step: not between two steps, so it cannot resume at {now} per step"
            )
        progress["total"][counter] = steps * now + lag
        progress["current"][counter] = progress["total"][counter] - earlier // saved * now


def mark_checkpoint_saved(callback: ModelCheckpoint, step: int) -> None:
    """Make ``callback`` count ``step`` as the step it saved last (it then skips saving that step)."""
    callback._last_global_step_saved = step
