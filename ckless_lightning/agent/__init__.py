"""The per-node agent (training operator): supervises ranks, spares and the batch cache; no Lightning."""

from ckless_lightning.agent.node_agent import EXIT_FAULT_BUDGET, NodeAgent

__all__ = ["EXIT_FAULT_BUDGET", "NodeAgent"]
