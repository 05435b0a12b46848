"""Tier 4: the state Lightning restores comes from memory (this rank's, or a peer's) instead of a file.

The recovery loop calls ``fit(ckpt_path=MEMORY_CHECKPOINT)``; Lightning hands that
to ``CheckpointlessStrategy.load_checkpoint``, which calls :meth:`MemoryRestore.restore`
(the strategy's ``InMemoryState``)
once the new generation's model and optimizers exist. There every rank:

1. reports what it holds (:class:`~ckless_lightning.replication.SnapshotCopies`):
   its live step (None if lost or untrusted), its own and held snapshot copies;
2. gathers every rank's report and computes the same plan
   (:func:`~ckless_lightning.replication.hsdp_sources` / ``buddy_sources``);
3. survivors copy their live (or rolled-back) tensors into the new model and
   optimizer; each replaced rank receives its shard from its source in
   checksummed buckets, in place (a bad bucket excludes that source and the
   plan is made again); loop counters, scheduler, data position, callbacks and
   RNG come as the pickled snapshot Lightning's own ``dump_checkpoint`` made
   after the committed step (sent by the source to a replaced rank);
4. verifies what it now holds, tensors and loop state, against the fingerprint
   its owner recorded for that step, which came with the reports
   (:mod:`~ckless_lightning.recovery.verify`);
   every rank learns every verdict, and a mismatch rejects that source (a
   ``restore_rejected`` event) and the plan is made again without it;
5. returns that checkpoint dict, so Lightning restores loops, callbacks and
   schedulers exactly as from a file.

If some state has no live copy, or none that verifies, every rank falls back to
the last disk checkpoint (or the job's start) and says which shards were lost
and what was rejected: never a guess.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckless_lightning.comm import Generation
from ckless_lightning.record.events import EventLog
from ckless_lightning.record.process_memory import peak_rss_bytes
from ckless_lightning.recovery.verify import Verdict, verify_restored
from ckless_lightning.replication import (
    RankReport,
    Rejected,
    SnapshotCopies,
    SourceMap,
    StateFingerprint,
    Transfer,
    TransferError,
    buddy_sources,
    hsdp_sources,
    transfer_bytes,
    transfer_tensors,
)
from ckless_lightning.replication.adopt import adopt_optimizer_state, adopt_parameters
from ckless_lightning.replication.buddy_links import form_buddy_links
from ckless_lightning.replication.loop_state import decode_loop_state
from ckless_lightning.replication.state import copy_into, local_state_tensors, set_param_groups
from ckless_lightning.replication.warmup import WarmUp, clip_norm_of, process_is_warm, warm_first_step
from ckless_lightning.runtime.checkpointing import latest_checkpoint

__all__ = ["MemoryRestore", "StartOver"]
_MAX_PLANS = 8  # plans after checksum or verification failures (each rejects a source) before the disk


class StartOver(RuntimeError):
    """Tier 4 lost some state and there is no disk checkpoint: every rank leaves the generation and
    the next one resumes from the job's start (``InProcessRecovery`` sees no recorded state)."""


