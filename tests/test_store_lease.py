"""The agent's lease on its node (agent/store_lease.py) and fenced checkpoint commits, without a job."""

from __future__ import annotations

import threading
import time

import pytest

from ckless_lightning.agent.store_lease import StoreLease
from ckless_lightning.runtime.checkpointing import commit_checkpoint, latest_checkpoint, staging_path


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lease(clock: Clock, fired: list, ping=lambda: None) -> StoreLease:
    return StoreLease(
        ping,
        fence_after_s=3.0,
        give_up_after_s=15.0,
        interval_s=1.0,
        on_fence=lambda s: fired.append(("fence", s)),
        on_give_up=lambda s: fired.append(("give_up", s)),
        clock=clock,
    )


def test_fence_fires_once_after_fence_after_and_a_store_pass_ends_it():
    clock, fired = Clock(), []
    held = lease(clock, fired)
    for _ in range(29):
        clock.now += 0.1
        held.check()
    assert fired == [] and not held.fenced
    clock.now += 0.2
    held.check()
    held.check()
    assert fired == [("fence", pytest.approx(3.1))] and held.fenced
    assert held.renew() is True  # the agent's pass: the store answers again, once
    assert held.renew() is False and not held.fenced
    for _ in range(35):
        clock.now += 0.1
        held.check()
    assert [kind for kind, _ in fired] == ["fence", "fence"]  # a second cut: a second fence


def test_give_up_after_the_fence_and_no_way_back():
    clock, fired = Clock(), []
    held = lease(clock, fired)
    for _ in range(151):
        clock.now += 0.1
        held.check()
    assert [kind for kind, _ in fired] == ["fence", "give_up"]
    assert held.renew() is False and held.fenced  # given up: a late answer changes nothing


def test_a_stopped_agent_does_not_fence_on_the_silence_of_its_own_stop():
    """The agent was stopped (SIGSTOP) for 20 s: the checks resume with a gap, and the ping gets two
    intervals to reach the store before anything is fenced."""
    clock, fired = Clock(), []
    held = lease(clock, fired)
    clock.now += 20.0
    held.check()
    assert fired == [] and held.silent_s() == pytest.approx(1.0)
    for _ in range(19):
        clock.now += 0.1
        held.check()
    assert fired == []
    clock.now += 0.2  # two intervals after the resume without an answer: fenced
    held.check()
    assert [kind for kind, _ in fired] == ["fence"]


def test_the_ping_keeps_a_lease_whose_passes_stall_but_does_not_end_a_fence():
    """The lease's own ping renews while the agent's passes are blocked; once fenced, only the
    agent's pass (which reads who owns the node) ends the fence."""
    answers = threading.Event()
    pings = []

    def ping() -> None:
        pings.append(time.monotonic())
        if not answers.is_set():
            raise RuntimeError("store timeout")

    fired: list = []
    held = StoreLease(
        ping,
        fence_after_s=0.3,
        give_up_after_s=30.0,
        interval_s=0.05,
        on_fence=lambda s: fired.append(s),
        on_give_up=lambda s: fired.append("give_up"),
    )
    held.start()
    try:
        deadline = time.monotonic() + 10
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(fired) == 1 and fired[0] >= 0.3 and held.fenced
        answers.set()
        while held.silent_s() > 0.2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held.silent_s() <= 0.2 and held.fenced  # pinged back, still fenced
        assert held.renew() is True and not held.fenced
        count = len(pings)
        for _ in range(10):  # passes renew every 20 ms: the lease makes no request of its own
            held.renew()
            time.sleep(0.02)
        assert len(pings) - count <= 1
    finally:
        held.stop()
    assert isinstance(held.last_error, RuntimeError)


def _complete(path):
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"m")
    (path / "meta.pt").write_bytes(b"p")


def test_a_checkpoint_is_committed_only_by_the_current_generation(tmp_path, capsys):
    final = tmp_path / "step00000010.ckpt"
    stale = staging_path(final, 3)
    _complete(stale)
    assert not commit_checkpoint(stale, final, current=False)
    assert latest_checkpoint(tmp_path) is None and stale.is_dir()  # no resume reads it
    assert "the job left the generation that wrote it" in capsys.readouterr().err
    fresh = staging_path(final, 4)
    _complete(fresh)
    (fresh / "marker").write_text("g4")
    assert commit_checkpoint(fresh, final, current=True)
    assert latest_checkpoint(tmp_path) == final and (final / "marker").read_text() == "g4"
    again = staging_path(final, 5)  # the same step saved again by a later generation: replaces it
    _complete(again)
    assert commit_checkpoint(again, final, current=True)
    assert not (final / "marker").exists() and latest_checkpoint(tmp_path) == final
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name, stale.name]
