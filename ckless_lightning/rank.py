"""Rank entry point: ``python -m ckless_lightning.rank --config RUN_DIR/config.yaml``.

Started by ``launch.py`` (one process per rank) or, unchanged, by ``torchrun``:
Lightning's TorchElasticEnvironment reads RANK, LOCAL_RANK, WORLD_SIZE,
GROUP_RANK, MASTER_ADDR and MASTER_PORT. The config is the resolved YAML that
``launch.py`` writes into the run directory (also with ``dry_run=true``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """When started by launch.py, get SIGKILL if the launcher dies, so no rank outlives its job.

    The launcher passes its pid in CKLESS_LAUNCHER_PID; if it is already gone
    (we were reparented before prctl ran), exit at once.
    """
    launcher = os.environ.get("CKLESS_LAUNCHER_PID")
    if launcher is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(launcher):
        sys.exit("launch.py exited before this rank started")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckless_lightning.rank", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved job config written by launch.py")
    args = parser.parse_args(argv)
    _die_with_launcher()

    from omegaconf import OmegaConf

    from ckless_lightning.config import job_config_from_dict
    from ckless_lightning.training import fit

    container = OmegaConf.to_container(OmegaConf.load(args.config), resolve=True)
    assert isinstance(container, dict)
    fit(job_config_from_dict(container))
    return 0


if __name__ == "__main__":
    sys.exit(main())
