"""Package attributes that import their module on first use (PEP 562).

Why: ``launch.py`` validates a job config with the packages' light parts (the
configs, the mesh arithmetic, the buddy planner) before anything imports torch,
and the agent's package must not import torch before the fork server starts;
the heavy names of those packages load when first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``modules`` maps an attribute name to the submodule
    (relative to ``package``) that defines it; any other name raises ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        if name in modules:
            return getattr(importlib.import_module(f"{package}.{modules[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
