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
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Iterator

import torch.distributed as dist

__all__ = ["fail_fast", "sever_connections", "sever_connections_to", "tcp_connections"]


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
