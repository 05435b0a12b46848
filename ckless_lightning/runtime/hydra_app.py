"""launch.py's and the runner's Hydra app: composition errors as config errors, and ``--help``.

``launch.py`` and the runner compose their config with ``@hydra.main``. When the command line
names a key the config does not have (``trainer.max_step=10``), a recipe or group choice that does
not exist (``recipe=llama3_tinyy``) or an override Hydra cannot parse, Hydra prints its own
message and exits 1, and for a mistyped key its hint (``+trainer.max_step=10``) adds the typo
to the config. :func:`run_hydra_app` reports these the way every other bad input is reported:
``config error: ...`` naming the key, the nearest real key or choice, and exit code 2. It also
registers the resolver ``${ckless_recipes:}`` that ``--help`` (``hydra.help.template`` in
``conf/config.yaml``) lists the recipes with.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ckless_lightning.runtime.contract import ExitCode

__all__ = ["composed", "explain_composition_error", "run_hydra_app"]

# Hydra re-raises a composition error (rather than printing it and exiting 1) when this is set.
_FULL_ERROR = "HYDRA_FULL_ERROR"
# Config groups whose options live under another directory name on the search path.
_GROUP_KEY = {"recipes": "recipe"}


def run_hydra_app(app: Callable[[], Any]) -> None:
    """Call ``app``, a ``@hydra.main`` function; Hydra's composition errors exit 2 with
    ``config error: ...`` on stderr (:func:`explain_composition_error`). Everything else, the
    task's own errors included, is Hydra's and the task's to report, as without this wrapper."""
    from hydra.errors import ConfigCompositionException, OverrideParseException
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("ckless_recipes", _recipe_names, replace=True)
    ours = _FULL_ERROR not in os.environ
    if ours:
        os.environ[_FULL_ERROR] = "1"
    try:
        app()
    except (ConfigCompositionException, OverrideParseException) as err:
        print(f"config error: {explain_composition_error(err)}", file=sys.stderr)
        sys.exit(ExitCode.CONFIG)
    finally:
        if ours:
            os.environ.pop(_FULL_ERROR, None)


def _recipe_names() -> str:
    """The recipes in ``$CKLESS_PROJECT_ROOT/recipes`` (set by launch.py and the runner)."""
    root = Path(os.environ.get("CKLESS_PROJECT_ROOT", "."))
    return ", ".join(sorted(p.stem for p in (root / "recipes").glob("*.yaml")))


def composed() -> None:
    """Call first in a task run by :func:`run_hydra_app`: composition is over, so Hydra reports
    the task's own errors its usual way again (and the ranks do not inherit the setting)."""
    if os.environ.get(_FULL_ERROR) == "1":
        os.environ.pop(_FULL_ERROR)


def explain_composition_error(err: Exception) -> str:
    """One message for a Hydra composition or override-parsing error: what is wrong and the fix."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(err, OverrideParseException):
        return (
            f"cannot parse the override {err.override!r} ({_parse_problem(err.message)}); "
            "write KEY=VALUE, e.g. trainer.max_steps=10 (quote values with spaces: 'data.source=\"a b\"')"
        )
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, choice = err.missing_cfg_file.rpartition("/")
        key = _GROUP_KEY.get(group, group)
        options = list(err.options or [])
        if not options:
            return (
                f"{key}={choice} is not found: no {group} are on Hydra's search path; a "
                "hydra.searchpath=[...] override replaces the project's, use --config-dir DIR instead"
            )
        near = difflib.get_close_matches(choice, options, n=1)
        hint = f"did you mean {key}={near[0]}? " if near else ""
        own = ""
        if key == "recipe":
            own = " (a recipe of your own: --config-dir DIR with DIR/recipes/NAME.yaml)"
        return f"{key}={choice} does not exist; {hint}choose one of: {', '.join(options)}{own}"
    cause = err.__cause__
    key = getattr(cause, "full_key", None)
    parent = getattr(cause, "parent_node", None)
    if key and parent is not None and str(err).startswith("Could not override"):
        return _unknown_key(str(key), [str(k) for k in parent.keys()])
    return str(err).replace("\n", " ")


def _parse_problem(message: str) -> str:
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and not line.startswith(("Error parsing", "See https"))]
    return "; ".join(kept) or "not KEY=VALUE"


def _unknown_key(full_key: str, siblings: Iterable[str]) -> str:
    section, _, name = full_key.rpartition(".")
    where = f"{section}." if section else ""
    siblings = sorted(siblings)
    near = difflib.get_close_matches(name, siblings, n=1)
    fix = f"did you mean {where}{near[0]}? " if near else ""
    listed = ", ".join(siblings[:24]) + (", ..." if len(siblings) > 24 else "")
    scope = f"{section}'s keys" if section else "the top-level keys"
    return (
        f"{full_key} is not a key of the config; {fix}{scope}: {listed} "
        f"(python launch.py --cfg job prints the whole config)"
    )
