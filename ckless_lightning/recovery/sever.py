"""Make this rank's peers fail fast when it leaves a generation: the one low-level module for it.

Why (measured on torch 2.13, gloo, CPU; see DESIGN.md "Facts measured"): a rank
that raises but stays alive keeps its gloo connections open, and peers blocked
in a collective with it wait for the full collective timeout, even after
``_abort_process_group()``. Shutting down this process's own TCP connections
(all but the job store's) makes every peer's pending gloo operation fail within
milliseconds. On NCCL, aborting the communicators is the designed path:
:func:`fail_fast` aborts the NCCL groups there (a private torch API, checked
against torch 2.13) and then cuts the TCP connections too: a rank on NCCL also
has gloo groups (the buddy exchanges' side group, which moves host memory), and
gloo's ``abort()`` does nothing in torch 2.13 (``ProcessGroupGloo`` does not
implement it), so only the cut frees a peer waiting in one of them.

What the cut does not free (measured on torch 2.13's gloo; docs/troubleshooting.md): a gloo
connection whose next incoming message is for a receive buffer that no longer exists (an
operation that failed on another connection freed it while this peer's data was on its way)
stops reading there, so it never reads the end of the connection; and gloo ignores a
failed write on a closed connection (``EPIPE``, ``ECONNRESET``). A wait on such a connection
lasts the group's timeout (``comm.pg_timeout_s``, minutes). :func:`unstick` ends it: each
connection is reset and left holding a refused connect's error, which gloo's write path does
not ignore, and a one-element send on every gloo connection of the process makes gloo write
on each: the write fails, gloo fails every operation pending on that connection, and the wait
raises like any peer failure.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ckless_lightning.comm._torch_compat import gloo_pairs

__all__ = ["fail_fast", "sever_connections", "sever_connections_to", "tcp_connections", "unstick"]

_UNSTICK_TAG = 0x7FFFFFF0  # the send that makes gloo write on a connection; no peer receives it
_REFUSED_WITHIN_S = 0.5  # a refused connect on this host comes back in microseconds


def _own_tcp_sockets() -> Iterator[socket.socket]:
    """A duplicate of each of this process's TCP sockets, closed after its turn (the original stays open).

    Read from this process's own descriptors, not from ``/proc/net/tcp``
    (what psutil lists): that file is the whole network namespace's table,
    read a page at a time, so its cost grows with every socket on the node
    and it is not a consistent snapshot; the descriptors are exact and cost
    what this process holds. (A skipped socket was looked for and not seen:
    0 misses in about 5,800 reads of tables of 400 to 30,000 lines under
    churn.) A descriptor closed since the listing, or not a socket, is
    passed over: it has nothing to cut.
    """
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed since the listing: nothing to cut
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                yield sock
        finally:
            sock.close()  # closes the duplicate only


def _peer(sock: socket.socket) -> tuple[str, int] | None:
    """The remote ``(host, port)`` of a connected socket; None when it is not connected (a listener, a
    connect still under way)."""
    try:
        return sock.getpeername()[:2]
    except OSError as err:
        if err.errno != errno.ENOTCONN:
            raise
        return None


def tcp_connections() -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """``(local, remote)`` address of every connected TCP socket of this process (exact: read from its
    own descriptors)."""
    found = []
    for sock in _own_tcp_sockets():
        peer = _peer(sock)
        if peer is not None:
            found.append((sock.getsockname()[:2], peer))
    return found


def sever_connections(keep_ports: set[int]) -> int:
    """``shutdown()`` every connected TCP socket of this process whose remote port is not in ``keep_ports``.

    Returns how many were cut. The sockets stay open (their owners close them);
    only the connections end, so peers see "connection closed by peer" at once.
    """
    return _sever(lambda peer: peer[1] not in keep_ports)


def sever_connections_to(host: str, port: int) -> int:
    """``shutdown()`` this process's connections to ``host:port`` (a node agent giving up on a job store
    that stopped answering: a request blocked on it in another thread then fails at once with
    ``DistNetworkError`` instead of waiting for its timeout). ``host`` is an address (TCPStore's
    IPv6 sockets name an IPv4 peer ``::ffff:<address>``, which matches too). Returns how many were cut."""
    return _sever(lambda peer: peer[1] == port and peer[0].removeprefix("::ffff:") == host)


def _sever(chosen: Callable[[tuple[str, int]], bool]) -> int:
    cut = 0
    for sock in _own_tcp_sockets():
        peer = _peer(sock)
        if peer is None or not chosen(peer):
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError as err:
            if err.errno != errno.ENOTCONN:  # ENOTCONN: the peer ended it first, as wanted
                raise
    return cut


def _abort_nccl() -> None:
    """Abort every NCCL communicator of this process (torch 2.13's ``_abort_process_group`` of the
    default group aborts the backends of all groups)."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group()


