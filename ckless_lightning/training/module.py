"""CausalLMModule: next-token training of a Llama 3 or Mixtral model under FSDP2.

The model is built on the meta device in ``configure_model`` and sharded with
its family's FSDP2 plan over the strategy's mesh. ``CheckpointlessStrategy``
then materializes it: allocated on the device, and initialized from the seed
alone (``reset_parameters``: the same full weights for any world size or mesh)
only when the fit does not restore a checkpoint. Under any other strategy the
module materializes and initializes itself.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from ckless_lightning.models import FSDPConfig, build_model, init_weights, parallelize_model
from ckless_lightning.runtime.config import OptimConfig
from ckless_lightning.training.strategy import CheckpointlessStrategy

__all__ = ["CausalLMModule", "warmup_cosine"]


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalLMModule(pl.LightningModule):
    """Causal language-model training step, AdamW and a warmup + cosine schedule.

    Batches are dicts with ``input_ids`` of shape [B, T+1] (inputs and shifted
    targets). ``training_step`` returns the loss to backpropagate and the
    language-model loss alone (``lm_loss``), which LossHistoryCallback logs.
    """

    def __init__(
        self,
        model_config: Any,
        *,
        optim: OptimConfig,
        fsdp: FSDPConfig | None = None,
        seed: int = 1234,
        max_steps: int = 1000,
    ) -> None:
        super().__init__()
        self.model_config = model_config
        self.optim_config = optim
        self.fsdp_config = fsdp or FSDPConfig()
        self.seed = seed
        self.max_steps = max_steps
        self.model: nn.Module | None = None
        self.last_lm_loss: torch.Tensor | None = None  # of the micro-batch in flight
        self.save_hyperparameters(
            {"model": asdict(model_config), "optim": asdict(optim), "seed": seed, "max_steps": max_steps}
        )
        self._aux_coef = float(getattr(model_config, "router_aux_loss_coef", 0.0))

    @override
    def configure_model(self) -> None:
        if self.model is not None:  # Lightning may call this again for a later fit/validate
            return
        with torch.device("meta"):
            model = build_model(self.model_config)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            parallelize_model(model, self.device_mesh, cfg=self.fsdp_config)
        self.model = model
        if not isinstance(self.trainer.strategy, CheckpointlessStrategy):
            model.to_empty(device=self.trainer.strategy.root_device)
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize every weight from the seed (after materialization; the strategy skips it when
        the fit restores a checkpoint)."""
        assert self.model is not None, "configure_model() has not run"
        init_weights(self.model, self.seed)

    @override
    def forward(self, tokens: torch.Tensor) -> Any:
        assert self.model is not None, "configure_model() has not run"
        return self.model(tokens)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(total loss to backprop, language-model loss) of one micro-batch."""
        input_ids = batch["input_ids"]
        inputs, targets = input_ids[:, :-1], input_ids[:, 1:]
        out = self(inputs)
        lm_loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten())
        loss = lm_loss
        if out.aux_loss is not None and self._aux_coef:
            loss = loss + self._aux_coef * out.aux_loss
        return loss, lm_loss

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        loss, lm_loss = self.compute_loss(batch)
        self.last_lm_loss = lm_loss.detach()  # LossHistoryCallback reads it before the update
        return {"loss": loss, "lm_loss": self.last_lm_loss}

    @override
    def configure_optimizers(self) -> Any:
        assert self.model is not None
        cfg = self.optim_config
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            foreach=True,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(
                step,
                warmup_steps=cfg.warmup_steps,
                total_steps=cfg.decay_steps or self.max_steps,
                min_ratio=cfg.min_lr / cfg.lr,
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
