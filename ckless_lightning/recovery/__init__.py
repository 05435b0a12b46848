"""In-process recovery (tiers 3 and 4): the fit loop, and a rank's membership in the job's generations.

The names load lazily (PEP 562): the loop imports Lightning, and the node agent, which imports
light parts of this package (``recovery.sever``), must not (it cost every job's agent ~2.7 s of
CPU at its start, beside the fork server's own imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckless_lightning.runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from ckless_lightning.recovery.loop import InProcessRecovery, MakeTrainer, RecoveryFaults
    from ckless_lightning.recovery.session import GenerationSession, JobGaveUp

__all__ = ["GenerationSession", "InProcessRecovery", "JobGaveUp", "MakeTrainer", "RecoveryFaults"]

__getattr__ = lazy_attributes(
    __name__,
    {
        "GenerationSession": "session",
        "InProcessRecovery": "loop",
        "JobGaveUp": "session",
        "MakeTrainer": "loop",
        "RecoveryFaults": "loop",
    },
)
