"""The fork server (agent.fork_server): ranks forked from one prepared process, supervised like any.

The job-level tests run every rank through it (it is on by default); here, the agent's side alone:
a forked rank is this process's child (exit status, output), a stopped or killed server costs no
wait past its bounds and is replaced, and a fork the agent gave up on never runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf

from ckless_lightning.agent.fork_server import ForkServer
from ckless_lightning.record.events import EventLog
from ckless_lightning.runtime.contract import launcher_env


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def server(tmp_path, compose):
    config = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(compose("recipe=llama3_tiny")), config)
    server = ForkServer(tmp_path / "forkserver.log")
    pids: list[int] = []
    yield server, pids, config
    server.close()
    for pid in pids:  # nothing forked outlives the test
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(240)
def test_forked_rank_is_the_agents_child_and_a_stopped_server_is_replaced(server, tmp_path):
    server, pids, config = server
    events = tmp_path / "events.jsonl"
    server.start()  # imports before it knows the job (launch.py starts it before validating)
    assert server.fork(launcher_env(), ["--config", str(config)]) is None  # not told the config yet
    server.prepare(config, EventLog(events, source="agent0"))
    missing = tmp_path / "no_such_config.yaml"

    # A forked rank runs the rank path with the agent's variables: this config does not exist, so it
    # fails the way a cold rank would, and this process (its subreaper) reaps it and sees exit 1.
    proc = server.fork({**launcher_env(), "RANK": "3"}, ["--config", str(missing)])
    assert proc is not None
    pids.append(proc.pid)
    assert psutil.Process(proc.pid).ppid() == os.getpid() or proc.poll() is not None
    assert proc.wait(timeout=60) == 1
    assert proc.stdout is not None
    output = proc.stdout.read().decode()
    assert "FileNotFoundError" in output and str(missing) in output
    ready = [e for e in _events(events) if e["kind"] == "forkserver_ready"]
    assert len(ready) == 1 and ready[0]["modules"] > 1000  # torch and Lightning imported there once

    # A stopped server: the next fork gives up at once (the caller starts the rank cold), the
    # server is killed, and tend() starts a new one that forks again.
    first = server.pid
    assert first is not None
    os.kill(first, signal.SIGSTOP)
    started = time.monotonic()
    assert server.fork(launcher_env(), ["--config", str(missing)]) is None
    assert time.monotonic() - started < 8  # at once, not after the 10 s reply bound
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
    lost = [e for e in _events(events) if e["kind"] == "forkserver_lost"]
    assert [e["reason"] for e in lost] == ["stopped"]
    server.tend()
    assert server.pid not in (None, first)
    again = server.fork(launcher_env(), ["--config", str(missing)])
    assert again is not None
    pids.append(again.pid)
    assert again.wait(timeout=60) == 1

    # A killed server is replaced by tend(), as a stopped one.
    second = server.pid
    assert second is not None
    os.kill(second, signal.SIGKILL)
    time.sleep(0.2)
    server.tend()
    assert server.pid not in (None, second)
    assert [e["reason"] for e in _events(events) if e["kind"] == "forkserver_lost"][1] == "killed by SIGKILL"
    server.close()
    assert server.fork(launcher_env(), ["--config", str(missing)]) is None


@pytest.mark.timeout(120)
def test_a_server_killed_while_it_prepares_is_recorded_as_killed_not_as_a_timeout(server, tmp_path):
    """Its reason is the observed one (it was: 'not ready within 120 s', 4.8 s into a job)."""
    server, _pids, config = server
    events = tmp_path / "events.jsonl"
    server.start()
    server.prepare(config, EventLog(events, source="agent0"))
    time.sleep(0.5)  # importing torch: seconds from ready
    assert server.pid is not None
    os.kill(server.pid, signal.SIGKILL)
    started = time.monotonic()
    assert server.fork(launcher_env(), ["--config", str(tmp_path / "none.yaml")]) is None
    assert time.monotonic() - started < 10
    (lost,) = [e for e in _events(events) if e["kind"] == "forkserver_lost"]
    assert lost["reason"] == "killed by SIGKILL"


def _exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(120)
def test_a_fork_the_agent_gave_up_on_never_runs(tmp_path, compose):
    """The protocol with the server itself: a forked rank waits for the agent's ``go`` on its stdin;
    if the agent closes that pipe instead (it never got the pid in time), the rank exits without
    running anything; with ``go`` it goes on, and quits unless it was re-parented to its launcher."""
    config = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(compose("recipe=llama3_tiny")), config)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckless_lightning.forkserver",
            "--socket-fd",
            str(theirs.fileno()),
        ],
        env=launcher_env(),
        pass_fds=(theirs.fileno(),),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    theirs.close()
    forked: list[int] = []
    try:
        ours.settimeout(90)
        ours.sendall(json.dumps({"prepare": str(config)}).encode())
        assert "ready" in json.loads(ours.recv(65536))
        bad = tmp_path / "bad.yaml"
        bad.write_text("not: [a config\n")

        def fork(go: bool) -> tuple[int, str]:
            out_read, out_write = os.pipe()
            go_read, go_write = os.pipe()
            request = {"env": launcher_env(), "argv": ["--config", str(bad)], "cwd": os.getcwd()}
            socket.send_fds(ours, [json.dumps(request).encode()], [out_write, go_read])
            os.close(out_write)
            os.close(go_read)
            pid = json.loads(ours.recv(65536))["pid"]
            forked.append(pid)
            if go:
                os.write(go_write, b"go\n")
            os.close(go_write)
            with os.fdopen(out_read, "rb") as out:
                return pid, out.read().decode()  # end of file: the rank exited

        pid, said = fork(go=False)
        assert said == ""  # it ran nothing: no traceback, no output
        deadline = time.monotonic() + 10
        while not _exited(pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _, said = fork(go=True)
        # With go it went on, and refused to run: this test process is not a subreaper, so the rank
        # was not re-parented to its launcher (CKLESS_LAUNCHER_PID) and would not die with it.
        assert f"the parent process {os.getpid()} exited before this process started" in said
    finally:
        ours.close()  # the server exits when its socket closes
        server.wait(timeout=30)
        for pid in forked:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    assert server.returncode == 0
