"""Warm spare: ``python -m ckless_lightning.spare [--config RUN_DIR/config.yaml]``, started by the node agent.

Before it is handed a rank, a spare does everything of the rank path that does
not depend on the rank: with ``--config`` (the job's resolved config, which the
agent passes), :func:`~ckless_lightning.training.rank_process.prepare_rank`
parses and validates it, imports every module the rank path imports (torch,
Lightning and its lazily imported internals, the project, the model family)
and looks the prepared dataset up; then it emits ``spare_prepared``, says so on
``--ready-fd`` (a pipe to the agent's pool) and blocks on stdin. Without
``--config`` it imports the rank path only.

The agent assigns it a rank with one JSON line ``{"env": {...}, "argv": [...]}``
(``argv``: ``--config PATH``, as ``python -m ckless_lightning.rank`` takes). It
then becomes that rank (:func:`~ckless_lightning.training.rank_process.run_rank_process`),
with the prepared config if ``PATH`` is the one it prepared, and records the
hand-over (``rank_phase`` ``spare_handed`` / ``spare_ready``, then ``spare_imports``).
stdin closing without an assignment ends it. A spare whose preparation fails
still waits: the rank it is handed reports the error the way a cold rank would.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

from ckless_lightning.runtime.contract import die_with_launcher

__all__ = ["serve"]


def _parse(argv: list[str], *, required: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ckless_lightning.spare")
    parser.add_argument("--config", required=required, help="the job's resolved config (launch.py)")
    parser.add_argument("--ready-fd", type=int, help="a pipe to the agent: a line on it says 'ready'")
    return parser.parse_args(argv)


def serve(argv: list[str] | None = None) -> int:
    die_with_launcher()
    started = time.time()
    spawn_args = _parse(sys.argv[1:] if argv is None else argv, required=False)
    import lightning.pytorch  # noqa: F401  - the point of a spare: pay the imports before the fault
    import torch  # noqa: F401

    from ckless_lightning.training.rank_process import announce_prepared, await_rank, prepare_rank

    prepared = None
    if spawn_args.config:
        try:
            prepared = prepare_rank(spawn_args.config)
        except Exception:  # a bad config or data: the rank this spare is handed reports it
            traceback.print_exc()
    # Collect the preparation's garbage now and keep what it imported out of later collections
    # (the rank does the same when it starts, see training/job.py): no collection of these objects
    # runs between the hand-over and the join.
    gc.collect()
    gc.freeze()
    if prepared is not None:
        announce_prepared(prepared, started)
    if spawn_args.ready_fd is not None:
        _say_ready(spawn_args.ready_fd)
    return await_rank(prepared, sys.stdin)


def _say_ready(fd: int) -> None:
    """One line on the agent's pipe; a pool that already handed this spare out closed its end."""
    try:
        os.write(fd, b"ready\n")
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(serve())
