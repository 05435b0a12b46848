"""A rank whose own accelerator failed ends its process: it never re-enters ``fit``.

Why: a CUDA error such as an illegal address or an uncorrectable ECC error is sticky: every later
call on the process's CUDA context fails, or worse, runs on state the fault left behind. A peer's
loss is recovered in-process (the survivors keep their state); this rank's own device fault is
not: it frees its peers (aborts its communicators and cuts its connections, as any leaving rank
does), says why on stderr, and exits with :class:`~ckless_lightning.runtime.contract.ExitCode`
``DEVICE_FAULT``, for its agent to replace it (a warm spare, state from its buddy or replica).
The abort runs in a thread with a bound: on a poisoned context it may itself block.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

from ckless_lightning.recovery.sever import fail_fast
from ckless_lightning.runtime.contract import ExitCode

__all__ = ["exit_on_device_fault"]

ABORT_S = 10.0  # the longest wait for the communicators' abort before the process exits anyway


def exit_on_device_fault(
    err: BaseException, *, rank: int, keep_ports: set[int], abort_s: float = ABORT_S
) -> None:
    """End this process after ``err``, this rank's own accelerator fault (never returns, but for a
    test that replaced ``os._exit``): free the peers (within ``abort_s``), explain, exit."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    print(
        f"rank {rank}: its accelerator failed ({type(err).__name__}: {first[:300]}); a CUDA error "
        "leaves this process's device context unusable: exiting for the agent to replace it "
        f"(exit code {int(ExitCode.DEVICE_FAULT)})",
        file=sys.stderr,
    )
    traceback.print_exception(err, file=sys.stderr)
    abort = threading.Thread(target=fail_fast, kwargs={"keep_ports": keep_ports}, name="abort", daemon=True)
    abort.start()
    abort.join(abort_s)
    if abort.is_alive():
        print(f"rank {rank}: aborting its communicators did not return within {abort_s:g} s", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(ExitCode.DEVICE_FAULT)  # no unwinding: destructors would touch the poisoned context
