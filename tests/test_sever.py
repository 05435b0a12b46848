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
