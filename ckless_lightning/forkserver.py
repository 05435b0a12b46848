"""Fork server: ``python -m ckless_lightning.forkserver --socket-fd FD``, started by ``launch.py``.

Importing torch, Lightning and the project costs a rank process ~5 s of CPU; five processes
paying it at once on a small machine made the default job's start-up ~20 s. The fork server
pays it once, and early: ``launch.py`` starts it as soon as Hydra has composed the config, so
its imports run while the launcher validates the config, plans memory and prepares the data.
Told the job's resolved config, it does everything of the rank path that does not depend on the
rank (as a warm spare does, :func:`~ckless_lightning.training.rank_process.prepare_rank`), then
forks a rank process per request of the agent, in milliseconds, sharing the imported pages
copy-on-write.

It never touches CUDA (a CUDA context does not survive ``fork``): it refuses a request once
CUDA is initialized in it, and the agent starts that rank cold.

The protocol, on a ``SOCK_SEQPACKET`` socket pair with the agent (one JSON message per packet):

- agent -> server, once: ``{"prepare": config_path}`` (the resolved YAML launch.py wrote);
- server -> agent, once: ``{"ready": pid, "start_s", "prepare_s", "modules"}`` when prepared
  (or ``{"failed": message}``, then it exits: the agent starts ranks cold and they report it);
- agent -> server: ``{"env": {...}, "argv": [...], "cwd": path}`` with two file descriptors: the
  write end of the rank's output pipe and the read end of its go pipe (its stdin); server ->
  agent: ``{"pid": N}`` or ``{"error": message}``. The rank waits for ``go`` on its stdin, which
  the agent writes once it has the pid: a rank whose pid the agent never got (a server killed or
  stopped mid-request) reads end-of-file instead and exits before it does anything, so no rank
  runs that the agent does not supervise.
- a request with ``"role": "spare"`` forks a warm spare instead: after ``go`` it says
  ``spare_prepared`` and waits on the same pipe for a rank assignment (one JSON line, as
  ``python -m ckless_lightning.spare`` takes on stdin), then becomes that rank.
- a request with ``"role": "reader"`` and ``"log": path`` forks the node's batch-cache reader
  (:func:`~ckless_lightning.data.reader_process.run_reader_process`, ``argv`` its arguments):
  its output goes to the log file, and the output pipe is its ready pipe (``--ready-fd``), as
  for a cold reader. A cold reader pays ~3-5 s of imports (torch) before it builds the first
  batch the ranks wait for.

Each rank is forked twice so that it is the agent's child, not the server's: the agent is a
child subreaper (``PR_SET_CHILD_SUBREAPER``), so when the intermediate process exits the rank is
re-parented to the agent, which reaps it, reads its exit status and sends it signals like any
rank it started; killing the server costs no rank. The rank then starts its own session, takes
the agent's variables, sets its parent-death signal (only once re-parented: the signal fires
on the death of the parent it had when it was set) and runs
:func:`~ckless_lightning.training.rank_process.run_rank_process` with the prepared config.
The server exits when the agent closes its end of the socket, and dies with the agent.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckless_lightning.runtime.contract import RankContext, die_with_launcher

if TYPE_CHECKING:
    from ckless_lightning.training.rank_process import PreparedRank

__all__ = ["MAX_MESSAGE", "serve"]

MAX_MESSAGE = 1 << 20  # bytes of one JSON message (a rank's environment is a few KB)
_REPARENT_WAIT_S = 5.0  # the intermediate process exits at once; a rank not re-parented by then quits


def serve(argv: list[str] | None = None) -> int:
    """Prepare, say ready, fork a rank per request until the agent closes the socket.

    Returns the exit code: of the server (0: the agent closed the socket), or, in a forked rank,
    the rank's (the rank returns through here to ``sys.exit``, as ``python -m ckless_lightning.rank``
    would)."""
    die_with_launcher()
    started = time.time()
    parser = argparse.ArgumentParser(prog="python -m ckless_lightning.forkserver")
    parser.add_argument("--socket-fd", type=int, required=True, help="this end of the agent's socket pair")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    sock = socket.socket(fileno=args.socket_fd)

    import lightning.pytorch  # noqa: F401  - the point of the server: pay the imports once
    import torch

    from ckless_lightning.training.rank_process import import_rank_path, prepare_rank, run_rank_process

    import_rank_path()
    message = sock.recv(MAX_MESSAGE)
    if not message:
        return 0  # the launcher stopped before the job started (a config error, an interrupt)
    try:
        # No data warm-up: the launcher prepares the data while this runs, and has it cached.
        prepared = prepare_rank(json.loads(message)["prepare"], warm_data=False)
    except Exception as err:  # a bad config: the cold ranks report it
        traceback.print_exc()
        _send(sock, {"failed": f"{type(err).__name__}: {err}"})
        return 1
    # Collect the preparation's garbage now and keep it out of later collections: a collection
    # in a forked rank would touch (and so copy) every page of these objects.
    gc.collect()
    gc.freeze()
    _send(
        sock,
        {
            "ready": os.getpid(),
            "start_s": round(time.time() - started, 6),
            "prepare_s": round(prepared.prepare_s, 6),
            "modules": prepared.modules,
        },
    )
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except ConnectionResetError:
            return 0
        if not message:
            for fd in fds:
                os.close(fd)
            return 0  # the agent closed its end
        request = json.loads(message)
        if len(fds) != 2 or torch.cuda.is_initialized():
            for fd in fds:
                os.close(fd)
            why = (
                f"expected two file descriptors (the rank's output and go pipes), got {len(fds)}"
                if len(fds) != 2
                else "CUDA is initialized in the fork server; a forked rank could not use it"
            )
            _send(sock, {"error": why})
            continue
        become_rank = _fork_rank(sock, request, fds[0], fds[1])
        if become_rank is not None:  # in the forked process: leave the server's loop for good
            forked_at = time.time()
            become_rank()
            if request.get("role") == "spare":
                return _serve_as_spare(prepared, forked_at)
            if request.get("role") == "reader":
                from ckless_lightning.data.reader_process import run_reader_process

                return run_reader_process(request["argv"])
            rank_args = _rank_parser().parse_args(request["argv"])
            return run_rank_process(rank_args.config, RankContext.from_env(), prepared=prepared)


def _serve_as_spare(prepared: PreparedRank, forked_at: float) -> int:
    """A warm spare forked from this server (``"role": "spare"``): the imports and the config are
    the server's; look the dataset up (the server skipped it), say ``spare_prepared`` and wait on
    stdin (the go pipe, kept open by the agent) for the rank, as ``python -m ckless_lightning.spare``."""
    from ckless_lightning.training.rank_process import announce_prepared, await_rank, warm_data

    warm_data(prepared.job)
    announce_prepared(prepared, forked_at)
    with open(0, encoding="utf-8", closefd=False) as stdin:
        return await_rank(prepared, stdin)


def _rank_parser() -> argparse.ArgumentParser:
    """The rank's own arguments, as ``python -m ckless_lightning.rank`` takes them."""
    parser = argparse.ArgumentParser(prog="python -m ckless_lightning.rank")
    parser.add_argument("--config", required=True)
    return parser


