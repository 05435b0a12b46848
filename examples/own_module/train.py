"""The own-module example as a script of one's own, run by ``python -m ckless_lightning.run``.

A plain Lightning script but for one line: ``fit(model, datamodule=data,
**trainer_kwargs)`` where it would say ``pl.Trainer(**trainer_kwargs).fit(model, data)``. From the
project root, 4 ranks at tier 4, rank 1 killed in step 6 and recovered from its buddy's copy::

    python -m ckless_lightning.run --nproc-per-node 4 tier=4 fault=kill fault.rank=1 fault.step=6 \\
        examples/own_module/train.py --max-steps 10

Without the runner (``python examples/own_module/train.py``) it trains on one process, no recovery.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from own_module import MLPRegressor, RegressionData

from ckless_lightning.run import fit


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank and micro-batch")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    pl.seed_everything(args.seed, workers=True)  # the weights are drawn in MLPRegressor.__init__
    model = MLPRegressor(lr=args.lr, max_steps=args.max_steps, dropout=args.dropout)
    data = RegressionData(batch_size=args.batch_size, seed=args.seed)
    trainer = fit(
        model,
        datamodule=data,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        log_every_n_steps=1,
        enable_model_summary=False,
    )
    if trainer is not None and trainer.is_global_zero:
        print(f"trained {trainer.global_step} steps")


if __name__ == "__main__":
    main()
