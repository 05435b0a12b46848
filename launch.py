"""Train a recipe: ``python launch.py [recipe=NAME] [key=value ...]``.

Hydra composes ``conf/config.yaml``, the recipe from ``recipes/`` and the
overrides; ``ckless_lightning.cli.run_job`` validates it, prepares the data
and starts the ranks. ``python launch.py --cfg job`` prints the composed
config; ``dry_run=true`` prints the model size and per-rank memory plan.
"""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from ckless_lightning.run import quote_tier
from ckless_lightning.runtime.hydra_app import composed, run_hydra_app

# The one environment variable of the project: where recipes/ is (conf/config.yaml's search path).
os.environ.setdefault("CKLESS_PROJECT_ROOT", str(Path(__file__).resolve().parent))

# Hydra parses `tier=3` as an int, and a config-group choice must be a string: quoted here so
# that users can write tier=3 as the docs say.
sys.argv[1:] = [quote_tier(arg) for arg in sys.argv[1:]]


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    composed()
    from ckless_lightning.cli import command_line_keys, run_job

    code = run_job(cfg, env=os.environ, explicit=command_line_keys())
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run_hydra_app(main)  # an unknown key or recipe: "config error: ..." naming the fix, exit 2
