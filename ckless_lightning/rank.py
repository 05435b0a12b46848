"""Rank entry point: ``python -m ckless_lightning.rank --config RUN_DIR/config.yaml``.

Started by the node agent (``launch.py``), by a warm spare, or unchanged by
``torchrun``: Lightning's TorchElasticEnvironment reads RANK, LOCAL_RANK,
WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT. The config is the
resolved YAML that ``launch.py`` writes into the run directory (also with
``dry_run=true``). This module is an edge: it reads the agent's variables
(CKLESS_*) through :class:`~ckless_lightning.runtime.contract.RankContext`
and hands them on. Nothing imports this module: it is an entry point.
"""

from __future__ import annotations

import argparse
import sys

from ckless_lightning.runtime.contract import RankContext, die_with_launcher

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckless_lightning.rank", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved job config written by launch.py")
    args = parser.parse_args(argv)
    die_with_launcher()
    context = RankContext.from_env()

    from ckless_lightning.training.rank_process import run_rank_process

    return run_rank_process(args.config, context)


if __name__ == "__main__":
    sys.exit(main())
