"""Standalone job store: ``python -m ckless_lightning.store --host ADDR --port PORT [--secret-file F]``.

Runs the job store (the c10d TCPStore of :mod:`ckless_lightning.comm.store`) in a process of
its own, off the training nodes: a login node, a small pod, an sbatch script's batch step.
Agents join it with ``cluster.store=ADDR:PORT``; then node 0 is a node like any other and
losing it (agent and ranks) is a node loss that a replacement agent recovers, where with the
store inside node 0's agent (the default) it ends the job (exit 75, requeue).

The job's secret comes from ``CKLESS_JOB_SECRET`` / ``CKLESS_JOB_SECRET_FILE``; with neither,
a new one is written to ``--secret-file`` (mode 0600, a new file) for the agents'
``CKLESS_JOB_SECRET_FILE``. Prints one line ``job store listening on ADDR:PORT`` once clients
can connect (port 0: a free port, printed), then serves until SIGTERM or SIGINT. This module
is an edge: it reads the environment.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from ckless_lightning.comm.secret import job_secret, write_secret_file

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ckless_lightning.store", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument(
        "--host", required=True, help="the address to listen on (only this one), e.g. 10.0.0.5"
    )
    parser.add_argument("--port", type=int, default=29400, help="0: a free port (printed)")
    parser.add_argument(
        "--secret-file", type=Path, help="write a new secret here (0600) when the environment gives none"
    )
    args = parser.parse_args(argv)
    try:
        secret = job_secret(
            os.environ, may_generate=args.secret_file is not None, why_needed="no --secret-file"
        )
        if "CKLESS_JOB_SECRET" not in os.environ and "CKLESS_JOB_SECRET_FILE" not in os.environ:
            write_secret_file(args.secret_file, secret)
    except (ValueError, FileExistsError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    from ckless_lightning.comm.store import JobStore  # torch: imported once the arguments are good

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        store = JobStore.host(args.host, args.port, secret=secret)
    except OSError as err:
        print(f"error: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 1
    given = args.secret_file is None or "CKLESS_JOB_SECRET" in os.environ
    secret_hint = "the same CKLESS_JOB_SECRET" if given else f"CKLESS_JOB_SECRET_FILE={args.secret_file}"
    print(f"job store listening on {args.host}:{store.port}", flush=True)
    print(
        f"agents: python launch.py cluster.store={args.host}:{store.port} ... with {secret_hint}", flush=True
    )
    stop.wait()
    print("job store: stopped", flush=True)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
