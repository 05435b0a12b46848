"""Warm spare: ``python -m ckless_lightning.spare``, started by the node agent.

Imports torch, Lightning and the project up front, then blocks on stdin until
the agent assigns it a rank: one JSON line ``{"env": {...}, "argv": [...]}``.
It then becomes that rank (``ckless_lightning.rank.main``), having skipped the
interpreter start and the imports. stdin closing without an assignment ends it.
"""

from __future__ import annotations

import json
import os
import sys

from ckless_lightning.rank import die_with_launcher, main


def serve() -> int:
    die_with_launcher()
    import lightning.pytorch  # noqa: F401  - the point of a spare: pay the imports before the fault
    import torch  # noqa: F401

    import ckless_lightning.training  # noqa: F401

    line = sys.stdin.readline()
    if not line:
        return 0
    assignment = json.loads(line)
    os.environ.update(assignment["env"])
    return main(assignment["argv"])


if __name__ == "__main__":
    sys.exit(serve())