class MemoryRestore:
    """Serves one generation's restore from memory. ``restore`` is called on every rank, collectively.

    Args:
        snapshots: this rank's store (kept by the recovery loop across generations).
        generation: the generation restoring (its mesh; ``snapshots.source`` picks "hsdp" or "buddy").
        checkpoint_dir: the disk fallback.
        bucket_bytes: transfer bucket size.
        events: where ``memory_restore`` events go.
        corrupt: test hook passed to the transfer (flips bytes in flight on a source).
        on_transfer: called on every rank as a transfer starts (fault injection's ``transfer`` phase).
        adopt_live: the generation resumes from memory (``MEMORY_CHECKPOINT``): a survivor's new model
            takes its live shards as parameters (:meth:`adopt`) instead of allocating new ones.
        warm_first_step: a rank that receives its state in a process that never stepped its optimizer
            (a replaced rank) warms DTensor's caches for its first step on the main thread while its
            transfer runs on another (:meth:`_receive_warming`).
    """

    def __init__(
        self,
        snapshots: SnapshotCopies,
        generation: Generation,
        *,
        checkpoint_dir: str | Path | None,
        bucket_bytes: int,
        events: EventLog | None = None,
        corrupt: Callable[[Transfer, int, torch.Tensor], None] | None = None,
        on_transfer: Callable[[], None] | None = None,
        adopt_live: bool = False,
        warm_first_step: bool = False,
    ) -> None:
        self.snapshots = snapshots
        self.generation = generation
        self.checkpoint_dir = checkpoint_dir
        self.bucket_bytes = bucket_bytes
        self.events = events
        self.corrupt = corrupt
        self.on_transfer = on_transfer or (lambda: None)
        self.adopt_live = adopt_live
        self.warm_first_step = warm_first_step
        self.warmed: WarmUp | None = None  # what the warm-up during the transfer did, if it ran
        self.adopted = False  # this rank's new model runs on its live shards (set by ``adopt``)

    def attach(self) -> None:
        """After the generation's process group exists: buddy copies get their own gloo pair groups.

        Host-memory copies travel beside the step's collectives (and NCCL cannot send CPU tensors),
        each rank's only to its buddy and from its ward: two groups of two ranks
        (:func:`~ckless_lightning.replication.buddy_links.form_buddy_links`), formed on the
        generation's store namespace (bounded, and ended by a generation change). Their operations
        time out with the generation's collectives (gloo's default is 30 minutes), and so does every
        wait for an exchange (:attr:`SnapshotCopies.wait_timeout_s`).
        """
        copies, gen = self.snapshots, self.generation
        if copies.source == "buddy":
            timeout = timedelta(seconds=gen.pg_timeout_s)
            store = gen.store.process_group_store(gen.number, init_timeout_s=gen.init_timeout_s)
            copies.attach(
                form_buddy_links(
                    store,
                    rank=copies.rank,
                    world_size=copies.world_size,
                    offset=copies.buddy_offset,
                    timeout=timeout,
                )
            )
            copies.wait_timeout_s = gen.pg_timeout_s

    def adopt(self, module: torch.nn.Module) -> bool:
        """Before the optimizers exist, on the model still on meta: a survivor's live shards become
        its parameters (no initialization, no second copy). False where there is nothing to adopt
        (a replaced rank, untrusted state, a model the capture does not fit): allocate instead."""
        capture = self.snapshots.capture
        self.adopted = self.adopt_live and capture is not None and adopt_parameters(module, capture.params)
        return self.adopted

    def restore(
        self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> dict[str, Any] | Path:
        """The checkpoint dict of the committed step (state already in ``module``/``optimizers``,
        verified; its ``ckless_rng`` is this rank's RNG state, which the strategy sets when training
        starts), or the disk checkpoint to load instead. Raises if neither exists."""
        snapshots = self.snapshots
        rank = dist.get_rank()
        if self.adopted:
            assert snapshots.capture is not None
            adopt_optimizer_state(module, optimizers, snapshots.capture.params)
        reports = [None] * dist.get_world_size()
        # By this generation's rank: an elastic generation's ranks are a subset of the job's.
        dist.all_gather_object(reports, replace(snapshots.report(), rank=rank))
        by_rank = {r.rank: r for r in reports}  # type: ignore[union-attr]
        tensors = local_state_tensors(module, optimizers, allocate=True)
        rejected = Rejected()
        reasons: list[str] = []  # what was rejected, for the log and the fallback's reason
        for _ in range(_MAX_PLANS):
            plan = self._plan(rejected.apply(by_rank), rejected.pairs)
            if plan.fallback:
                return self._fall_back(plan, reasons)
            assert plan.step is not None
            loop = self._fill(plan, rank, tensors)
            if self.warm_first_step and rank in plan.lost and not process_is_warm():
                bad = self._receive_warming(plan, rank, tensors, optimizers, clip_norm_of(module))
            else:
                bad = self._receive(plan, rank, tensors)
            if bad:
                rejected |= Rejected(pairs=bad)
                pairs = [(p.src, p.dst) for p in sorted(bad, key=str)]
                reasons.append(f"transfers {pairs} failed their checksum")
                self._emit("transfer_rejected", pairs=pairs)
                continue
            payload = self._receive_loop(plan, rank, loop)
            mine, failed = self._verify(plan, rank, tensors, payload, by_rank)
            if failed:
                for verdict in failed:
                    rejected |= verdict.rejection()
                    reasons.append(verdict.describe())
                continue
            if rank in plan.lost:  # its state now, verified: recorded as its own (a later restore's)
                self._record(plan.step, mine)
            checkpoint = decode_loop_state(payload)
            set_param_groups(optimizers, [s["param_groups"] for s in checkpoint["optimizer_states"]])
            snapshots.resumed_at(plan.step, payload)
            self._emit(
                "memory_restore",
                step=plan.step,
                lost=list(plan.lost),
                sources=[(p.src, p.dst) for p in plan.transfers],
                rollback=sorted(plan.rollback),
                reason=plan.reason,
                verified=True,
                rejected=reasons,
                peak_rss=peak_rss_bytes(),  # since state_released (its rss): what the recovery added
            )
            if rank == 0:
                print(f"tier 4: {plan.reason}, verified", file=sys.stderr)
            return checkpoint
        return self._fall_back(
            SourceMap(None, (), frozenset(), tuple(sorted(by_rank)), "no source left after rejections"),
            reasons,
        )

    # -- pieces ----------------------------------------------------------------------------------------
    def _plan(self, reports: dict[int, Any], exclude: frozenset[Transfer]) -> SourceMap:
        if self.snapshots.source == "hsdp":
            replicate, shard = self.generation.mesh
            return hsdp_sources(reports, replicate=replicate, shard=shard, exclude=exclude)
        world = self.snapshots.world_size
        offset = self.snapshots.buddy_offset
        return buddy_sources(reports, buddy_of=lambda r: (r + offset) % world, exclude=exclude)

    def _fill(self, plan: SourceMap, rank: int, tensors: list[torch.Tensor]) -> bytes:
        """Survivors put their state of ``plan.step`` into the new tensors; returns its loop bytes."""
        snapshots = self.snapshots
        if self.adopted and (rank in plan.lost or rank in plan.rollback):
            # The live capture is this model's storage, about to be overwritten: no longer a capture.
            snapshots.drop_capture()
        if rank in plan.lost:
            return b""
        if rank in plan.rollback:
            copy = snapshots.own_copy(plan.step)  # type: ignore[arg-type]
            copy_into(tensors, copy.buffer.views)
            return copy.loop_bytes()
        capture = snapshots.capture
        assert capture is not None and capture.step == plan.step, (capture, plan)
        copy_into(tensors, capture.tensors)
        return capture.loop

    def _receive(self, plan: SourceMap, rank: int, tensors: list[torch.Tensor]) -> frozenset[Transfer]:
        """Run the plan's transfers (all in parallel); returns the pairs whose checksum failed."""
        if not plan.transfers:
            return frozenset()
        self.on_transfer()
        return self._transfer(plan, rank, tensors)

    def _transfer(self, plan: SourceMap, rank: int, tensors: list[torch.Tensor]) -> frozenset[Transfer]:
        send: list[torch.Tensor] = tensors
        source_of = {p.src: p for p in plan.transfers}
        if rank in source_of and self.snapshots.source == "buddy":
            send = list(self.snapshots.held_copy(plan.step).buffer.views)  # type: ignore[arg-type]
        ok = transfer_tensors(plan.transfers, send, bucket_bytes=self.bucket_bytes, corrupt=self.corrupt)
        return frozenset(p for p in plan.transfers if not ok[p.dst])

    def _receive_warming(
        self,
        plan: SourceMap,
        rank: int,
        tensors: list[torch.Tensor],
        optimizers: list[torch.optim.Optimizer],
        clip_norm: float | None = None,
    ) -> frozenset[Transfer]:
        """:meth:`_receive` on a helper thread while this (the training) thread warms the first step
        (its clipping to ``clip_norm``, None: none, and its optimizer step).

        DTensor's caches are per thread, so the warm-up must run here; the transfer touches only
        local tensors (no DTensor dispatch) and is the only communication while both run (the
        warm-up makes none), so the collectives keep their order. This thread then waits for the
        transfer in this file's frame: the rank's position reads ``peers``, as in the transfer itself
        (the agent's hang blame, the generation watch's left-behind exit). The helper is a daemon: a
        transfer stuck in C++ does not keep a process that exits from ending.
        """
        if not plan.transfers:
            return frozenset()
        self.on_transfer()  # here: a fault injected in it (a hang) is where the rank's position says
        done = threading.Lock()
        done.acquire()
        outcome: list[Any] = []

        def transfer() -> None:
            try:
                outcome.append(self._transfer(plan, rank, tensors))
            except BaseException as err:  # re-raised on the training thread below
                outcome.append(err)
            finally:
                done.release()

        helper = threading.Thread(target=transfer, name="tier4-transfer", daemon=True)
        helper.start()
        try:
            self.warmed = warm_first_step(optimizers, clip_norm)
        finally:  # whatever the warm-up did, the transfer in flight is waited for, never left behind
            done.acquire()  # a C lock: the innermost Python frame stays this one (``peers``)
            helper.join()
        self._emit(
            "rank_phase",
            phase="first_step_warmed",
            step=None,
            seconds=round(self.warmed.seconds, 6),
            params=self.warmed.params,
            clipped=self.warmed.clipped,
            skipped=list(self.warmed.skipped),
            during="transfer",
        )
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _receive_loop(self, plan: SourceMap, rank: int, own_loop: bytes) -> bytes:
        if not plan.transfers:
            return own_loop
        payload: bytes | None = None
        if any(p.src == rank for p in plan.transfers):
            payload = (
                self.snapshots.held_copy(plan.step).loop_bytes()  # type: ignore[arg-type]
                if self.snapshots.source == "buddy"
                else own_loop
            )
        try:
            received = transfer_bytes(plan.transfers, payload)
        except TransferError as err:
            raise RuntimeError(f"loop state transfer failed its checksum: {err}") from err
        return received if rank in plan.lost else own_loop  # type: ignore[return-value]

    def _verify(
        self,
        plan: SourceMap,
        rank: int,
        tensors: list[torch.Tensor],
        loop: bytes,
        reports: dict[int, RankReport],
    ) -> tuple[Verdict, list[Verdict]]:
        """Every rank checks what it holds against its recorded fingerprint (in ``reports``, as
        gathered); returns this rank's verdict and every rank's failed ones (the same list on every
        rank), each failure also a ``restore_rejected`` event."""
        verdict = verify_restored(
            plan,
            rank,
            tensors,
            loop,
            reports=reports,
            job_rank=self.generation.job_rank,
            buddy=self.snapshots.source == "buddy",
        )
        if not verdict.ok:
            if self.events is not None:  # by job rank, like the records it was checked against
                self.events.emit("restore_rejected", gen=self.generation.number, **verdict.event_fields())
            print(f"tier 4: rejected {verdict.describe()}", file=sys.stderr)
        verdicts: list[Verdict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, verdict)
        return verdict, [v for v in verdicts if v is not None and not v.ok]

    def _record(self, step: int, verdict: Verdict) -> None:
        """A restored rank's state, verified, recorded as its own for ``step`` (in this generation)."""
        assert verdict.got is not None and verdict.step == step, (verdict, step)
        self.snapshots.remember(replace(StateFingerprint.parse(verdict.got), gen=self.generation.number))

    def _fall_back(self, plan: SourceMap, rejected: list[str] | None = None) -> Path:
        disk = latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir is not None else None
        self.snapshots.resumed_at(None, timeline=self.generation.number)
        if rejected:
            plan = replace(plan, reason=f"{plan.reason} (rejected: {'; '.join(rejected)})")
        self._emit(
            "memory_restore",
            step=None,
            lost=list(plan.lost),
            reason=plan.reason,
            rejected=rejected or [],
            fallback=str(disk) if disk else None,
        )
        if disk is None:
            # Every rank computed the same plan: the state is gone for good. The job's start is
            # still exact (seeded init, step-addressed data), so every rank leaves this generation
            # and the next one resumes from it, as a requeue would, without leaving the job.
            self.generation.store.forget_recorded_state()
            raise StartOver(
                f"tier 4: {plan.reason}, and there is no disk checkpoint in {self.checkpoint_dir}: "
                "every rank starts over from the job's start (set checkpoint.every_n_steps to lose less)"
            )
        if dist.get_rank() == 0:
            print(f"tier 4: {plan.reason}; loading {disk}", file=sys.stderr)
        return disk

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, rank=dist.get_rank(), gen=self.generation.number, **fields)
