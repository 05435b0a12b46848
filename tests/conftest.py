"""Shared fixtures: Hydra composition as launch.py does it, and a tiny-job builder."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("CKLESS_PROJECT_ROOT", str(ROOT))

FULL_RECIPES = ["llama3_8b", "llama3_70b", "llama3_405b", "mixtral_8x7b", "mixtral_8x22b"]


def compose_config(overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Compose conf/config.yaml + recipe + overrides exactly as launch.py does; return it resolved."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config", overrides=[f"run_dir={run_dir}", *overrides], return_hydra_config=True
        )
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    return container


SHM = Path("/dev/shm")  # data.mmap_cache_base's default: the jobs of most tests put their batch cache here


@pytest.fixture(autouse=True)
def no_orphan_batch_cache():
    """Fail a test after which a batch-cache directory of a dead agent is left in ``/dev/shm`` that was
    not there before it (an agent killed with SIGKILL cannot remove its own; the next agent on the
    node would, but at the end of a test there is none): removed, and named in the failure. Under
    pytest-xdist the test beside it may have left it."""
    from ckless_lightning.agent.batch_cache_service import orphan_cache_dirs

    before = {entry.name for entry in SHM.iterdir()} if SHM.is_dir() else set()
    yield
    if not SHM.is_dir():
        return
    left = [entry for entry in orphan_cache_dirs(SHM) if entry.name not in before]
    for entry in left:
        shutil.rmtree(entry, ignore_errors=True)
    assert not left, (
        f"batch-cache directories of dead agents left in {SHM} (removed): {[e.name for e in left]};"
        " a test that kills an agent passes data.mmap_cache_base under its tmp_path"
    )


@pytest.fixture
def compose(tmp_path: Path):
    return lambda *overrides: compose_config(list(overrides), tmp_path / "run")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One packed-data cache for the session's launch.py runs (a cache hit after the first), shared
    by pytest-xdist's test processes (their temp dirs have one parent; preparing the same data
    twice at once is safe: the second copy is discarded)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / "data_cache"
    path.mkdir(exist_ok=True)
    return path


def launch_command(run_dir: Path, data_cache: Path, *overrides: str) -> list[str]:
    """``python launch.py`` as a user runs it, on a 2 MB slice of the built-in corpus, no progress bar.

    Without a ``fault=...`` override the run has no fault (``fault=none``: the
    default recipe's demo fault is off); without a ``tier=...`` override it runs at
    tier 0 (the user's default is tier 4); without a ``timeline=...`` override it draws
    no timeline picture (test_report.py draws them; matplotlib costs each job ~1.5 s); without a
    ``data.seq_len=...`` override it trains on 32-token sequences (the recipe's 128 made each job
    ~4 s of CPU slower on 2 cores; what the tests assert does not depend on the length).
    """
    return [
        sys.executable,
        str(ROOT / "launch.py"),
        f"hydra.run.dir={run_dir}",
        f"data.cache_dir={data_cache}",
        "data.max_source_bytes=2000000",
        "trainer.enable_progress_bar=false",
        *([] if any(o.startswith("fault=") for o in overrides) else ["fault=none"]),
        *([] if any(o.startswith("tier=") for o in overrides) else ["tier=0"]),
        *([] if any(o.startswith("timeline=") for o in overrides) else ["timeline=false"]),
        *([] if any(o.startswith("data.seq_len=") for o in overrides) else ["data.seq_len=32"]),
        *overrides,
    ]


def launch_job(
    run_dir: Path, data_cache: Path, *overrides: str, expect: int | None = 0, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run :func:`launch_command` to the end; assert the exit code when ``expect`` is not None.

    ``subprocess.run`` kills launch.py on timeout, and its ranks die with it (PR_SET_PDEATHSIG).
    """
    result = subprocess.run(
        launch_command(run_dir, data_cache, *overrides), capture_output=True, text=True, timeout=timeout
    )
    if expect is not None:
        assert result.returncode == expect, (
            f"exit {result.returncode}, expected {expect}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return result


def left_behind_ranks(run_dir: Path) -> set[int]:
    """Ranks that exited left behind (``comm.stuck_exit_s``: code 6), by their rank logs.

    A survivor is sometimes still blocked in a gloo collective 10 s after the job moved on and its
    connections were cut (seen about once in three CI runs, never here: FSDP2's forward all-gather,
    ``work.wait()``); the product then ends it and its agent replaces it, bitwise. Since
    2026-12-07 the watch first resets and writes on its connections (``recovery.sever.unstick``),
    which frees the gloo case understood so far; what that does not free still exits. Tests of the
    fault rows set such a rank's extra ``exit(6)`` row aside (:func:`rows_besides_left_behind`)
    and print its stack (docs/troubleshooting.md)."""
    ranks = set()
    for log in (run_dir / "rank_logs").glob("rank*.log"):
        if "still blocked on peers" in log.read_text(errors="replace"):
            ranks.add(int(log.stem.removeprefix("rank")))
    return ranks


_CUT = re.compile(r"still in generation (\d+) after the job moved on: cutting its connections")


def uncut_ranks(run_dir: Path) -> set[int]:
    """Ranks a generation watch cut because the job moved on without them, and that the cut did not
    free: they exited left behind (:func:`left_behind_ranks`), or their agent killed them as hung
    first (``agent.hang_timeout`` shorter than ``comm.stuck_exit_s``, as in test_tier3). The same
    open gloo case (docs/troubleshooting.md); the product replaces such a rank and the run stays
    bitwise, with one recovery no fault plan holds."""
    from ckless_lightning.record.events import read_events

    events = read_events(run_dir / "events.jsonl")
    hung = [
        (e["rank"], e["gen"]) for e in events if e["kind"] == "fault_detected" and e.get("reason") == "hang"
    ]
    cut: dict[int, list[int]] = {}  # rank -> the generations its watch cut it in
    for log in (run_dir / "rank_logs").glob("rank*.log"):
        found = _CUT.findall(log.read_text(errors="replace"))
        if found:
            cut[int(log.stem.removeprefix("rank"))] = [int(gen) for gen in found]
    # Killed as hung after a cut: in a later generation than the cut's (the job had moved on). A
    # planned hang of the same rank in an earlier generation is not the cut's.
    return left_behind_ranks(run_dir) | {
        rank for rank, gen in hung if any(gen > c for c in cut.get(rank, []))
    }


def rows_besides_left_behind(names: list[str], run_dir: Path) -> list[str]:
    """Fault row names without the ``exit(6)@r`` rows of ranks that exited left behind (their stacks
    are printed, for the record)."""
    left = left_behind_ranks(run_dir)
    if left:
        print(f"ranks {sorted(left)} exited left behind:\n{left_behind_traces(run_dir)}")
    return [name for name in names if name not in {f"exit(6)@{r}" for r in left}]


def left_behind_traces(run_dir: Path, lines: int = 60) -> str:
    """For a failing assertion's message: each rank log's account of a rank that exited left behind
    (``comm.stuck_exit_s``: still blocked on peers after its cut), with the main thread's stack it
    printed; empty when none did."""
    found = []
    for log in sorted((run_dir / "rank_logs").glob("rank*.log")):
        text = log.read_text(errors="replace").splitlines()
        for i, line in enumerate(text):
            if "still blocked on peers" in line:
                found.append(f"--- {log.name} ---\n" + "\n".join(text[max(0, i - 10) : i + lines]))
    return "\n".join(found)


# One fault-free llama3_tiny run on 4 ranks, 12 steps, checkpoint every 5, samples recorded: the
# reference of test_agent.py, test_tier2.py and test_slurm.py (faults there change nothing else).
TINY_REFERENCE = ("trainer.max_steps=12", "checkpoint.every_n_steps=5", "data.record_samples=true")
# The same training as HSDP 2x2 at tier 4, no disk checkpoint but the last, samples recorded:
# test_tier4.py's, test_state_digest.py's and test_elastic.py's reference (the digest and the
# checkpoint cadence change no bit of it).
TINY_HSDP_REFERENCE = (
    "recipe=llama3_tiny",
    "trainer.max_steps=12",
    "tier=4",
    "cluster.replicate=2",
    "replication.source=hsdp",
    "checkpoint.every_n_steps=0",
    "data.record_samples=true",
)
# Mixtral with buddy copies at tier 4 on 4 ranks (test_tier4.py's and test_chaos.py's reference), and
# llama3_tiny on 3 ranks (uneven shards; test_chaos.py's).
MIXTRAL_REFERENCE = (
    "recipe=mixtral_tiny",
    "trainer.max_steps=12",
    "tier=4",
    "replication.source=buddy",
    "checkpoint.every_n_steps=0",
)
THREE_RANK_REFERENCE = (
    "recipe=llama3_tiny",
    "trainer.max_steps=12",
    "cluster.nproc_per_node=3",
    "trainer.global_batch_size=12",
)
REFERENCE_LOCK_TIMEOUT_S = 900  # another test process building the same run (a 4-rank job: ~1 min)


@pytest.fixture(scope="session")
def reference_run(data_cache: Path):
    """``reference_run(*overrides)``: the run dir of a fault-free ``launch.py`` job with these
    overrides, built once for the whole session, test processes included (a file lock: the
    second process waits for the first one's run, bounded). Only for runs the tests read and
    never change."""
    root = data_cache.parent / "references"
    root.mkdir(exist_ok=True)

    def get(*overrides: str) -> Path:
        key = hashlib.sha256("\0".join(overrides).encode()).hexdigest()[:16]
        run = root / key
        with FileLock(root / f"{key}.lock", timeout=REFERENCE_LOCK_TIMEOUT_S):
            done = run / "reference.done"
            if not done.exists():
                if run.exists():  # a process killed while building it: build it again
                    shutil.rmtree(run)
                launch_job(run, data_cache, *overrides)
                done.write_text(" ".join(overrides))
        return run

    return get


# The slowest files (4-rank jobs), slowest first: pytest-xdist (pyproject: -n 2 --dist loadfile
# --no-loadscope-reorder) hands each test process one file, then a second (the first four: tier 4
# and tier 3 to one, the agent and tier 2 to the other, ~575 s and ~485 s on 2 cores), then the
# next file to whichever finishes first, so the short files fill in around the long ones.
SLOWEST_FILES = (
    "test_tier4.py",
    "test_agent.py",
    "test_chaos.py",
    "test_tier3.py",
    "test_tier2.py",
    "test_partition.py",
    "test_models_sharded.py",
    "test_slurm.py",
    "test_state_digest.py",
    "test_own_module.py",
    "test_runner.py",
    "test_elastic.py",
    "test_outside_faults.py",
    "test_faults.py",
    "test_cli.py",
    "test_launcher_cleanup.py",
    "test_report.py",
    "test_training.py",
    "test_spares.py",
    "test_replication_unit.py",
    "test_user_trainer.py",
    "test_fork_server.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: file order kept
