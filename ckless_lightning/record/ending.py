"""How a job ended and what happens next: the last lines ``launch.py`` prints.

:func:`ending` names the ending from the summary (completed, gave up and why, stopped by a
signal, failed, or unknown when no ``job_end`` was recorded); :func:`what_next` says, for a job
that did not complete, what its scheduler does with the exit code and which key the operator can
change. A leaf module: no torch, no Lightning.
"""

from __future__ import annotations

import textwrap
from typing import Protocol


class JobSummary(Protocol):
    """What this module reads of :class:`ckless_lightning.record.summary.JobSummary`."""

    exit_code: int | None
    giveup_reason: str | None


__all__ = ["ending", "what_next"]


def ending(s: JobSummary) -> str:
    """How the job ended, with its exit code: completed, gave up (why), stopped by a signal, failed,
    or unknown (no ``job_end``: the launcher was killed, or the job is still running)."""
    code = s.exit_code
    if code is None:
        return "unknown (no job_end event: the launcher was killed, or the job is still running)"
    if code == 0:
        return "0 (completed)"
    if s.giveup_reason is not None:
        return f"{code} (gave up: {s.giveup_reason})"
    if code > 128 and code - 128 in _SIGNALS:
        return f"{code} (stopped by {_SIGNALS[code - 128]}: the scheduler or an operator)"
    return f"{code} (failed: the launcher's message above says why)"


_SIGNALS = {1: "SIGHUP", 2: "SIGINT", 15: "SIGTERM"}
_REQUEUE = 75  # runtime.contract.ExitCode.FAULT_BUDGET (EX_TEMPFAIL); this module imports no torch


def what_next(s: JobSummary, checkpoint: str | None) -> list[str]:
    """For a job that did not complete: what the scheduler does next and what the operator can change,
    as lines of at most 100 columns (none for a completed job).

    ``checkpoint``: the last complete checkpoint a requeued run would resume from (None: none yet)."""
    code = s.exit_code
    if code == 0:
        return []
    resume = (
        f"resumes from {checkpoint}"
        if checkpoint
        else "starts over from step 0 (no checkpoint yet: checkpoint.every_n_steps sets how often)"
    )
    if code == _REQUEUE:
        reason = s.giveup_reason or ""
        if "agent.max_restarts" in reason:
            key = "To ride out more faults, raise agent.max_restarts or shorten agent.restart_window_s."
        elif "comm.join_timeout_s" in reason:
            key = (
                "A rank never came back: give the job spares (agent.spares, cluster.spare_nodes) or raise "
                "comm.join_timeout_s."
            )
        else:
            key = "The reason above names what was lost."
        text = (
            "exit 75 asks the scheduler to requeue the job (examples/slurm/train.sbatch does; a "
            f"Kubernetes Job recreates the pod); the new run {resume}. {key}"
        )
    elif code is None:
        text = f"nothing recorded the job's end (was the launcher killed?); a rerun {resume}."
    elif code > 128 and code - 128 in _SIGNALS:
        text = f"stopped from outside; requeued (a preemption, say), the run {resume}."
    else:
        text = (
            f"exit {code} is not one to retry as it is: fix what the message above names (exit 2: the "
            "config key or file; 3: the memory plan), then run again."
        )
    return textwrap.wrap(
        text,
        width=100,
        initial_indent="next: ",
        subsequent_indent="      ",
        break_long_words=False,  # a path stays whole, to copy
        break_on_hyphens=False,
    )