def _fork_rank(
    sock: socket.socket, request: dict[str, Any], out_fd: int, go_fd: int
) -> Callable[[], None] | None:
    """Fork the rank (twice); in the server, reply with its pid and return None. In the rank,
    return the function that finishes turning this process into the rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid_read, pid_write = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        os.close(pid_read)
        try:
            rank_pid = os.fork()
        except OSError:
            os._exit(1)
        if rank_pid == 0:
            os.close(pid_write)
            middle = os.getppid()
            return lambda: _become_rank(sock, request, out_fd, go_fd, middle)
        os.write(pid_write, str(rank_pid).encode())
        os._exit(0)  # the rank is re-parented to the agent (its subreaper)
    os.close(pid_write)
    os.close(out_fd)
    os.close(go_fd)
    with os.fdopen(pid_read, "rb") as reader:
        said = reader.read()
    os.waitpid(intermediate, 0)
    if said:
        _send(sock, {"pid": int(said)})
    else:
        _send(sock, {"error": "the intermediate process could not fork the rank"})
    return None


def _become_rank(sock: socket.socket, request: dict[str, Any], out_fd: int, go_fd: int, middle: int) -> None:
    """In the forked rank: wait for the agent's go, then own session and output, the agent's
    variables, die with the agent."""
    sock.close()
    os.setsid()
    if request.get("role") == "reader":  # output to its log; the output pipe says "ready"
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        request["argv"] = [*request["argv"], "--ready-fd", str(out_fd)]
    else:
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
    os.dup2(go_fd, 0)
    os.close(go_fd)
    if os.read(0, 3) != b"go\n":  # the agent gave up on this fork (or died): never run unsupervised
        os._exit(0)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [sys.argv[0], *request["argv"]]
    deadline = time.monotonic() + _REPARENT_WAIT_S
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.001)
    die_with_launcher()  # exits unless re-parented to the agent
    _reseed()


def _reseed() -> None:
    """Fresh seeds for the process-global generators a fork copies (a cold rank seeds them at
    import); the job's own seeds are set by the training code as in any rank."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode())


if __name__ == "__main__":
    sys.exit(serve())
