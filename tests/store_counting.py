"""A job store client whose requests are counted, for tests that bound a component's store traffic."""

from __future__ import annotations

import time

from ckless_lightning.comm import JobStore


class CountingRequests:
    """The store a JobStore talks through, counting each request by kind (``calls``, with ``times``)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[str] = []
        self.times: list[float] = []  # monotonic, one per call

    def __getattr__(self, name: str):
        method = getattr(self.inner, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            self.times.append(time.monotonic())
            return method(*args, **kwargs)

        return call


def counted_client(host: JobStore) -> tuple[JobStore, CountingRequests]:
    """A new client of ``host``'s store whose requests are counted; the host's writes so far are
    applied first (a TCPStore client sends a set without waiting for a reply: a read on the same
    connection returns only after it was applied)."""
    host.generation()
    store = host.another_client()
    counting = CountingRequests(store._tcp)
    store._tcp = counting  # type: ignore[assignment]
    return store, counting
