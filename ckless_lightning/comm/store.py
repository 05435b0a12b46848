"""The job store: a c10d TCPStore hosted by node 0's agent, and the only code that knows its key names.

Reused, not rewritten: ``torch.distributed.TCPStore`` is the same store
torchrun's rendezvous and ``init_process_group`` use. It lives in an agent, not
in a rank, so any rank can die without taking the store with it. Everyone else
goes through :class:`JobStore`'s methods; nothing outside this module spells a key.

=================================  ==========================================================  ============
key                                value                                                       written by
=================================  ==========================================================  ============
``gen``                            the current generation (an int, only raised, compare_set)   agent, rank
``restart/<g>``                    unix time generation ``g`` began (the restart budget)       advancer
``announced/<g>``                  counter: the first to move the job to ``g`` announces it    advancer
``gen<g>/moved/<rank>``            the job left ``g``: wakes ``rank``'s generation watch         advancer
                                   (or the rank itself, to release its own watch)
``giveup``                         set once: the reason the job stops for good                 agent
``hb/<rank>``                      ``"<gen> <completed step> <unix time>"``, each step         rank, agent
``where/<rank>``                   tiers 3-4: where the rank's main thread is, each second     rank
                                   (``peers``: waiting in a collective, ``running``, ``data``)
``agent/<node>``                   the generation each agent is in                             agent
``agent/<node>/beats``             counter each agent bumps per pass (liveness, no clocks)    agent
``started/<g>/<node>``             the node's ranks were started in generation ``g``           agent
``master_port/<g>``                tier 0: rank 0's rendezvous port of generation ``g``        agent 0
``done/<g>/<node>``                a node's ranks all finished in generation ``g``             agent
``member/<rank>``                  the generation the rank's current process belongs to        agent, rank
``gen<g>/joined``                  tiers 3-4: counter of ranks that joined ``g`` (barrier)     rank
``gen<g>/vote/<step>``             tiers 3-4: counter of votes for the step in progress        rank
``gen<g>/decision/<step>``         ``commit`` or ``abandon``, compare_set once                 rank
``state/recorded``                 tier 4: some rank recorded a committed step in memory       rank
``finished``, ``finished/<rank>``  tiers 3-4: ranks past their last collective (count, each)   rank
``gen<g>/pg/...``                  tier 1+: generation ``g``'s process groups (PrefixStore)    torch
=================================  ==========================================================  ============
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import DistStoreError, PrefixStore, TCPStore

from ckless_lightning.comm.bounded_store import GenerationBoundStore, GenerationChanged

__all__ = ["GenerationChanged", "Heartbeat", "JobStore", "connect_store"]


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
    """A rank's beat: its generation, its completed step (-1 while starting up), when, and its phase.

    ``phase`` is ``"step"`` while training (or starting up), ``"recovery"`` from the moment a
    rank leaves a generation until it trains again, and ``"save"`` from the start of a checkpoint
    save to the next batch: the agent gives each phase its own silence limit
    (``agent.hang_timeout``, ``agent.startup_timeout``, ``agent.recovery_timeout``,
    ``agent.save_timeout``).
    """

    gen: int
    completed_step: int
    time: float
    phase: str = "step"

    @classmethod
    def parse(cls, raw: bytes) -> Heartbeat:
        gen, completed, t, *phase = raw.decode().split()
        return cls(int(gen), int(completed), float(t), *phase)

    def encode(self) -> str:
        return f"{self.gen} {self.completed_step} {self.time:.6f} {self.phase}"


class JobStore:
    """Typed access to the job store's keys (see the module docstring)."""

    def __init__(self, store: TCPStore) -> None:
        self._tcp = store  # the raw c10d store: only this class spells its keys
        self._pg_stores: dict[int, GenerationBoundStore] = {}

    @classmethod
    def connect(cls, host: str, port: int) -> JobStore:
        """Join the job store an agent hosts (ranks and non-hosting agents)."""
        return cls(connect_store(host, port, is_master=False))

    @property
    def port(self) -> int:
        return self._tcp.port

    # -- generations -------------------------------------------------------
    def generation(self) -> int:
        return self._tcp.add("gen", 0)

    def advance_generation(
        self, seen: int, *, world_size: int, announce: Callable[[int], None] | None = None
    ) -> int:
        """Move from generation ``seen`` to ``seen + 1`` unless someone already moved on.

        Returns the generation now current. Several agents and ranks noticing the
        same fault therefore make one new generation, not several; ``announce``
        is called with the new generation by the first caller only, job-wide.
        Every caller that finds the job at ``seen + 1`` also wakes the generation
        watches of ``seen``'s ``world_size`` ranks (one request; see :meth:`wait_moved`).
        """
        current = int(self._tcp.compare_set("gen", str(seen), str(seen + 1)))
        if current == seen + 1:
            self._tcp.set(f"restart/{seen + 1}", f"{time.time():.6f}")
            self._tcp.multi_set([f"gen{seen}/moved/{r}" for r in range(world_size)], ["1"] * world_size)
            if self._tcp.add(f"announced/{current}", 1) == 1 and announce is not None:
                announce(current)
        return current

    def wait_moved(self, gen: int, rank: int, *, timeout_s: float) -> bool:
        """Block until ``rank``'s wake key of generation ``gen`` exists (the job left ``gen``, or
        :meth:`release_watch`); False after ``timeout_s``. One pending request, no polling: use a
        client of its own (:meth:`another_client`), as it holds the connection while it waits."""
        try:
            self._tcp.wait([f"gen{gen}/moved/{rank}"], timedelta(seconds=timeout_s))
        except DistStoreError as err:
            if "timeout" not in str(err):
                raise
            return False
        return True

    def release_watch(self, gen: int, rank: int) -> None:
        """End ``rank``'s :meth:`wait_moved` on ``gen`` (the rank leaves or ends that generation)."""
        self._tcp.set(f"gen{gen}/moved/{rank}", "1")

    def another_client(self) -> JobStore:
        """A second connection to the same store (for a thread that blocks in :meth:`wait_moved`)."""
        return JobStore(connect_store(self._tcp.host, self._tcp.port, is_master=False))

    def process_group_store(self, gen: int, *, init_timeout_s: float) -> GenerationBoundStore:
        """Generation ``gen``'s own namespace for ``init_process_group`` (tier 1+).

        Its reads wait at most ``init_timeout_s`` and end when the job's generation moves on.
        This object keeps it alive: torch holds only its C++ half, and calls into the Python
        methods fail ("Not implemented") once the Python object is collected (torch 2.13).
        """
        if gen not in self._pg_stores:
            self._pg_stores[gen] = GenerationBoundStore(
                PrefixStore(f"gen{gen}/pg/", self._tcp),
                generation=gen,
                current=self.generation,
                timeout_s=init_timeout_s,
            )
        return self._pg_stores[gen]

    def restart_times(self, up_to_gen: int) -> list[float]:
        keys = [f"restart/{g}" for g in range(1, up_to_gen + 1)]
        present = [k for k in keys if self._tcp.check([k])]
        return [float(v) for v in self._tcp.multi_get(present)] if present else []

    # -- giving up ---------------------------------------------------------
    def give_up(self, reason: str) -> None:
        if not self._tcp.check(["giveup"]):
            self._tcp.set("giveup", reason)

    def giveup_reason(self) -> str | None:
        return self._tcp.get("giveup").decode() if self._tcp.check(["giveup"]) else None

    # -- heartbeats --------------------------------------------------------
    def set_rank_heartbeat(self, rank: int, beat: Heartbeat) -> None:
        self._tcp.set(f"hb/{rank}", beat.encode())

    def set_rank_where(self, rank: int, where: str) -> None:
        self._tcp.set(f"where/{rank}", where)

    def rank_where(self, ranks: list[int]) -> dict[int, str]:
        """Where each of ``ranks`` last said its main thread was; ranks that never said are left out."""
        present = [r for r in ranks if self._tcp.check([f"where/{r}"])]
        values = self._tcp.multi_get([f"where/{r}" for r in present]) if present else []
        return {r: raw.decode() for r, raw in zip(present, values, strict=True)}

    def rank_heartbeats(self, ranks: list[int]) -> dict[int, Heartbeat]:
        """Heartbeats of ``ranks`` (the agent writes an initial one when it starts a rank)."""
        keys = [f"hb/{r}" for r in ranks]
        return {r: Heartbeat.parse(raw) for r, raw in zip(ranks, self._tcp.multi_get(keys), strict=True)}

    def set_agent_heartbeat(self, node: int, gen: int) -> None:
        """One supervision pass of ``node``'s agent, in generation ``gen``: bumps its beat counter.

        A counter, not a timestamp: observers time its changes on their own clock, so machines
        whose clocks disagree never take a live node for a silent one (or the reverse).
        """
        self._tcp.set(f"agent/{node}", str(gen))
        self._tcp.add(f"agent/{node}/beats", 1)

    def agent_heartbeat(self, node: int) -> tuple[int, int] | None:
        """``node``'s agent's (generation, beat count); None before its first beat."""
        key = f"agent/{node}"
        if not self._tcp.check([key]):
            return None
        return int(self._tcp.get(key)), self._tcp.add(f"{key}/beats", 0)

    # -- per-generation rendezvous and completion --------------------------
    def publish_master_port(self, gen: int, port: int) -> None:
        self._tcp.set(f"master_port/{gen}", str(port))

    def has_master_port(self, gen: int) -> bool:
        return self._tcp.check([f"master_port/{gen}"])

    def master_port(self, gen: int) -> int:
        return int(self._tcp.get(f"master_port/{gen}"))  # blocks until node 0 published it

    # -- membership (tiers 3-4) --------------------------------------------
    def set_member(self, rank: int, gen: int) -> None:
        self._tcp.set(f"member/{rank}", str(gen))

    def member(self, rank: int) -> int:
        """The generation ``rank``'s current process belongs to; -1 if never set."""
        key = f"member/{rank}"
        return int(self._tcp.get(key)) if self._tcp.check([key]) else -1

    def mark_started(self, gen: int, node: int) -> None:
        self._tcp.set(f"started/{gen}/{node}", "1")

    def was_started(self, gen: int, node: int) -> bool:
        """Whether ``node``'s ranks were started in ``gen`` (a replacement node then asks for a new one)."""
        return self._tcp.check([f"started/{gen}/{node}"])

    # -- the join barrier (tiers 3-4) ----------------------------------------
    def join(self, gen: int) -> int:
        """Count this rank into generation ``gen``; returns how many joined so far."""
        return self._tcp.add(f"gen{gen}/joined", 1)

    def joined(self, gen: int) -> int:
        return self._tcp.add(f"gen{gen}/joined", 0)

    # -- the step-commit vote (tiers 3-4) -----------------------------------
    def vote(self, gen: int, step: int) -> int:
        """Count this rank's vote for ``step`` of ``gen``; returns the votes so far."""
        return self._tcp.add(f"gen{gen}/vote/{step}", 1)

    def decide(self, gen: int, step: int, decision: str) -> bytes:
        """Write ``decision`` unless one exists; returns the decision that stands (exactly one per step)."""
        return self._tcp.compare_set(f"gen{gen}/decision/{step}", "", decision)

    def decision(self, gen: int, step: int) -> bytes | None:
        """The decision on ``step`` of ``gen``, or None while there is none."""
        key = f"gen{gen}/decision/{step}"
        return self._tcp.get(key) if self._tcp.check([key]) else None

    # -- tier 4 ------------------------------------------------------------
    def mark_state_recorded(self) -> None:
        """Some rank recorded a committed step in memory: a recovery can restore from memory."""
        self._tcp.set("state/recorded", "1")

    def forget_recorded_state(self) -> None:
        """No live copy of the recorded state is left (tier 4 starts over from the job's start)."""
        self._tcp.delete_key("state/recorded")

    def state_recorded(self) -> bool:
        return self._tcp.check(["state/recorded"])

    # -- completion ---------------------------------------------------------
    def mark_rank_finished(self, rank: int) -> None:
        """``rank`` trained to the end and passed its last collective (the final save included)."""
        self._tcp.set(f"finished/{rank}", "1")
        self._tcp.add("finished", 1)

    def rank_finished(self, rank: int) -> bool:
        return self._tcp.check([f"finished/{rank}"])

    def ranks_finished(self) -> int:
        """How many ranks passed their last collective: once one has, the job's output is complete."""
        return self._tcp.add("finished", 0)

    def mark_done(self, gen: int, node: int) -> None:
        self._tcp.set(f"done/{gen}/{node}", "1")

    def nodes_done(self, gen: int, nnodes: int) -> bool:
        return self._tcp.check([f"done/{gen}/{n}" for n in range(nnodes)])
