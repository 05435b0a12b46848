"""The job store's address, its secret, what it reads back, and where Slurm places a node."""

from __future__ import annotations

import collections
import io
import os
import pickle
import signal
import subprocess
import sys
from datetime import timedelta

import psutil
import pytest
import torch
from torch.distributed import TCPStore

from ckless_lightning.comm import JobStore, StoreRefused
from ckless_lightning.comm.secret import job_secret, read_secret_file, write_secret_file
from ckless_lightning.replication.loop_state import UnsafeLoopState, decode_loop_state, encode_loop_state
from ckless_lightning.runtime import launcher
from ckless_lightning.runtime.launcher import first_host, place_from_scheduler, slurm_port

SECRET = "job-store-test-secret-0123456789"
STORE_COMMAND = [sys.executable, "-m", "ckless_lightning.store"]


def listening_addresses(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("address", ["127.0.0.2", "127.0.0.3"])
def test_store_listens_on_its_address_only(address):
    store = JobStore.host(address, 0, secret=SECRET)
    assert listening_addresses(store.port) == {address}  # not 0.0.0.0 / :: (every interface)
    with pytest.raises(Exception, match=r"timed out|refused|Connection"):
        TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=1))


@pytest.mark.timeout(60)
def test_client_without_the_secret_gets_nothing():
    store = JobStore.host("127.0.0.2", 0, secret=SECRET)
    store.advance_generation(store.generation(), world_size=2)
    with pytest.raises(StoreRefused, match="CKLESS_JOB_SECRET"):
        JobStore.connect("127.0.0.2", store.port, secret="another-secret-0123456789", timeout_s=0.5)
    # A raw client reaching the port sees none of the job's keys, under their plain names or not.
    raw = TCPStore("127.0.0.2", store.port, is_master=False, timeout=timedelta(seconds=5))
    assert not raw.check(["gen"]) and not raw.check(["job"]) and not raw.check(["/gen"])
    raw.set("gen", "99")  # and what it writes is not the job's
    peer = JobStore.connect("127.0.0.2", store.port, secret=SECRET)
    assert peer.generation() == 1


def test_secret_from_the_environment_or_a_0600_file(tmp_path):
    assert job_secret({"CKLESS_JOB_SECRET": SECRET}, may_generate=False) == SECRET
    made = job_secret({}, may_generate=True)
    assert len(made) == 64 and made != job_secret({}, may_generate=True)
    with pytest.raises(ValueError, match=r"cluster.nnodes=2.*CKLESS_JOB_SECRET"):
        job_secret({}, may_generate=False, why_needed="cluster.nnodes=2")
    with pytest.raises(ValueError, match="at least 16"):
        job_secret({"CKLESS_JOB_SECRET": "short"}, may_generate=False)

    path = tmp_path / "secret"
    write_secret_file(path, SECRET)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert job_secret({"CKLESS_JOB_SECRET_FILE": str(path)}, may_generate=False) == SECRET
    with pytest.raises(FileExistsError):
        write_secret_file(path, "x" * 20)  # never overwrites
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_secret_file(path)
    path.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(ValueError, match="cannot open"):
        read_secret_file(link)  # never follows a symlink


def test_loop_state_reads_back_plain_data_only():
    state = {"loops": {"fit_loop": {"epoch": 1, "done": False}}, "rng": b"\x00\x01", "lr": [3e-4]}
    assert decode_loop_state(encode_loop_state(state)) == state

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    hostile = io.BytesIO()
    torch.save({"loops": Payload()}, hostile)  # what a hostile peer could send
    with pytest.raises(UnsafeLoopState, match="refused"):
        decode_loop_state(hostile.getvalue())
    with pytest.raises(UnsafeLoopState, match="not a dict"):
        decode_loop_state(encode_loop_state([1, 2]))  # type: ignore[arg-type]
    with_tensor = {"callbacks": {"metric": torch.tensor([1.5, 2.0])}}
    assert torch.equal(
        decode_loop_state(encode_loop_state(with_tensor))["callbacks"]["metric"], torch.tensor([1.5, 2.0])
    )


def test_loop_state_plain_data_travels_as_a_restricted_pickle_anything_else_through_torch_save():
    """Plain data (every step's case) is a pickle read back by an unpickler that names only builtin
    containers; a state with a tensor (or any other class) goes through torch.save; a pickle that
    names anything else is refused, never run."""
    plain = {"a": collections.OrderedDict(x=1), "s": {1, 2}, "t": (1.5, None, b"x"), "d": {"k": [True]}}
    encoded = encode_loop_state(plain)
    assert encoded.startswith(b"\x80") and decode_loop_state(encoded) == plain
    assert encode_loop_state({"m": torch.tensor(1.0)}).startswith(b"PK")  # torch.save's zip
    assert encode_loop_state({"e": signal.SIGTERM}).startswith(b"PK")  # an enum: a class to name

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(UnsafeLoopState, match="refused"):
        decode_loop_state(pickle.dumps({"loops": Payload()}))
    with pytest.raises(UnsafeLoopState, match="refused"):
        decode_loop_state(b"")


