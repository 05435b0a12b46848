"""torchrun's restarted gloo workers cannot re-form their process group: a torch bug, reproduced
without this project.

    python bench/torchrun_gloo_restart_repro.py

Runs ``torchrun --standalone --nproc-per-node 4 --max-restarts 1`` over this file's worker: plain
``init_process_group("gloo")`` (env://), one all-reduce, and in the first attempt rank 1 exits with
code 1; rank 3 starts 3 s after its peers, as any slower worker does. torchrun restarts all four
workers; they should form a new group and finish. Then the same with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, and with the workers' own per-attempt store prefix.

Seen on torch 2.13 (CPU): by default the restarted workers fail in ``init_process_group`` with
``Gloo connectFullMesh failed ... Connection refused``; with the variable set they finish.

Why: torchrun's agent hosts the TCPStore that the workers' env:// rendezvous uses ("agent store",
``TORCHELASTIC_USE_AGENT_STORE=True``), and it creates that store server once
(``DynamicRendezvousHandler.next_rendezvous`` keeps ``_shared_tcp_store_server`` and
``_bootstrap_store_info`` across rounds; the static handler keeps ``_store``), so every attempt
gets the same ``MASTER_PORT`` and the same store. ``torch.distributed.rendezvous._create_c10d_store``
connects to it without a per-attempt prefix ("We create a new TCPStore for every retry so no need to
add prefix for each attempt"), and ``init_process_group`` uses the same key names in every attempt
(the default group's prefix). The restarted workers read the previous attempt's gloo addresses, which are
still in the store, and connect to ports nobody listens on any more. The store keys each attempt
finds before it starts (printed below) show the leftovers. Upstream: pytorch/pytorch#135712 (the
same fault with NCCL, closed in 2024; the store is still shared across restarts in 2.13).

Workarounds: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment (rank 0 of each
attempt then hosts a new store on a new port), or in the worker a
``PrefixStore(f"attempt{TORCHELASTIC_RESTART_COUNT}/", <TCPStore client of MASTER_ADDR:MASTER_PORT>)``
passed to ``init_process_group(store=...)`` (one agent numbers the attempts of all its workers alike;
across nodes the count is per agent, pytorch/pytorch#108158).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta


def worker() -> None:
    import torch
    import torch.distributed as dist

    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The agent's store, before any worker of this attempt touched it: rank 0 counts its keys
        # once all four workers have arrived (under a key of this attempt), then lets them go on.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=60),
        )  # fmt: skip
        store.add(f"repro/arrived{attempt}", 1)
        if rank == 0:
            while store.add(f"repro/arrived{attempt}", 0) < 4:
                time.sleep(0.01)
            keys = store.num_keys() - (1 + 2 * attempt)  # less this script's own repro/ keys
            print(f"attempt {attempt}: port {os.environ['MASTER_PORT']}, {keys} keys left in the store")
            store.set(f"repro/go{attempt}", "1")
        store.wait([f"repro/go{attempt}"])
    if rank == 3:
        time.sleep(3)  # a worker that starts later than its peers (imports, data, a slower node)
    if os.environ.get("REPRO_PREFIX"):
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=30),
        )  # fmt: skip
        store = dist.PrefixStore(f"attempt{attempt}/", client)
        world, timeout = int(os.environ["WORLD_SIZE"]), timedelta(seconds=30)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(1))
    if attempt == 0 and rank == 1:
        os._exit(1)
    dist.barrier()
    print(f"attempt {attempt}: rank {rank} ok", flush=True)
    dist.destroy_process_group()


def launch(extra_env: dict[str, str]) -> bool:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += ["--max-restarts=1", __file__]
    env = {**os.environ, **extra_env, "REPRO_WORKER": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    for line in text.splitlines():
        if line.startswith("attempt") and "keys" in line:
            print("  " + line)
    errors = [line.strip() for line in text.splitlines() if "connectFullMesh" in line]
    recovered = out.returncode == 0 and text.count("attempt 1: rank") == 4
    outcome = "attempt 1 formed its group" if recovered else "not recovered"
    print(f"  exit code {out.returncode}; {outcome}")
    if errors:
        print(f"  {errors[0][:200]}")
    return recovered


def main() -> None:
    import torch

    print(f"torch {torch.__version__}")
    print("torchrun --standalone --max-restarts=1, default (agent store shared):")
    default = launch({})
    print("the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:")
    unshared = launch({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    print("default again, each worker prefixing the store with its attempt (TORCHELASTIC_RESTART_COUNT):")
    prefixed = launch({"REPRO_PREFIX": "1"})
    print(f"reproduced: {not default and unshared and prefixed}")


if __name__ == "__main__":
    worker() if os.environ.get("REPRO_WORKER") else main()
