"""Silence known third-party noise at its source, one named filter each (Lightning 2.6.6, torch 2.13).

Every rank prints these once per generation, and they bury the lines that matter (the agent's
report of a dead rank showed a deprecation warning as its "last lines"):

- Lightning's "💡 Tip" lines advertising litlogger / litmodels (``rank_zero_info`` on the
  ``lightning.pytorch.utilities.rank_zero`` logger; no flag turns them off);
- torch's deprecation of ``isinstance(x, LeafSpec)``, which Lightning's own ``_pytree`` helper
  still does (a ``FutureWarning`` attributed to ``lightning.pytorch.utilities._pytree``);
- ``ModelCheckpoint``'s "Checkpoint directory ... exists and is not empty" for ``checkpoint.dir``:
  the job's own directory, which a resumed or recovered fit finds full by design;
- Lightning's "The `srun` command is available on your system but is not used" on any machine
  with Slurm installed: our ranks are started and supervised by the node agent (under Slurm,
  one agent per ``srun`` task), never by ``srun`` directly, so its hint is wrong here.

Nothing else is filtered: other warnings of those modules, and the same warnings from other
code, still show. Re-check when upgrading Lightning or torch.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

__all__ = ["quiet_known_noise"]

_TIP_LOGGER = "lightning.pytorch.utilities.rank_zero"
_SRUN_HINT = r"The `srun` command is available on your system but is not used"


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_known_noise(checkpoint_dir: str | Path | None = None) -> None:
    """Install the filters (idempotent: a filter already installed is not added twice)."""
    logger = logging.getLogger(_TIP_LOGGER)
    if not any(isinstance(f, _DropTips) for f in logger.filters):
        logger.addFilter(_DropTips())
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    warnings.filterwarnings("ignore", message=_SRUN_HINT)
    # torchdata 0.11's StatefulDataLoader calls a torch API that torch 2.13 deprecates, every iteration.
    warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", module=r"torchdata\.")
    if checkpoint_dir is not None:
        ours = re.escape(os.path.realpath(checkpoint_dir))  # ModelCheckpoint names it by its real path
        warnings.filterwarnings("ignore", message=rf"Checkpoint directory {ours} exists and is not empty")