def fail_fast(keep_ports: set[int]) -> None:
    """Make peers of this rank's process groups notice that it is leaving them: NCCL groups are
    aborted, and every TCP connection but ``keep_ports``' (the job store's) is cut, which ends
    gloo's (the default group's on CPU, the side groups' on GPU)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        _abort_nccl()
    sever_connections(keep_ports)


def _disconnect(sock: socket.socket) -> None:
    """``connect(AF_UNSPEC)``: the socket drops its connection and can connect again (Linux;
    Python's ``connect`` takes no such address)."""
    unspec = (ctypes.c_ushort * 8)(socket.AF_UNSPEC)  # a sockaddr whose family is AF_UNSPEC
    if ctypes.CDLL(None, use_errno=True).connect(sock.fileno(), ctypes.byref(unspec), ctypes.sizeof(unspec)):
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _refuser(family: int, host: str) -> socket.socket:
    """A socket bound to ``host`` that never listens: a connect to it is refused (``ECONNREFUSED``)."""
    refuser = socket.socket(family, socket.SOCK_STREAM)
    try:
        refuser.bind((host, 0))
    except OSError:  # the connection's address is gone: the host's loopback
        refuser.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
    return refuser


def _refuse_connections(keep_ports: set[int]) -> int:
    """Reset every connection of this process but ``keep_ports``' and connect it to a refuser, so
    that it holds ``ECONNREFUSED`` until written on; returns how many. Listening sockets are left."""
    refusers: dict[tuple[int, str], socket.socket] = {}
    held: list[socket.socket] = []
    try:
        for sock in _own_tcp_sockets():
            peer = _peer(sock)
            if (peer is not None and peer[1] in keep_ports) or sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN
            ):
                continue
            host = sock.getsockname()[0]
            _disconnect(sock)
            key = (sock.family, host)
            if key not in refusers:
                refusers[key] = _refuser(sock.family, host)
            sock.connect_ex(refusers[key].getsockname())  # non-blocking: EINPROGRESS; refused soon
            held.append(socket.socket(fileno=os.dup(sock.fileno())))
        poll = select.poll()
        for sock in held:
            poll.register(sock, select.POLLERR)
        # Bounded: wait for the refusals to land (poll leaves the error for gloo's write to read).
        left = {sock.fileno() for sock in held}
        end = time.monotonic() + _REFUSED_WITHIN_S
        while left and time.monotonic() < end:
            for fd, _ in poll.poll(max(1, int((end - time.monotonic()) * 1000))):
                poll.unregister(fd)  # its error stays until read: looked at once, then left
                left.discard(fd)
        return len(held)
    finally:
        for sock in [*held, *refusers.values()]:
            sock.close()


def unstick(keep_ports: set[int]) -> tuple[int, int]:
    """End a gloo wait that :func:`sever_connections` did not (see the module's docstring): reset
    every connection but ``keep_ports``', then send one element on every gloo connection of every
    group. Returns ``(connections reset, sends gloo took)``: a send on a connection that failed
    raises, which is what it is for. Call it only once the rank is leaving its groups (their
    connections end for good)."""
    reset = _refuse_connections(keep_ports)
    taken = 0
    poke = torch.zeros(1)
    for backend, peer in gloo_pairs():
        try:
            backend.send([poke], peer, _UNSTICK_TAG)
            taken += 1
        except RuntimeError:  # the connection failed: its pending operations failed with it
            continue
    return reset, taken
