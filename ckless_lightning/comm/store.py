"""The job store: a c10d TCPStore hosted by node 0's agent, and the keys the job agrees through.

Reused, not rewritten: ``torch.distributed.TCPStore`` is the same store
torchrun's rendezvous and ``init_process_group`` use. It lives in an agent, not
in a rank, so any rank can die without taking the store with it. Keys:

- ``gen``: the current generation (an int, only ever raised with compare_set);
- ``restart/<g>``: when generation ``g`` began (the restart budget reads them);
- ``giveup``: set once, the reason the job stops for good;
- ``hb/<rank>``: ``"<gen> <step> <unix time>"``, written by the rank every step;
- ``agent/<node>``: ``"<gen> <unix time>"``, each agent's own heartbeat;
- ``master_port/<g>``: tier 0's rendezvous port of generation ``g`` (rank 0 hosts it);
- ``done/<g>/<node>``: a node's ranks all finished in generation ``g``;
- ``member/<rank>``: the generation the rank's current process belongs to (tiers 3-4);
- ``gen<g>/joined``, ``gen<g>/vote/<step>``, ``gen<g>/decision/<step>``: tiers 3-4's join
  barrier and step-commit vote (``ckless_lightning.recovery``, ``ckless_lightning.comm.commit``);
- ``gen<g>/pg/...``: tier 1's process groups of generation ``g`` (PrefixStore).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore

__all__ = ["Heartbeat", "JobStore", "connect_store"]


def connect_store(host: str, port: int, *, is_master: bool, timeout_s: float = 300.0) -> TCPStore:
    """Host (``is_master``) or join the job's TCPStore; port 0 with is_master picks a free port."""
    return TCPStore(
        host,
        port,
        is_master=is_master,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        use_libuv=True,
    )


@dataclass(frozen=True)
class Heartbeat:
    gen: int
    step: int  # last optimizer step completed; -1 before the first
    time: float

    @classmethod
    def parse(cls, raw: bytes) -> Heartbeat:
        gen, step, t = raw.decode().split()
        return cls(int(gen), int(step), float(t))

    def encode(self) -> str:
        return f"{self.gen} {self.step} {self.time:.6f}"


class JobStore:
    """Typed access to the job store's keys (see the module docstring)."""

    def __init__(self, store: TCPStore) -> None:
        self.store = store

    @property
    def port(self) -> int:
        return self.store.port

    # -- generations -------------------------------------------------------
    def generation(self) -> int:
        return self.store.add("gen", 0)

    def advance_generation(self, seen: int) -> int:
        """Move from generation ``seen`` to ``seen + 1`` unless another agent already moved on.

        Returns the generation now current. Several agents noticing the same
        fault therefore make one new generation, not several.
        """
        current = int(self.store.compare_set("gen", str(seen), str(seen + 1)))
        if current == seen + 1:
            self.store.set(f"restart/{seen + 1}", f"{time.time():.6f}")
        return current

    def restart_times(self, up_to_gen: int) -> list[float]:
        keys = [f"restart/{g}" for g in range(1, up_to_gen + 1)]
        present = [k for k in keys if self.store.check([k])]
        return [float(v) for v in self.store.multi_get(present)] if present else []

    # -- giving up ---------------------------------------------------------
    def give_up(self, reason: str) -> None:
        if not self.store.check(["giveup"]):
            self.store.set("giveup", reason)

    def giveup_reason(self) -> str | None:
        return self.store.get("giveup").decode() if self.store.check(["giveup"]) else None

    # -- heartbeats --------------------------------------------------------
    def set_rank_heartbeat(self, rank: int, beat: Heartbeat) -> None:
        self.store.set(f"hb/{rank}", beat.encode())

    def rank_heartbeats(self, ranks: list[int]) -> dict[int, Heartbeat]:
        """Heartbeats of ``ranks`` (the agent writes an initial one when it starts a rank)."""
        keys = [f"hb/{r}" for r in ranks]
        return {r: Heartbeat.parse(raw) for r, raw in zip(ranks, self.store.multi_get(keys), strict=True)}

    def set_agent_heartbeat(self, node: int, gen: int) -> None:
        self.store.set(f"agent/{node}", f"{gen} {time.time():.6f}")

    def agent_heartbeat(self, node: int) -> tuple[int, float] | None:
        key = f"agent/{node}"
        if not self.store.check([key]):
            return None
        gen, t = self.store.get(key).decode().split()
        return int(gen), float(t)

    # -- per-generation rendezvous and completion --------------------------
    def publish_master_port(self, gen: int, port: int) -> None:
        self.store.set(f"master_port/{gen}", str(port))

    def has_master_port(self, gen: int) -> bool:
        return self.store.check([f"master_port/{gen}"])

    def master_port(self, gen: int) -> int:
        return int(self.store.get(f"master_port/{gen}"))  # blocks until node 0 published it

    # -- membership (tiers 3-4) --------------------------------------------
    def set_member(self, rank: int, gen: int) -> None:
        self.store.set(f"member/{rank}", str(gen))

    def member(self, rank: int) -> int:
        """The generation ``rank``'s current process belongs to; -1 if never set."""
        key = f"member/{rank}"
        return int(self.store.get(key)) if self.store.check([key]) else -1

    def mark_done(self, gen: int, node: int) -> None:
        self.store.set(f"done/{gen}/{node}", "1")

    def nodes_done(self, gen: int, nnodes: int) -> bool:
        return self.store.check([f"done/{gen}/{n}" for n in range(nnodes)])
