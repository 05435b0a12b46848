"""The per-node agent (training operator): supervises ranks, spares and the batch cache; no Lightning.

``NodeAgent`` loads lazily (PEP 562): it imports torch, and ``launch.py`` imports
:mod:`ckless_lightning.agent.fork_server` first, to start the fork server before
the launcher's own imports of torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckless_lightning.runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from ckless_lightning.agent.node_agent import EXIT_FAULT_BUDGET, NodeAgent

__all__ = ["EXIT_FAULT_BUDGET", "NodeAgent"]

__getattr__ = lazy_attributes(__name__, dict.fromkeys(__all__, "node_agent"))
