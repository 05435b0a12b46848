"""Every wait of a recovery is bounded and notices a new generation (one process, a real TCPStore).

- Process-group formation (``GenerationBoundStore``): real gloo groups formed by two of three
  ranks (threads) block until the job's generation moves on, then fail at once; with the
  generation unchanged they fail after ``comm.init_timeout_s``, naming the key.
- The join barrier (``GenerationSession.join``) gives the job up after ``comm.join_timeout_s``.
- Heartbeats carry their phase; the agent's silence limit follows it.
- The step vote abandons a step of a generation the job left, whoever votes last.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckless_lightning.agent.policies import silence_limit
from ckless_lightning.comm import Generation, GenerationChanged, Heartbeat, JobStore
from ckless_lightning.recovery.commit import StepCommit
from ckless_lightning.recovery.session import GenerationSession, JobFinished, JobGaveUp
from ckless_lightning.recovery.watch import GenerationWatch
from ckless_lightning.runtime.config import AgentConfig


@pytest.fixture
def store():
    job_store = JobStore.host("127.0.0.1", 0, secret="test-job-secret-0123456789")
    assert job_store.generation() == 0  # creates the key, as the hosting agent does
    yield job_store
    del job_store


def _form_groups(
    store: JobStore, ranks: list[int], world: int, timeout_s: float
) -> tuple[dict[int, BaseException], list[threading.Thread]]:
    """Ranks ``ranks`` of ``world`` form a gloo group in threads; returns what each raised, and the threads.

    A thread holds its group until every thread has formed or failed: a group dropped at once closes
    its connections while a slower peer may still be reading its handshake on them (that peer then
    fails with "Connection closed by peer", as it did once in CI).
    """
    errors: dict[int, BaseException] = {}
    all_done = threading.Barrier(len(ranks))

    def form(rank: int) -> None:
        bounded = store.process_group_store(0, init_timeout_s=timeout_s)
        group = None
        try:
            group = dist.ProcessGroupGloo(bounded, rank, world, timedelta(seconds=120))
        except BaseException as err:
            errors[rank] = err
        all_done.wait(timeout=timeout_s + 30)
        del group

    threads = [threading.Thread(target=form, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    return errors, threads


@pytest.mark.timeout(60)
def test_group_formation_ends_when_the_generation_moves_on(store):
    errors, threads = _form_groups(store, [0, 1], world=3, timeout_s=60)
    time.sleep(1.0)  # both now wait for rank 2's address, which never comes
    assert all(t.is_alive() for t in threads)
    moved = time.monotonic()
    store.advance_generation(0, world_size=3)
    for t in threads:
        t.join(timeout=10)
    took = time.monotonic() - moved
    assert not any(t.is_alive() for t in threads)
    assert sorted(errors) == [0, 1]
    assert all("generation 0 ended (now 1)" in str(e) for e in errors.values()), errors
    assert took < 10.0, f"formation noticed the new generation after {took:.2f} s"  # not its 60 s bound


@pytest.mark.timeout(60)
def test_group_formation_is_bounded_by_init_timeout(store):
    start = time.monotonic()
    errors, threads = _form_groups(store, [0, 1], world=3, timeout_s=1.5)
    for t in threads:
        t.join(timeout=20)
    took = time.monotonic() - start
    assert sorted(errors) == [0, 1]
    assert all("comm.init_timeout_s" in str(e) for e in errors.values()), errors
    assert 1.5 <= took < 10.0


def test_group_formation_succeeds_when_everyone_comes(store):
    errors, threads = _form_groups(store, [0, 1, 2], world=3, timeout_s=30)
    for t in threads:
        t.join(timeout=30)
    assert errors == {}


def test_bounded_store_read_raises_generation_changed(store):
    bounded = store.process_group_store(0, init_timeout_s=30)
    assert store.process_group_store(0, init_timeout_s=30) is bounded  # kept alive by the JobStore
    bounded.set("present", "1")
    assert bounded.get("present") == b"1"
    store.advance_generation(0, world_size=3)
    with pytest.raises(GenerationChanged):
        bounded.get("absent")


@pytest.mark.timeout(60)
def test_join_barrier_gives_up_after_join_timeout(store):
    store.set_member(0, 0)
    session = GenerationSession(store, rank=0, world_size=2, generation=0, join_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(JobGaveUp, match=r"1 of 2 ranks joined .*no process of ranks 1 reached it"):
        session.join()
    assert 1.0 <= time.monotonic() - start < 10.0
    assert "comm.join_timeout_s=1" in store.giveup_reason()
    assert store.rank_heartbeats([0])[0].phase == "recovery"


@pytest.mark.timeout(60)
def test_join_barrier_ends_when_a_peer_finished_the_job(store):
    # A peer passed its last collective while this rank left it with an error (a collective that lets
    # some ranks out while a stopped rank holds the rest): the job is over, the barrier never fills.
    store.set_member(0, 0)
    store.mark_rank_finished(1)
    session = GenerationSession(store, rank=0, world_size=2, generation=0, join_timeout_s=30.0)
    start = time.monotonic()
    with pytest.raises(JobFinished, match="the job finished while it joined generation 0"):
        session.join()
    assert time.monotonic() - start < 5.0
    assert store.giveup_reason() is None


def test_heartbeat_phase_round_trip_and_limits():
    beat = Heartbeat(3, 7, 12.5, "recovery")
    assert Heartbeat.parse(beat.encode().encode()) == beat
    assert Heartbeat.parse(b"3 7 12.5").phase == "step"  # a beat written without a phase
    cfg = AgentConfig(hang_timeout=5, startup_timeout=50, recovery_timeout=20, save_timeout=90)
    assert silence_limit(Heartbeat(0, 7, 0.0), cfg) == 5
    assert silence_limit(Heartbeat(0, -1, 0.0), cfg) == 50
    assert silence_limit(Heartbeat(0, 7, 0.0, "recovery"), cfg) == 20
    assert silence_limit(Heartbeat(0, 7, 0.0, "save"), cfg) == 90


def test_a_checkpoint_save_is_a_declared_phase(tmp_path):
    """A rank beats phase ``save`` as a checkpoint is assembled (its long write is not a hang) and
    ``step`` again at the next batch; the beats carry the completed step."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from ckless_lightning.training.callbacks import HeartbeatCallback

    class Beats:
        def __init__(self) -> None:
            self.seen: list[tuple[int, str]] = []

        def set_rank_heartbeat(self, rank: int, beat: Heartbeat) -> None:
            if not self.seen or self.seen[-1] != (beat.completed_step, beat.phase):
                self.seen.append((beat.completed_step, beat.phase))

    beats = Beats()
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_steps=4,
        callbacks=[
            HeartbeatCallback(beats, rank=0, generation=0),  # type: ignore[arg-type]
            ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(BoringModel())
    assert (2, "save") in beats.seen and (4, "save") in beats.seen, beats.seen
    assert beats.seen[beats.seen.index((2, "save")) + 1] == (2, "step"), beats.seen


def test_agent_heartbeat_is_a_counter_not_a_clock(store):
    assert store.agent_heartbeat(1) is None
    store.agent_pass_write(1, 4, 1, {})
    store.agent_pass_write(1, 5, 2, {})
    assert store.agent_heartbeat(1) == (5, 2)


def test_generation_watch_cuts_a_rank_left_behind_and_nothing_else(store):
    """The watch acts once the job moved past its generation and the rank did not leave within the
    grace; stopped in time (the rank left on its own), it never acts."""
    cuts: list[float] = []

    def watch(rank: int, on_stuck) -> GenerationWatch:  # each rank's own waiting connection
        return GenerationWatch(store, 0, rank, waiter=store.another_client(), on_stuck=on_stuck, grace_s=0.3)

    left_behind = watch(0, lambda: cuts.append(time.monotonic()))
    leaves = watch(1, lambda: cuts.append(-1.0))
    ends = watch(2, lambda: cuts.append(-2.0))
    for watch in (left_behind, leaves, ends):
        watch.start()
    time.sleep(0.2)
    assert not cuts  # the generation has not moved
    ends.stop()  # this rank's fit ended in generation 0: its watch is released, the others wait on
    assert not ends.fired and left_behind._thread.is_alive() and leaves._thread.is_alive()
    moved = time.monotonic()
    store.advance_generation(0, world_size=3)
    time.sleep(0.1)
    leaves.stop()  # this rank started leaving within the grace
    time.sleep(0.6)
    left_behind.stop()
    # woken by the move, not by its bounded re-check (600 s): the cut comes one grace after it
    assert len(cuts) == 1 and 0.3 <= cuts[0] - moved < 0.3 + 5.0, cuts
    assert left_behind.fired and not leaves.fired


def test_generation_watch_that_missed_its_wake_up_rechecks_the_generation(store):
    """A watch blocks in the store until woken; if the mover died between moving the job and waking
    the watches, the watch's bounded wait ends, it re-reads the generation and acts on it."""
    waiter = store.another_client()
    cuts: list[int] = []
    watch = GenerationWatch(
        store, 0, 0, waiter=waiter, on_stuck=lambda: cuts.append(1), grace_s=0.0, recheck_s=0.3
    )
    watch.start()
    store._tcp.compare_set("gen", "0", "1")  # a mover killed before it woke the watches
    time.sleep(0.8)
    assert cuts == [1] and watch.fired
    watch.stop()


@pytest.mark.timeout(60)
def test_generation_watch_ends_a_rank_the_cut_cannot_free(store):
    """After its cut, a rank still blocked on peers ``exit_after_s`` in a row (here the main thread in
    ``init_process_group``, waiting in C++ for a peer's address that never comes, as gloo waits for a
    peer that left while it connects) is ended for its agent to replace it; never before the cut,
    and never a rank that started leaving."""
    from torch.distributed import PrefixStore

    ended: list[float] = []
    watch = GenerationWatch(
        store,
        0,
        0,
        waiter=store.another_client(),
        on_stuck=lambda: None,
        grace_s=0.1,
        on_left_behind=lambda: ended.append(time.monotonic()),
        exit_after_s=1.0,
    )
    watch.start()
    started = time.monotonic()  # before the timer starts: the move comes >= 0.5 s after this
    mover = threading.Timer(0.5, lambda: store.advance_generation(0, world_size=2))
    mover.start()
    with pytest.raises(RuntimeError):  # rank 1 never publishes its address: torch's own bound ends it
        dist.init_process_group(
            "gloo",
            store=PrefixStore("never-formed", store.another_client()._server),
            rank=0,
            world_size=2,
            timeout=timedelta(seconds=5),
        )
    watch.stop()
    mover.join()
    assert len(ended) == 1 and 0.5 + 0.1 + 1.0 <= ended[0] - started < 4.5, (ended, started)


def test_generation_watch_unsticks_a_rank_blocked_on_peers_once_before_it_ends_it(store):
    """After the cut: blocked on peers ``unstick_after_s`` in a row, ``on_unstick`` once (in a thread
    of its own; ``recovery.sever.unstick``), then the end at ``exit_after_s`` if that did not free
    it; a computing rank gets neither."""
    for where in ("peers", "running"):
        calls: list[tuple[str, float]] = []
        watch = GenerationWatch(
            store,
            store.generation(),
            0,
            waiter=store.another_client(),
            on_stuck=lambda calls=calls: calls.append(("cut", time.monotonic())),
            grace_s=0.0,
            on_left_behind=lambda calls=calls: calls.append(("end", time.monotonic())),
            exit_after_s=1.5,
            on_unstick=lambda calls=calls: calls.append(("unstick", time.monotonic())),
            unstick_after_s=0.3,
        )
        watch._sample = lambda where=where: where  # the main thread's position, as sampled
        watch.start()
        store.advance_generation(store.generation(), world_size=1)
        time.sleep(2.5)
        watch.stop()
        kinds = [kind for kind, _ in calls]
        if where == "running":
            assert kinds == ["cut"], calls
            continue
        assert kinds == ["cut", "unstick", "end"], calls
        cut, unstuck, end = (at for _, at in calls)
        assert 0.3 <= unstuck - cut < 1.0 and end - cut >= 1.5, calls


def test_generation_watch_leaves_a_computing_or_leaving_rank_alone(store):
    """Cut and then computing (a long step that meets its next collective later), or leaving: no end."""
    for where, stop_after in (("running", 1.0), ("peers", 0.3)):
        ended: list[int] = []
        watch = GenerationWatch(
            store,
            store.generation(),
            0,
            waiter=store.another_client(),
            on_stuck=lambda: None,
            grace_s=0.0,
            on_left_behind=lambda ended=ended: ended.append(1),
            exit_after_s=0.5,
        )
        watch._sample = lambda where=where: where  # the main thread's position, as sampled
        watch.start()
        store.advance_generation(store.generation(), world_size=1)
        time.sleep(stop_after)
        watch.stop()  # the rank leaves (for "peers": before exit_after_s passed)
        assert not ended, where


def test_the_vote_that_completes_the_count_abandons_a_step_of_a_generation_the_job_left(store):
    """A grow moves the job while its ranks train: the last voter of the step decides ``abandon``,
    so every rank leaves at the vote (between collectives), not from the watch's cut in one."""
    gen = store.generation()
    commits = [StepCommit(Generation(store, gen, rank, 2, (2, 1))) for rank in range(2)]
    decided: dict[int, BaseException | None] = {}

    def vote(rank: int, step: int) -> None:
        try:
            commits[rank].vote(step)
            decided[rank] = None
        except GenerationChanged as err:
            decided[rank] = err

    for step in (1, 2):
        if step == 2:
            store.advance_generation(gen, world_size=2)  # the move lands between steps 1 and 2
        waiter = threading.Thread(target=vote, args=(0, step))
        waiter.start()
        time.sleep(0.005)  # whichever votes second completes the count; the waiter reads the
        vote(1, step)  # generation only every 20 ms, so at step 2 the decision is the completer's
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        if step == 1:
            assert decided == {0: None, 1: None} and store.decision(gen, 1) == b"commit"
    assert store.decision(gen, 2) == b"abandon"
    assert all(isinstance(decided[r], GenerationChanged) for r in (0, 1)), decided


def test_a_waiting_vote_blocks_in_the_store_until_its_watch_abandons_the_step(store):
    """With a waiter client the vote does not poll: rank 0 blocks on the decision key; the job
    moves while rank 1 is still computing; rank 0's generation watch decides ``abandon`` and rank
    0 leaves within the watch's wake-up, not after the vote's 2 s re-check; rank 1's vote then
    finds the same decision."""
    gen = store.generation()
    commit = StepCommit(Generation(store, gen, 0, 2, (2, 1)), waiter=store.another_client())
    watch = GenerationWatch(
        store, gen, 0, waiter=store.another_client(), on_stuck=lambda: None, on_moved=commit.job_left
    )
    watch.start()
    outcome: list[BaseException] = []
    voter = threading.Thread(target=lambda: _vote_into(commit, 1, outcome))
    voter.start()
    time.sleep(0.2)
    assert voter.is_alive() and not outcome  # blocked on the decision: rank 1 has not voted
    moved_at = time.monotonic()
    store.advance_generation(gen, world_size=2)
    voter.join(timeout=10)
    assert not voter.is_alive() and isinstance(outcome[0], GenerationChanged), outcome
    assert time.monotonic() - moved_at < 1.5
    watch.stop()
    late = StepCommit(Generation(store, gen, 1, 2, (2, 1)), waiter=store.another_client())
    with pytest.raises(GenerationChanged):
        late.vote(1)
    assert store.decision(gen, 1) == b"abandon"


def _vote_into(commit: StepCommit, step: int, outcome: list[BaseException]) -> None:
    try:
        commit.vote(step)
    except GenerationChanged as err:
        outcome.append(err)


class _LastCollectiveFails:
    """A Trainer stand-in whose ``fit`` fails as a rank's last collective does when a peer got out of
    it first (that peer records it finished) and another peer is stopped inside it."""

    global_step = 12

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def fit(self, module: object, datamodule: object = None, ckpt_path: object = None) -> None:
        self.store.mark_rank_finished(1)
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")


@pytest.mark.timeout(60)
def test_a_fault_after_a_peer_finished_ends_the_rank_as_finished_without_a_new_generation(store):
    from ckless_lightning.recovery.loop import InProcessRecovery

    for rank in (0, 1):
        store.set_member(rank, 0)
    store.join(0, 2)  # rank 1 is in generation 0 (of 2 ranks); rank 0 joins it in fit
    recovery = InProcessRecovery(Generation(store, number=0, rank=0, world_size=2, mesh=(1, 2)))
    fake = _LastCollectiveFails(store)
    start = time.monotonic()
    trainer = recovery.fit(lambda strategy, callbacks: fake, lambda: None)  # type: ignore[arg-type,return-value]
    assert trainer is fake and time.monotonic() - start < 10.0
    assert store.generation() == 0, "a generation nobody else would join was started"
    assert store.rank_finished(0) and store.ranks_finished() == 2
