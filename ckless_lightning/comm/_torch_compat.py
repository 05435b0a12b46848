"""Private torch state this project reads or resets (checked on torch 2.13).

:func:`forget_failed_default_group`: the state a failed ``init_process_group`` leaves behind.

Why: torch names process groups "0", "1", ... from a process-wide counter
(``distributed_c10d._world.group_count``), and peers find each other's
addresses under those names. ``init_process_group`` takes a name before it
builds the default group; when building it fails (a peer died or the generation
moved on while the groups formed), the counter stays advanced and only
``destroy_process_group`` resets it, which refuses to run without a default
group. The next generation's groups in this process would then be named "1",
"2"... while a fresh replacement's are "0", "1"...: they never meet (seen as
a stall in the next generation's formation). Re-check when upgrading torch.

:func:`gloo_pairs`: every gloo connection of this process, named by group and peer. torch lists
its groups only in ``distributed_c10d._world.pg_group_ranks``; a rank whose gloo wait the cut
of its connections does not end writes on each of them (``recovery/sever.py``, :func:`unstick`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["forget_failed_default_group", "gloo_pairs"]


def forget_failed_default_group() -> None:
    """After ``init_process_group`` raised with no default group formed: restart group naming at "0"."""
    if dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _world

    _world.group_count = 0


def gloo_pairs() -> Iterator[tuple[dist.ProcessGroupGloo, int]]:
    """``(backend, peer)`` for every peer of every gloo group this process is in: ``peer`` is its
    rank in that group. Groups without a gloo backend (NCCL's) are passed over."""
    from torch.distributed.distributed_c10d import _world

    for group, ranks in list(_world.pg_group_ranks.items()):
        try:
            backend = group._get_backend(torch.device("cpu"))
        except RuntimeError:  # no CPU backend in this group: nothing of gloo's to reach
            continue
        if not isinstance(backend, dist.ProcessGroupGloo):
            continue
        own = backend.rank()
        for peer in sorted(ranks.values()):
            if peer != own:
                yield backend, peer
