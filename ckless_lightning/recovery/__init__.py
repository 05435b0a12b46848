"""In-process recovery (tiers 3 and 4): the fit loop, and a rank's membership in the job's generations."""

from ckless_lightning.recovery.loop import InProcessRecovery, MakeTrainer, RecoveryFaults
from ckless_lightning.recovery.session import GenerationSession, JobGaveUp

__all__ = ["GenerationSession", "InProcessRecovery", "JobGaveUp", "MakeTrainer", "RecoveryFaults"]
