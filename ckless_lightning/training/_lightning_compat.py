"""The one place that touches private Lightning APIs (written against Lightning 2.6.6).

Why: ``ModelParallelStrategy`` builds a fixed 2-D ("data_parallel",
"tensor_parallel") mesh inside ``setup_environment`` and stores it in private
attributes; HSDP needs a ("replicate", "shard") mesh instead. Lightning has no
public hook for a custom mesh, so the strategy calls these two helpers.
Tier 4 also needs Lightning's own checkpoint dict of the current state
(loops, callbacks, schedulers, data position) after every committed step,
without writing a file: ``dump_training_state`` calls the Trainer's checkpoint
connector, the same code ``trainer.save_checkpoint`` runs. Re-check these
helpers when upgrading Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["dump_training_state", "init_distributed", "install_device_mesh"]


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
