"""The job store's secret: where it comes from, and the 0600 file that can hold it.

Every agent and rank of a job presents the same secret to the job store
(:func:`~ckless_lightning.comm.store.job_namespace`). It comes from the
environment (read at the edges: ``launch.py``, the standalone store):
``CKLESS_JOB_SECRET`` (the value) or ``CKLESS_JOB_SECRET_FILE`` (a file holding it,
mode 0600, owned by this user, not a symlink). A one-node job with its store inside
its agent makes its own; a job of several nodes, or one joining a standalone store,
must be given one, since its agents start apart.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from ckless_lightning.runtime.contract import ENV_JOB_SECRET, ENV_JOB_SECRET_FILE

__all__ = ["generate_secret", "job_secret", "read_secret_file", "write_secret_file"]

_HOW = (
    f"export {ENV_JOB_SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))') on every node "
    f"before launch.py (examples/slurm/train.sbatch does), or point {ENV_JOB_SECRET_FILE} at a 0600 file "
    "holding it"
)


def generate_secret() -> str:
    return secrets.token_hex(32)


def job_secret(env: Mapping[str, str], *, may_generate: bool, why_needed: str = "") -> str:
    """The job's secret from ``env``; a new one when it has none and ``may_generate``.

    Raises ValueError (naming the variable and the fix) when none is given and one may not be
    made (``why_needed`` says why), or when the file is unsafe.
    """
    value = env.get(ENV_JOB_SECRET)
    path = env.get(ENV_JOB_SECRET_FILE)
    if value and path:
        raise ValueError(f"both {ENV_JOB_SECRET} and {ENV_JOB_SECRET_FILE} are set; unset one")
    if path:
        return read_secret_file(Path(path))
    if value is not None:
        if len(value) < 16:
            raise ValueError(
                f"{ENV_JOB_SECRET} is {len(value)} characters; use at least 16 (e.g. 64 hex digits)"
            )
        return value
    if may_generate:
        return generate_secret()
    raise ValueError(f"{why_needed}: every agent must present the job store's secret; {_HOW}")


def read_secret_file(path: Path) -> str:
    """The secret in ``path``: a regular file (not a symlink) of this user's, readable by nobody else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise ValueError(f"{ENV_JOB_SECRET_FILE}={path}: cannot open it ({err.strerror}); {_HOW}") from None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{ENV_JOB_SECRET_FILE}={path} is not a regular file")
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ValueError(
                f"{ENV_JOB_SECRET_FILE}={path} must be owned by this user and readable by nobody else "
                f"(mode {stat.S_IMODE(info.st_mode):o}): chmod 600 {path}"
            )
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"{ENV_JOB_SECRET_FILE}={path} holds {len(secret)} characters; use at least 16")
    return secret


def write_secret_file(path: Path, secret: str) -> None:
    """Write ``secret`` to a new file ``path`` (mode 0600); never follows a symlink or overwrites."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
