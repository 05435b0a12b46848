"""Shared fixtures: Hydra composition as launch.py does it, and a tiny-job builder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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


@pytest.fixture
def compose(tmp_path: Path):
    return lambda *overrides: compose_config(list(overrides), tmp_path / "run")


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One packed-data cache for the session's launch.py runs (a cache hit after the first)."""
    return tmp_path_factory.mktemp("data_cache")


def launch_command(run_dir: Path, data_cache: Path, *overrides: str) -> list[str]:
    """``python launch.py`` as a user runs it, on a 2 MB slice of the built-in corpus, no progress bar.

    Without a ``fault=...`` override the run has no fault (``fault=none``: the
    default recipe's demo fault is off); without a ``tier=...`` override it runs at
    tier 0 (the user's default is tier 4).
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
