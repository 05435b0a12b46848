"""``recovery.sever``: the cut that makes a rank's peers fail fast reaches every one of its connections.

The connections are found from the process's own descriptors: ``/proc/net/tcp`` (psutil's source) is
the whole namespace's table read a page at a time, and a read made while other sockets close can
skip one, which would leave a peer waiting on a connection the cut missed.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
from collections import Counter

import pytest

from ckless_lightning.recovery.sever import sever_connections, tcp_connections


def _hold(ready, done) -> None:
    """Two listeners (kept, cut) on loopback; each connection echoes a byte until its end."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    ready.send([listener.getsockname()[1] for listener in listeners])

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1):
                conn.sendall(data)

    def accept(listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    for listener in listeners:
        threading.Thread(target=accept, args=(listener,), daemon=True).start()
    done.wait(60)


def _churn(port: int, stop: threading.Event) -> None:
    """Other connections of the node opening and closing meanwhile (what skips a /proc/net/tcp read)."""
    while not stop.is_set():
        socket.create_connection(("127.0.0.1", port)).close()


@pytest.mark.timeout(60)
def test_sever_cuts_every_connection_but_the_kept_port_while_others_churn():
    context = mp.get_context("spawn")
    ready_recv, ready_send = context.Pipe(duplex=False)
    done = context.Event()
    holder = context.Process(target=_hold, args=(ready_send, done), daemon=True)
    holder.start()
    stop = threading.Event()
    kept, cut = [], []
    try:
        assert ready_recv.poll(30), "the listener process did not start"
        kept_port, cut_port = ready_recv.recv()
        kept = [socket.create_connection(("127.0.0.1", kept_port), timeout=10) for _ in range(40)]
        cut = [socket.create_connection(("127.0.0.1", cut_port), timeout=10) for _ in range(40)]
        for conn in kept + cut:  # every connection established end to end
            conn.sendall(b"x")
            assert conn.recv(1) == b"x"
        listed = tcp_connections()
        assert Counter(remote[1] for _, remote in listed) == {kept_port: 40, cut_port: 40}
        assert {local for local, _ in listed} == {conn.getsockname()[:2] for conn in kept + cut}
        churner = threading.Thread(target=_churn, args=(cut_port, stop), daemon=True)
        churner.start()
        assert sever_connections(keep_ports={kept_port}) >= 40  # ours, and a churning one caught open
        stop.set()
        churner.join(10)
        for conn in cut:
            with pytest.raises(OSError):
                conn.sendall(b"x")
        for conn in kept:
            conn.sendall(b"y")
            assert conn.recv(1) == b"y"
    finally:
        stop.set()
        for conn in kept + cut:
            conn.close()
        done.set()
        holder.join(10)
        if holder.is_alive():
            holder.kill()
            holder.join(10)


def test_sever_connections_to_frees_a_store_request_blocked_in_another_thread():
    """What a fenced agent that gives up does: its main thread, blocked on the job store, fails at
    once (``DistNetworkError``) instead of after the connection's timeout."""
    import time
    from datetime import timedelta

    from torch.distributed import DistNetworkError, TCPStore

    from ckless_lightning.recovery.sever import sever_connections_to

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=120))
    cut = threading.Timer(0.5, sever_connections_to, args=("127.0.0.1", server.port))
    cut.start()
    began = time.monotonic()
    with pytest.raises(DistNetworkError):
        client.wait(["never"], timedelta(seconds=60))
    assert time.monotonic() - began < 30
    cut.join()


def _stranded_rank(rank: int, port: int, unstick_it: bool, report) -> None:
    """One of two gloo ranks. Rank 0 posts a receive from rank 1 and drops it (what an operation that
    failed on another connection does to its buffers); rank 1 sends into it anyway, so rank 0's
    connection stops reading at a message for a buffer that no longer exists. Rank 0 then waits in
    an all-reduce rank 1 never joins; both cut their connections (``sever_connections``) and rank 0,
    if ``unstick_it``, calls ``unstick`` 1.5 s later. Rank 0 reports how its wait ended, when, and
    whether the recovery would call it a lost peer."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ckless_lightning.recovery.sever import unstick
    from ckless_lightning.runtime.contract import is_peer_failure

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    if rank == 0:
        dist.irecv(torch.zeros(1000), src=1)  # the work, and with it the buffer, dropped at once
        store.set("dropped", "1")
    else:
        store.wait(["dropped"])
        dist.send(torch.ones(1000), dst=0)
        time.sleep(0.5)
        sever_connections({port})
        time.sleep(30)  # alive and gone from the group, as a rank that left for the next generation
        return

    def cut() -> None:
        time.sleep(1.0)
        sever_connections({port})
        report.put(("cut", time.monotonic(), None))
        if unstick_it:
            time.sleep(1.5)
            report.put(("unstick", time.monotonic(), unstick({port})))

    cutter = threading.Thread(target=cut, daemon=True)
    cutter.start()
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10))
        report.put(("returned", time.monotonic() - began, ("", False)))
    except RuntimeError as err:  # told from the rank's own error, as the recovery tells it
        report.put(("raised", time.monotonic() - began, (str(err), is_peer_failure(err))))
    cutter.join(30)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("unstick_it", [False, True], ids=["cut_only", "unstick"])
def test_unstick_ends_a_gloo_wait_the_cut_does_not(unstick_it):
    """The open gloo case (docs/troubleshooting.md) built on purpose: the cut alone leaves rank 0
    blocked (until the group's 60 s timeout; the test stops looking after 4 s); ``unstick`` ends its
    wait within a second, with gloo's own error."""
    import queue

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    report = context.Queue()
    ranks = [
        context.Process(target=_stranded_rank, args=(rank, server.port, unstick_it, report), daemon=True)
        for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    try:
        assert report.get(timeout=30)[0] == "cut"
        if not unstick_it:
            with pytest.raises(queue.Empty):  # still blocked 4 s after the cut
                report.get(timeout=4)
            return
        got = {kind: (when, detail) for kind, when, detail in (report.get(timeout=10) for _ in range(2))}
        assert set(got) == {"unstick", "raised"}, got  # the wait raised (before unstick returned, often)
        reset, _ = got["unstick"][1]
        assert reset >= 1, got  # connections reset
        waited_s, (error, a_peer_failure) = got["raised"]
        assert waited_s < 2.5 + 5, got  # cut at ~1 s, unstick at ~2.5 s: not the group's 60 s timeout
        assert "Connection refused" in error or "closed" in error, error
        assert a_peer_failure, error  # a lost peer, not the rank's own error: its live state is kept
    finally:
        for process in ranks:
            process.kill()
            process.join(10)
        del server
