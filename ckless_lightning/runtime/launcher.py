"""Where a node learns its place in the job: the config, or the scheduler that started it.

``cluster.launcher``: ``manual`` uses the config as given (``cluster.node_rank=...`` on each
node's command line); ``slurm`` reads Slurm's variables (one agent per Slurm task:
``srun python launch.py ...``); ``auto`` (the default) is ``slurm`` inside an ``srun`` step
and ``manual`` elsewhere. What the command line sets explicitly always wins.

From Slurm: ``SLURM_PROCID`` is the node rank, ``SLURM_NTASKS`` the number of nodes (less
``cluster.spare_nodes``: the last tasks are standby agents, ``cluster.standby``),
the first host of ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``) hosts the job store
(``cluster.master_addr``), and with ``cluster.master_port=0`` the store port is derived
from ``SLURM_JOB_ID`` so that every task agrees without talking.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["first_host", "place_from_scheduler", "slurm_port"]

_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 20000


def place_from_scheduler(
    cluster: Mapping[str, Any], env: Mapping[str, str], *, explicit: Collection[str] = ()
) -> dict[str, Any]:
    """The ``cluster`` values a scheduler sets, for ``cluster`` (the composed section) and ``env``.

    ``explicit``: the ``cluster.*`` keys given on the command line (never overridden; a
    contradiction with the scheduler is a ValueError naming both). Returns only what changes.
    """
    launcher = cluster.get("launcher", "auto")
    in_srun = "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and "SLURM_JOB_ID" in env
    if launcher == "manual" or (launcher == "auto" and not in_srun):
        return {}
    if launcher == "slurm" and not in_srun:
        raise ValueError(
            "cluster.launcher=slurm but this is not a Slurm step (no SLURM_PROCID / SLURM_STEP_ID): "
            "start it with `srun python launch.py ...` (in an sbatch script: examples/slurm/train.sbatch), "
            "or use cluster.launcher=manual"
        )
    if launcher not in ("auto", "slurm"):
        return {}  # ClusterConfig reports the bad value
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
    spares = int(cluster.get("spare_nodes", 0))
    if ntasks <= spares:
        raise ValueError(
            f"cluster.spare_nodes={spares} but Slurm started {ntasks} task(s): run srun with "
            f"<nodes> + {spares} tasks (one agent per task; the last {spares} stand by)"
        )
    procid = int(env["SLURM_PROCID"])
    nnodes = ntasks - spares
    found: dict[str, Any] = {"node_rank": procid if procid < nnodes else 0, "nnodes": nnodes}
    if procid >= nnodes:
        found["standby"] = True
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodelist:
        found["master_addr"] = first_host(nodelist)
    if int(cluster.get("master_port", 0)) == 0 and cluster.get("store") is None:
        found["master_port"] = slurm_port(int(env["SLURM_JOB_ID"]))
    changes: dict[str, Any] = {}
    for key, value in found.items():
        if f"cluster.{key}" in explicit:
            if key in ("node_rank", "nnodes") and cluster.get(key) != value:
                raise ValueError(
                    f"cluster.{key}={cluster.get(key)} on the command line, but Slurm says {value} "
                    f"(one agent per Slurm task: SLURM_{'PROCID' if key == 'node_rank' else 'NTASKS'}, "
                    "less cluster.spare_nodes); "
                    f"drop the override, or run srun with one task per node (srun -n <nodes>)"
                )
            continue
        if cluster.get(key) != value:
            changes[key] = value
    return changes


def slurm_port(job_id: int) -> int:
    """The store port every task of Slurm job ``job_id`` derives alike (20000-39999)."""
    return _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``gpu[003-010,012],cpu1`` -> ``gpu003``).

    Asks ``scontrol show hostnames`` when it is on PATH; the compact forms Slurm writes are
    also expanded here, so a missing ``scontrol`` is no error.
    """
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        result = subprocess.run(
            [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=False
        )
        hosts = result.stdout.split()
        if result.returncode == 0 and hosts:
            return hosts[0]
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}; set cluster.master_addr")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first
