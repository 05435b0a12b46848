"""Run your own training script as the job's ranks, under the node agent (a torchrun for every tier).

    python -m ckless_lightning.run [--nproc-per-node N] [--nnodes N] [--config-dir DIR]
        [KEY=VALUE ...] SCRIPT [SCRIPT ARGS ...]

(or ``ckless-run`` once the package is installed). Starts what ``launch.py`` starts (the node
agent, its job store and secret, warm spares and the fork server) and runs ``SCRIPT`` with
its arguments as each rank; the script calls this module's ``fit`` where it would call
``Trainer.fit`` (``from ckless_lightning.run import fit``, defined in
:mod:`ckless_lightning.training.script_rank`). ``KEY=VALUE`` are the job's settings as for
``launch.py`` (Hydra overrides of ``conf/config.yaml`` and the ``script`` recipe: ``tier=4``,
``fault=kill``, ``agent.spares=1``, ``checkpoint.every_n_steps=5``, ...); ``--nproc-per-node``
and ``--nnodes`` are ``cluster.nproc_per_node`` and ``cluster.nnodes``. Exit codes as
``launch.py``'s (0 done, 2 bad config, 75 fault budget spent).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckless_lightning.training.script_rank import fit

__all__ = ["RunnerArgs", "fit", "main", "parse_runner_args"]

_OPTIONS = {"--nproc-per-node": "cluster.nproc_per_node", "--nnodes": "cluster.nnodes"}
_USAGE = (
    "usage: python -m ckless_lightning.run [--nproc-per-node N] [--nnodes N] [--config-dir DIR] "
    "[KEY=VALUE ...] SCRIPT [SCRIPT ARGS ...]"
)


@dataclass
class RunnerArgs:
    """The runner's command line: Hydra's arguments (overrides, ``--config-dir``) and the script's."""

    hydra: list[str] = field(default_factory=list)
    script: list[str] = field(default_factory=list)  # the script's path (absolute) and its arguments


def parse_runner_args(argv: list[str]) -> RunnerArgs:
    """Split ``argv`` at the script: options and ``KEY=VALUE`` before it, the script's own after.
    Raises ValueError with the usage on a missing script, option value or unknown option."""
    args = RunnerArgs()
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in (*_OPTIONS, "--config-dir") or name.replace("_", "-") in _OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{name} needs a value\n{_USAGE}")
                value = argv[i + 1]
                i += 1
            key = _OPTIONS.get(name.replace("_", "-"))
            if key is None:
                args.hydra.append(f"--config-dir={value}")
            else:
                overrides.append(f"{key}={value}")
        elif arg.startswith("-"):
            raise ValueError(f"unknown option {arg} (the script's own options go after the script)\n{_USAGE}")
        elif eq and not arg.endswith(".py"):
            overrides.append(arg)
        else:
            args.script = [str(Path(arg).resolve()), *argv[i + 1 :]]
            break
        i += 1
    if not args.script:
        raise ValueError(f"no script given\n{_USAGE}")
    if not Path(args.script[0]).is_file():
        raise ValueError(f"script {arg} not found (from {os.getcwd()})\n{_USAGE}")
    if not any(o.split("=", 1)[0] == "recipe" for o in overrides):
        overrides.insert(0, "recipe=script")  # recipes/script.yaml: the job's defaults for a script
    args.hydra.extend(quote_tier(o) for o in overrides)
    return args


def __getattr__(name: str) -> Any:
    """``fit`` (:func:`ckless_lightning.training.script_rank.fit`), imported on first use: the
    runner itself starts without torch and Lightning."""
    if name == "fit":
        from ckless_lightning.training.script_rank import fit

        return fit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def quote_tier(override: str) -> str:
    """``tier=3`` as Hydra needs a config-group choice: a string (Hydra 1.3: "Config group override
    must be a string or a list. Got int")."""
    name, eq, value = override.partition("=")
    return f"{name}='{value}'" if name == "tier" and eq and value.isdigit() else override


def main(argv: list[str] | None = None) -> int:
    """The runner; returns the job's exit code (``sys.exit`` it)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        args = parse_runner_args(argv)
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[1]
    conf = root / "conf"
    if not (conf / "config.yaml").is_file():
        print(
            f"config error: {conf / 'config.yaml'} not found: the runner composes the project's conf/ "
            "and recipes/; install the project from its checkout (pip install -e .)",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("CKLESS_PROJECT_ROOT", str(root))  # where recipes/ is (Hydra's search path)

    import hydra
    from omegaconf import DictConfig, OmegaConf

    from ckless_lightning.runtime.hydra_app import composed, run_hydra_app

    code = 0

    @hydra.main(version_base="1.3", config_path=str(conf), config_name="config")
    def job(cfg: DictConfig) -> None:
        nonlocal code
        composed()
        from ckless_lightning.cli import command_line_keys, run_job

        OmegaConf.update(cfg, "script", args.script, force_add=True)
        code = run_job(cfg, env=os.environ, explicit=command_line_keys())

    sys.argv = [sys.argv[0], *args.hydra]
    run_hydra_app(job)
    return code


if __name__ == "__main__":
    sys.exit(main())
