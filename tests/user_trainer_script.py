"""A user's own training script with in-process recovery: their Trainer, their module, our few lines.

Nothing here comes from the package's recipes (``ckless_lightning.training``):
the model is a plain two-layer MLP, the LightningModule, the resumable loader
and the Trainer are written by hand, as a user of ``InProcessRecovery`` would.
The only package code used is the recovery loop itself (``from_env`` + ``fit``).

Run as one rank of a job whose environment names the job store
(CKLESS_STORE_ADDR/PORT, RANK, WORLD_SIZE, ...; see tests/test_user_trainer.py)::

    python tests/user_trainer_script.py --out DIR --steps 12 --fault-step 7 --fault-rank 1

``--fault-step N`` raises an exception on ``--fault-rank`` while it runs optimizer
step N (``global_step == N - 1``), once per ``DIR`` (0: no fault). At the end each
rank writes ``DIR/final_rank{r}.pt`` (its local parameter and AdamW state shards),
``DIR/losses_rank{r}.json`` (loss per optimizer step) and ``DIR/info_rank{r}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ckless_lightning.recovery import InProcessRecovery

IN_DIM, HIDDEN, OUT_DIM = 16, 32, 8
BATCH = 4
MODEL_SEED = 1234
DATA_SEED = 99


# -- the user's data: one batch per optimizer step, a pure function of (seed, step, rank) --------------
class StepLoader:
    """Yields ``{"x", "y", "step"}`` from ``next_step`` to ``max_steps``; Lightning saves/loads its position.

    ``next_step`` is the committed position: :class:`CommitDataPosition` sets it to
    ``global_step`` after every optimizer step (Lightning fetches one batch ahead, so
    the number of batches yielded is not the number trained on).
    """

    def __init__(self, *, seed: int, rank: int, max_steps: int, start_step: int = 0) -> None:
        self.seed = seed
        self.rank = rank
        self.max_steps = max_steps
        self.next_step = start_step
        gen = torch.Generator().manual_seed(seed)
        self.teacher = torch.randn(IN_DIM, OUT_DIM, generator=gen)

    def batch(self, step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + self.rank)
        x = torch.randn(BATCH, IN_DIM, generator=gen)
        y = torch.tanh(x @ self.teacher) + 0.05 * torch.randn(BATCH, OUT_DIM, generator=gen)
        return {"x": x, "y": y, "step": step}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for step in range(self.next_step, self.max_steps):
            yield self.batch(step)

    def __len__(self) -> int:
        return self.max_steps  # counted from step 0: Lightning counts restored batches towards it

    def state_dict(self) -> dict[str, int]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_step = int(state["next_step"])


class StepDataModule(pl.LightningDataModule):
    def __init__(self, max_steps: int) -> None:
        super().__init__()
        self.max_steps = max_steps

    def train_dataloader(self) -> StepLoader:
        # Runs after Lightning restored a checkpoint: start at the restored step.
        return StepLoader(
            seed=DATA_SEED,
            rank=self.trainer.global_rank,
            max_steps=self.max_steps,
            start_step=self.trainer.global_step,
        )


# -- the user's model ------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def init_from_seed(model: nn.Module, seed: int) -> None:
    """Every parameter's full tensor from its own seeded generator; each rank keeps its shard."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
            full = torch.randn(param.shape, generator=gen) * 0.2
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)


class Regression(pl.LightningModule):
    def __init__(self, losses: list[tuple[int, float]]) -> None:
        super().__init__()
        self.losses = losses  # (step, loss) of every completed step, shared across generations
        self.model: MLP | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):
            model = MLP()
        mesh = self.device_mesh["shard"]  # the strategy's ("replicate", "shard") mesh; replicate == 1
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model.fc2, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=self.trainer.strategy.root_device)
        init_from_seed(model, MODEL_SEED)
        self.model = model

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return F.mse_loss(self.model(batch["x"]), batch["y"])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append((self.trainer.global_step, float(outputs["loss"].item())))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)


class CommitDataPosition(pl.Callback):
    """After each optimizer step, the loader's saved position is that step.

    A callback, not the module's hook: Lightning runs callbacks' ``on_train_batch_end``
    before the module's, and ModelCheckpoint's last of all, so the checkpoint of step N
    records ``next_step == N``.
    """

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        trainer.train_dataloader.next_step = trainer.global_step


# -- the fault -------------------------------------------------------------------------------------------
class RaiseOnce(pl.Callback):
    """Raise on ``rank`` while it runs optimizer step ``step``, the first time only (a marker file)."""

    def __init__(self, *, rank: int, step: int, marker: Path) -> None:
        self.rank = rank
        self.step = step
        self.marker = marker

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.step <= 0 or trainer.global_rank != self.rank or trainer.global_step != self.step - 1:
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        raise RuntimeError(f"user fault on rank {self.rank} at step {self.step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fault-step", type=int, default=0)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL, one GPU per rank)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ckpt_dir = args.out / "ckpt"
    losses: list[tuple[int, float]] = []

    def make_trainer(strategy: Any, callbacks: list[pl.Callback]) -> pl.Trainer:
        return pl.Trainer(
            accelerator=args.accelerator,
            devices=world_size,
            num_nodes=1,
            strategy=strategy,
            plugins=[TorchElasticEnvironment()],
            max_steps=args.steps,
            use_distributed_sampler=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            enable_checkpointing=True,
            default_root_dir=args.out,
            callbacks=[
                *callbacks,
                CommitDataPosition(),
                ModelCheckpoint(  # Lightning's default names: epoch=0-step=5.ckpt
                    dirpath=ckpt_dir,
                    every_n_train_steps=args.ckpt_every,
                    save_top_k=-1,
                    save_last=False,
                    save_on_train_epoch_end=False,
                ),
                RaiseOnce(rank=args.fault_rank, step=args.fault_step, marker=args.out / "fault_fired"),
            ],
        )

    # The documented few lines.
    recovery = InProcessRecovery.from_env(checkpoint_dir=ckpt_dir)
    trainer = recovery.fit(make_trainer, lambda: Regression(losses), datamodule=StepDataModule(args.steps))

    module = trainer.lightning_module
    optimizer = trainer.optimizers[0]
    params = dict(module.model.named_parameters())
    final: dict[str, dict[str, torch.Tensor]] = {"params": {}, "optim": {}}
    for name, param in params.items():
        final["params"][name] = param.to_local().detach().clone()
        for key, value in optimizer.state[param].items():
            tensor = value.to_local() if isinstance(value, DTensor) else value
            final["optim"][f"{name}.{key}"] = tensor.detach().clone()
    torch.save(final, args.out / f"final_rank{rank}.pt")
    last_record = {str(step): loss for step, loss in losses}  # a redone step's later record wins
    (args.out / f"losses_rank{rank}.json").write_text(json.dumps(last_record))
    info = {
        "pid": os.getpid(),
        "recoveries": recovery.recoveries,
        "global_step": trainer.global_step,
        "steps_trained": [step for step, _ in losses],  # with repeats: what tier 3 redid
    }
    (args.out / f"info_rank{rank}.json").write_text(json.dumps(info))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
