"""A LightningModule and LightningDataModule of one's own, trained under the agent at any tier.

Nothing here comes from ckless_lightning but one helper (``data_parallel_mesh``, the mesh to hand
FSDP2): an MLP regressor on synthetic data, written as any Lightning user would. What the tiers
need of it (docs/own_module.md):

- ``configure_model`` shards the parameters with FSDP2 over the strategy's mesh
  (``self.device_mesh``), so that every rank holds a shard (tier 4 copies shards);
- the weights are drawn in ``__init__`` from torch's global RNG, which the job seeds (``seed``);
- ``train_dataloader`` returns a ``StatefulDataLoader`` (a plain ``DataLoader`` over a map-style
  dataset works too): its position is saved with every step and restored after a fault.

Used by ``conf/recipes/own_module.yaml`` (``launch.py``) and ``train.py`` (the runner).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ckless_lightning.models import data_parallel_mesh

__all__ = ["MLPRegressor", "RegressionData", "ResidualMLP"]


class ResidualMLP(nn.Module):
    """``depth`` residual blocks of LayerNorm-Linear-GELU-Linear between an input and an output layer."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, depth: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(in_dim, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden),
                nn.Linear(hidden, hidden),
                nn.GELU(),
                nn.Dropout(dropout),
                nn.Linear(hidden, hidden),
            )
            for _ in range(depth)
        )
        self.out = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class MLPRegressor(pl.LightningModule):
    """A ResidualMLP trained on mean-squared error with AdamW and a cosine schedule."""

    def __init__(
        self,
        in_dim: int = 32,
        hidden: int = 256,
        out_dim: int = 8,
        depth: int = 4,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        max_steps: int = 100,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = ResidualMLP(in_dim, hidden, out_dim, depth, dropout)

    def configure_model(self) -> None:
        if isinstance(self.net.inp.weight, DTensor) or self.device_mesh is None:
            return  # sharded already, or not under a model-parallel strategy
        mesh = data_parallel_mesh(self.device_mesh)
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)  # the rest (inp, out) as one group

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class RegressionData(pl.LightningDataModule):
    """``num_samples`` pairs (x, tanh(x W) + noise) from a fixed seed, the same on every rank;
    the strategy gives each rank its part (a DistributedSampler it adds, seeded by the job)."""

    def __init__(
        self, num_samples: int = 8192, in_dim: int = 32, out_dim: int = 8, batch_size: int = 8, seed: int = 7
    ) -> None:
        super().__init__()
        self.num_samples, self.in_dim, self.out_dim = num_samples, in_dim, out_dim
        self.batch_size, self.seed = batch_size, seed
        self.dataset: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.num_samples, self.in_dim, generator=gen)
        teacher = torch.randn(self.in_dim, self.out_dim, generator=gen) / self.in_dim**0.5
        y = torch.tanh(x @ teacher) + 0.05 * torch.randn(self.num_samples, self.out_dim, generator=gen)
        self.dataset = TensorDataset(x, y)

    def train_dataloader(self) -> StatefulDataLoader:
        assert self.dataset is not None
        return StatefulDataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)
