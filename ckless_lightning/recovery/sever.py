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

import psutil
import torch.distributed as dist

__all__ = ["fail_fast", "sever_connections"]


def sever_connections(keep_ports: set[int]) -> int:
    """``shutdown()`` every connected TCP socket of this process whose remote port is not in ``keep_ports``.

    Returns how many were cut. The sockets stay open (their owners close them);
    only the connections end, so peers see "connection closed by peer" at once.
    """
    cut = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.fd < 0 or not conn.raddr or conn.raddr.port in keep_ports:
            continue
        if conn.status != psutil.CONN_ESTABLISHED:
            continue
        try:
            sock = socket.socket(fileno=os.dup(conn.fd))
        except OSError:  # closed since the listing: nothing to cut
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError as err:
            if err.errno != errno.ENOTCONN:  # ENOTCONN: the peer ended it first, as wanted
                raise
        finally:
            sock.close()  # closes the duplicate only
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
