"""Warm spare: ``python -m ckless_lightning.spare``, started by the node agent.

Imports torch, Lightning and the project up front, then blocks on stdin until
the agent assigns it a rank: one JSON line ``{"env": {...}, "argv": [...]}``.
It then becomes that rank (:func:`~ckless_lightning.training.rank_process.run_rank_process`,
as ``python -m ckless_lightning.rank`` would), having skipped the interpreter
start and the imports. stdin closing without an assignment ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ckless_lightning.runtime.contract import RankContext, die_with_launcher

__all__ = ["serve"]


def serve() -> int:
    die_with_launcher()
    import lightning.pytorch  # noqa: F401  - the point of a spare: pay the imports before the fault
    import torch  # noqa: F401

    from ckless_lightning.training.rank_process import run_rank_process

    line = sys.stdin.readline()
    if not line:
        return 0
    assignment = json.loads(line)
    os.environ.update(assignment["env"])  # the agent's variables for the rank (RankSpec.env)
    parser = argparse.ArgumentParser(prog="python -m ckless_lightning.spare")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(assignment["argv"])
    return run_rank_process(args.config, RankContext.from_env())


if __name__ == "__main__":
    sys.exit(serve())
