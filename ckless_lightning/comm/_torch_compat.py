"""Private torch state that a failed ``init_process_group`` leaves behind (checked on torch 2.13).

Why: torch names process groups "0", "1", ... from a process-wide counter
(``distributed_c10d._world.group_count``), and peers find each other's
addresses under those names. ``init_process_group`` takes a name before it
builds the default group; when building it fails (a peer died or the generation
moved on while the groups formed), the counter stays advanced and only
``destroy_process_group`` resets it, which refuses to run without a default
group. The next generation's groups in this process would then be named "1",
"2"... while a fresh replacement's are "0", "1"...: they never meet (seen as
a stall in the next generation's formation). Re-check when upgrading torch.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["forget_failed_default_group"]


def forget_failed_default_group() -> None:
    """After ``init_process_group`` raised with no default group formed: restart group naming at "0"."""
    if dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _world

    _world.group_count = 0
