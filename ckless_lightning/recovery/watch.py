"""Frees a rank still inside a generation its job has left.

A rank normally leaves a generation within milliseconds of a fault: its
pending collective fails when a peer dies or cuts its connections. Two cases
where that does not happen: every survivor blocked in a collective that no
departure reaches (seen in about one CI run in two, tier 3, a peer raising
during its optimizer step: the agent then killed one of them as hung, an
innocent rank), and ranks computing a long step that talk to the lost rank
only later in it (HSDP's other replica: at 300M parameters a step is 15 s of
CPU). :class:`GenerationWatch` is a thread per rank that notices the job's
generation move past this rank's and, if the rank has not started leaving
``grace_s`` later (``comm.stuck_grace_s``), cuts its connections
(``on_stuck``), so its next or pending collective fails and the normal recovery
path runs. It reads the store's generation counter every ``poll_s`` (one small
request); it never acts while the rank is leaving or after it left. Its live
state stays usable: what a survivor offers does not depend on where it was cut.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from ckless_lightning.comm import JobStore

__all__ = ["GenerationWatch"]


class GenerationWatch:
    """Watches generation ``generation`` of ``store``; ``start`` once, ``stop`` when this rank leaves
    the generation or its ``fit`` ends (``stop`` returns at once: the thread waits on an event)."""

    def __init__(
        self,
        store: JobStore,
        generation: int,
        *,
        on_stuck: Callable[[], None],
        grace_s: float = 0.25,
        poll_s: float = 0.1,
    ) -> None:
        self.store = store
        self.generation = generation
        self.on_stuck = on_stuck
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"generation-watch-{generation}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                moved = self.store.generation() > self.generation
            except RuntimeError as err:  # the store is gone: the main thread finds out on its own
                print(f"generation watch {self.generation}: the job store failed ({err})", file=sys.stderr)
                return
            if moved:
                if not self._stop.wait(self.grace_s):
                    self.fired = True
                    self.on_stuck()
                return
