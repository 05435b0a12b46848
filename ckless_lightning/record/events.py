"""The job's recovery timeline: ``<run_dir>/events.jsonl``, one JSON object per line.

Every agent and every rank appends to the same file while the job runs; the
summary at the end of ``launch.py`` (:mod:`ckless_lightning.record.summary`) reads it
back. A leaf module: no torch, no Lightning, so the agent can use it.

Every record has ``t`` (``time.time()`` of the event, or a time the emitter
measured itself), ``kind`` and ``source`` (who wrote it: ``"agent0"``,
``"rank3"``, ...). Generation ``gen`` 0 is the first start; each recovery
bumps it. Steps are optimizer steps, 1-based: step N is the one whose loss is
line N of ``losses.jsonl``. The kinds and their fields:

``job_start`` {tier, world_size, nnodes}
    The agent starts the job.
``ranks_started`` {gen, node, ranks: [int], pids: [int], warm: [bool], forked: [bool]}
    One per (re)start of a node's ranks; ``warm[i]``: ranks[i] went to a warm spare; ``forked[i]``:
    the fork server forked it (``agent.fork_server``; neither: a cold process).
``forkserver_started`` {pid}, ``forkserver_ready`` {pid, start_s, prepare_s, modules},
``forkserver_lost`` {pid, reason, exit_code}
    The agent started its fork server; the server imported and prepared the rank path
    (``start_s`` after it started); it died (``exit_code``: its return code, None while it ran),
    was stopped or did not answer within its bound (killed; the ranks start cold until a new one,
    after a back-off, is ready).
``rank_phase`` {rank, gen, phase, step: int | None}
    A rank reached a phase of (re)starting, in this order:
    ``process_start`` (t = the process spawn time, or for a warm spare the time it
    was given its rank), ``imports_done``, ``comm_init_start``, ``comm_init_done``,
    ``state_load_start``, ``state_load_done`` (step = the optimizer step restored,
    0 when starting fresh), ``data_ready`` (the first batch of this process
    fetched), ``first_step_done`` (step = the first optimizer step this process
    completed). A phase a tier skips is not emitted. In-process recovery (tiers 3-4)
    adds, before ``comm_init_start``: ``recovery_start`` (gen = the failed generation;
    ``error``: what this rank saw; ``own``: it was this rank's own error, not a lost peer or a moved
    generation, nor a start-over; ``start_over``: present, true, when tier 4 lost state it had no disk
    checkpoint for and every rank starts over: the recovery of an earlier fault, not a new one;
    ``completed_step``: the last step it had completed),
    ``generation_left`` (its process group dropped),
    ``generation_joined`` (gen = the new generation: every rank is in it), and
    ``resume_chosen`` (``resumed_from``: the checkpoint, or "memory" at tier 4).
    Also: ``model_ready`` {weights: "initialized" | "allocated" | "adopted", seconds}
    (the strategy materialized the model), ``state_released`` {rss, peak_reset, gc_s} (the
    old generation is gone: the steady state a recovery's memory is measured against),
    ``live_captured`` {trusted, why} (tier 4, on leaving a generation: whether this rank
    offers its live state to the recovery, and why not), ``stuck_cut`` (the rank's
    generation watch cut its connections: it was still in a generation the job had left),
    ``stuck_reset`` {reset, sends} (still blocked on peers half a second after that cut: the watch
    reset its connections and wrote on every gloo one, ``recovery/sever.py``'s ``unstick``),
    ``left_behind_exit`` (still blocked on peers ``comm.stuck_exit_s`` after that cut: the rank
    exits with code 6 for its agent to replace it), ``finished_at_fault`` {error} (a fault
    reached the rank after a peer had finished the job: it was in or past the last collective,
    so it ends as finished instead of starting a generation nobody else would join),
    ``spare_handed`` / ``spare_ready`` {handover_s, modules} (a prepared spare took the rank).
``spare_started`` {pid}, ``spare_prepared`` {pid, start_s, prepare_s, modules}, ``spare_lost``
{pid, reason, exit_code}
    The agent started a spare; the spare is ready to be handed a rank; a spare died or was
    stopped before it was handed one (the pool replaces it).
``spare_imports`` {rank, gen, count, names}
    After training, a rank a spare took: the modules it still imported after the hand-over.
``fault_injected`` {rank, step, phase, fault_type, injected_by: "inside" | "outside" | "chaos"}
    A test fault hit ``rank`` during optimizer step ``step`` (its ``phase``:
    forward, backward, ...); steps 1..step-1 were complete. ``chaos`` (``fault=chaos``, with
    ``pid``): the agent's SIGKILL (``kill``) or SIGSTOP (``hang``); ``step`` None before step 1.
``process_fault_injected`` {target: "spare" | "reader", signal: "kill" | "stop" | "stall", pid?, step?}
    A test fault hit a process that is not a rank (``fault=chaos``; ``fault=reader_stall``: the
    reader stopped building at loader step ``step``). It costs no recovery; ``process_fault_missed``
    {target, pid}: the chosen process had exited before the signal.
``reader_started`` {node, pid, root, forked}, ``reader_restarted`` {node, exit_code, stopped, reason,
owed_step?, owed_s?}
    Tier 2+: the node's batch-cache reader was started (``forked``: from the fork server, else
    cold); it was restarted because it ``exited``,
    was ``stopped`` (killed first), made ``no_progress`` (left ``owed_step``, which a rank waits
    for, unbuilt ``owed_s`` > ``data.reader_timeout_s`` seconds once it was ready), or was
    ``no_start`` (not ready ``owed_s`` seconds after its start; ``owed_step`` -1).
``rank_lost_after_end`` {rank, exit_code, gen}
    Tiers 3-4: a rank died after a peer had passed its last collective (the job's output was
    complete); it is counted as finished, not replaced.
``fault_detected`` {by, rank, reason: "exit" | "hang" | "node_lost", exit_code: int | None, completed_step:
int | None; for a hang also stopped, stale_ranks, where: {rank: "running" | "data" | "peers"}}
    ``by`` (a source name) noticed that ``rank`` failed; ``completed_step`` is the
    last optimizer step that rank reported complete (its heartbeat), so the fault
    hit the step in progress, ``completed_step + 1``; None, or -1 for a rank still
    starting up, if unknown.
``ranks_stopped`` {gen, node, ranks}
    The agent of ``node`` stopped these ranks of generation ``gen``.
``generation`` {gen, reason}
    The job moved to generation ``gen`` (an agent, or at tiers 3-4 the first rank to leave);
    ``reason``: ``fault``, or an elastic resize's ``shrink`` / ``grow``.
``elastic_resize`` {gen, reason: "shrink" | "grow", active: [int], replicas, dp_size, missing | returning}
    Elastic HSDP: generation ``gen`` trains the job ranks ``active`` (``replicas`` replicas,
    data-parallel width ``dp_size``): without the replicas of the ``missing`` ranks (none replaced
    within ``agent.replace_timeout``), or with the ``returning`` replica back. The rank that moved
    the job emits it, once. A rank outside the set reports ``rank_phase`` ``standby`` {active}.
``slot_lost`` {rank, node, return_step}, ``slot_returned`` {rank, node, gen, completed_step}
    ``fault=slot_lost``: the agent killed ``rank`` and starts nothing in its place until the job
    completed ``return_step`` (None: never); it is back (a process started in ``gen``).
``commit_votes`` {rank, votes, vote_s, vote_cpu_s, recoveries, snapshots, snapshot_s, snapshot_cpu_s,
exchange_wait_s, host_copy_bytes, digests, digest_s}
    Tiers 3-4, at the end of a rank's training: the commit votes it cast and the
    seconds spent in them (wall, and CPU time of the rank's main thread), its in-process
    recoveries, and (tier 4) its per-step snapshots, their cost (wall and CPU), the wait
    for buddy exchanges and the host memory of copies.
``state_disagreement`` {rank, gen, step, part, suspects, times, trusted_step, digests}
    Tiers 3-4, HSDP: the vote on ``step`` found ``suspects``' state digests unlike their
    replicas' (written by the rank that decided): the step is abandoned, checkpoints after
    ``trusted_step`` are set aside (``<name>.suspect-gen<g>``), and no rank's live state is
    trusted in the recovery: the job resumes from the last checkpoint up to ``trusted_step``.
    ``times``: how often each suspect disagreed in the job.
``suspect_hardware`` {rank, gen, step, times}
    A rank's state disagreed ``times`` (>= 2) times: it exits (code 5) and is replaced.
``memory_restore`` {rank, gen, step, lost, sources, rollback, reason, verified, rejected, fallback?}
    Tier 4, per rank and recovery: the committed step restored (None: fell back to
    the disk checkpoint ``fallback``, or to the job's start when None too), the lost ranks, the
    (source, destination) transfers, the ranks that rolled back to their own copy, and why;
    ``verified``: every rank's state matched the fingerprint recorded for the step; ``rejected``:
    what this restore rejected before (one line each).
``transfer_rejected`` {rank, gen, pairs}
    Tier 4: these (source, destination) transfers failed their checksum; re-planned.
``restore_rejected`` {rank, gen, state, holder, step, problem, expected, got, reason}
    Tier 4, by the rank whose restored state failed its verification (``rank``: its job rank):
    what it held (``state``: ``live``, ``own`` copy, ``buddy`` copy held by ``holder``, ``replica``
    ``holder``'s shard) did not match the fingerprint recorded for ``step`` (``problem``:
    ``tensors``, ``loop``, both, or ``no fingerprint recorded``); never trained on: the restore
    plans again without that source. ``expected`` / ``got``: ``<step> <gen> <tensors> <loop>``.
``rank_end`` {rank, pid, threads, thread_names, tcp_sockets, tcp_states, tcp_peers, process_groups}
    Tiers 3-4: a rank's process after training (leak checks; ``tcp_peers``:
    ``"local_port->host:port STATE"``).
``giveup`` {reason, exit_code}
    The agent stopped recovering (e.g. fault budget spent); the job exits with ``exit_code``.
``interrupted`` {node, signal}
    The agent of ``node`` got ``signal`` (SIGTERM: a scheduler's preemption or an operator; SIGINT)
    and stops its ranks: what happens to the job after this is its end, not a fault.
``job_end`` {exit_code, final_step}
    The agent ends the job.
``fenced`` {node, reason, pids, silent_s (``store``) | unreached (``peers``)}
    The agent of ``node`` killed its ranks ``pids`` itself: ``store``, no answer from the job store
    for ``silent_s`` (``agent.fence_after``, ``agent/store_lease.py``); ``peers``, the job's verdict
    says the node is cut off from the other nodes (``unreached``: the agents it could not reach,
    ``agent/peer_reach.py``).
``unfenced`` {node, owned}
    The store answers the agent again; ``owned``: the node is still its own.
``peers_cut_off`` {node, cut_off: [int], gen, round}
    The agent of ``node`` read the verdict of check ``round`` of ``gen`` that nodes ``cut_off`` are cut
    off from the others; its own ranks get a fresh ``agent.hang_timeout`` for the job's move.
``agent_replaced`` {node, by}
    An agent found its node taken over by ``by`` (a standby) and left it.

Emitters may add fields to these, and kinds of their own (the summary ignores
what it does not know); ``EVENT_KINDS`` lists the kinds documented here.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = [
    "EVENT_KINDS",
    "MAX_RECORD_BYTES",
    "RANK_PHASES",
    "RECOVERY_PHASES",
    "EventLog",
    "read_events",
    "read_jsonl",
]

EVENT_KINDS = (
    "job_start",
    "ranks_started",
    "rank_phase",
    "fault_injected",
    "fault_detected",
    "ranks_stopped",
    "generation",
    "giveup",
    "interrupted",
    "job_end",
    "commit_votes",
    "state_disagreement",
    "suspect_hardware",
    "memory_restore",
    "transfer_rejected",
    "restore_rejected",
    "rank_end",
    "spare_started",
    "spare_prepared",
    "spare_lost",
    "spare_imports",
    "process_fault_injected",
    "process_fault_missed",
    "reader_started",
    "reader_restarted",
    "rank_lost_after_end",
    "fenced",
    "unfenced",
    "peers_cut_off",
    "agent_replaced",
)

RECOVERY_PHASES = ("recovery_start", "generation_left", "generation_joined", "resume_chosen")

RANK_PHASES = (
    "process_start",
    "imports_done",
    "comm_init_start",
    "comm_init_done",
    "state_load_start",
    "state_load_done",
    "data_ready",
    "first_step_done",
)

# One os.write of an O_APPEND file is atomic against other appenders on local
# filesystems for writes well under a page; records stay below this.
MAX_RECORD_BYTES = 3072


class EventLog:
    """Appends events to one JSONL file shared by many processes.

    Each :meth:`emit` opens the file with ``O_APPEND`` and writes the whole line
    with a single ``os.write``, so concurrent writers never interleave lines.
    Holds no open file, so it is safe to create before a fork.
    """

    def __init__(self, path: str | Path, source: str) -> None:
        self.path = Path(path)
        self.source = source

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append ``{"t", "kind", "source", **fields}`` and return it; ``fields`` may override ``t``.

        Raises ``ValueError`` for a record of ``MAX_RECORD_BYTES`` or more.
        """
        record: dict[str, Any] = {"t": time.time(), "kind": kind, "source": self.source, **fields}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if len(line) >= MAX_RECORD_BYTES:
            raise ValueError(
                f"event {kind!r} from {self.source} is {len(line)} bytes; records must stay under "
                f"{MAX_RECORD_BYTES} bytes so that concurrent appends stay atomic"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
        finally:
            os.close(fd)
        if written != len(line):
            raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
        return record


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL file in file order; ``[]`` if the file does not exist.

    A last line that does not parse is a record torn by a writer that died
    mid-write and is skipped; an unparsable line anywhere else is corruption
    and raises ``ValueError`` naming the file and line number.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if i == last:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record ({err.msg}): {line[:80]!r}") from err
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{i + 1}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of ``path`` sorted by ``t`` (equal times keep file order); see :func:`read_jsonl`."""
    return sorted(read_jsonl(path), key=lambda event: float(event["t"]))