SRUN_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "gpu[007-008]",
}
CLUSTER = {"launcher": "auto", "nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": 0}


def test_slurm_places_the_node(monkeypatch):
    monkeypatch.setattr(launcher.shutil, "which", lambda name: None)  # no scontrol: parse the list
    changes = place_from_scheduler(CLUSTER, SRUN_ENV)
    assert changes == {"node_rank": 1, "nnodes": 2, "master_addr": "gpu007", "master_port": slurm_port(4242)}
    # Outside an srun step (the batch script itself), or with launcher=manual: the config as given.
    batch_step = {k: v for k, v in SRUN_ENV.items() if k != "SLURM_STEP_ID"}
    assert place_from_scheduler(CLUSTER, batch_step) == {}
    assert place_from_scheduler({**CLUSTER, "launcher": "manual"}, SRUN_ENV) == {}
    with pytest.raises(ValueError, match=r"srun python launch\.py"):
        place_from_scheduler({**CLUSTER, "launcher": "slurm"}, batch_step)
    # The command line wins; a node count that contradicts Slurm's is an error naming both.
    explicit = place_from_scheduler(
        {**CLUSTER, "master_addr": "10.0.0.9", "master_port": 29400},
        SRUN_ENV,
        explicit={"cluster.master_addr"},
    )
    assert explicit == {"node_rank": 1, "nnodes": 2}
    with pytest.raises(ValueError, match=r"cluster.nnodes=4 on the command line, but Slurm says 2"):
        place_from_scheduler({**CLUSTER, "nnodes": 4}, SRUN_ENV, explicit={"cluster.nnodes"})
    # cluster.spare_nodes: the last tasks stand by; fewer tasks than that is an error.
    spare, three = {**CLUSTER, "spare_nodes": 1}, {**SRUN_ENV, "SLURM_STEP_NUM_TASKS": "3"}
    assert place_from_scheduler(spare, three)["nnodes"] == 2
    assert "standby" not in place_from_scheduler(spare, three)
    assert place_from_scheduler(spare, {**three, "SLURM_PROCID": "2"})["standby"] is True
    with pytest.raises(ValueError, match=r"cluster\.spare_nodes=2 but Slurm started 2"):
        place_from_scheduler({**CLUSTER, "spare_nodes": 2}, SRUN_ENV)
    # With a standalone store, no store port is derived.
    assert "master_port" not in place_from_scheduler({**CLUSTER, "store": "10.0.0.5:29400"}, SRUN_ENV)


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node1", "node1"), ("gpu[003-010,012],cpu1", "gpu003"), ("a[9],b", "a9"), ("x-1,x-2", "x-1")],
)
def test_first_host_of_a_node_list(monkeypatch, nodelist, first):
    monkeypatch.setattr(launcher.shutil, "which", lambda name: None)
    assert first_host(nodelist) == first


@pytest.mark.timeout(60)
def test_standalone_store_prints_its_address_and_writes_a_0600_secret(tmp_path):
    secret_file = tmp_path / "secret"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKLESS_JOB_SECRET")}
    proc = subprocess.Popen(
        [*STORE_COMMAND, "--host", "127.0.0.2", "--port", "0", "--secret-file", str(secret_file)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("job store listening on 127.0.0.2:"), line
        port = int(line.rsplit(":", 1)[1])
        assert (secret_file.stat().st_mode & 0o777) == 0o600
        listening = {
            c.laddr.ip
            for c in psutil.Process(proc.pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        }
        assert listening == {"127.0.0.2"}
        client = JobStore.connect("127.0.0.2", port, secret=read_secret_file(secret_file))
        assert client.generation() == 0
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()


def test_a_store_whose_job_ended_serves_no_second_job():
    """The trap of a store started by hand and reused: a second job under the same secret would read
    the first one's rendezvous keys (its generation, its votes)."""
    from ckless_lightning.recovery import InProcessRecovery

    store = JobStore.host("127.0.0.1", 0, secret="one-job")
    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "CKLESS_STORE_ADDR": "127.0.0.1",
        "CKLESS_STORE_PORT": str(store.port),
        "CKLESS_JOB_SECRET": "one-job",
    }
    assert InProcessRecovery.from_env(env).rank == 0  # a fresh store: joins
    store.mark_rank_finished(1)
    with pytest.raises(ValueError, match="served a job under this secret that finished"):
        InProcessRecovery.from_env(env)
    assert store.job_ended() is None
    store.mark_job_ended(0, "/runs/first")
    assert store.job_ended() == "0 /runs/first"
