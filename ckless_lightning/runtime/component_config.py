"""The job's LightningModule and LightningDataModule: the ``module`` and ``datamodule`` config entries.

Each is a mapping in Hydra's ``instantiate`` form: ``_target_`` names the class (or a function that
returns an instance) and the other keys are its keyword arguments::

    module:
      _target_: my_package.MyModule
      hidden: 256
    datamodule:
      _target_: my_package.MyDataModule
      batch_size: 32

Every rank builds them with ``hydra.utils.instantiate`` (:func:`ckless_lightning.training.job.build_module`).
The defaults are the built-in classes, :data:`BUILTIN_MODULE` (``CausalLMModule``, its arguments
from ``model``/``optim``/``fsdp``) and :data:`BUILTIN_DATAMODULE` (``TokenDataModule``, from
``data``): they take no keys of their own. :meth:`ComponentConfig.check` runs in ``launch.py``
before anything starts: the target must import, be of the right kind, and accept the keys given.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUILTIN_DATAMODULE", "BUILTIN_MODULE", "ComponentConfig", "import_object"]

BUILTIN_MODULE = "ckless_lightning.training.CausalLMModule"
BUILTIN_DATAMODULE = "ckless_lightning.training.TokenDataModule"
_BUILTIN_SECTIONS = {BUILTIN_MODULE: "model, optim and fsdp", BUILTIN_DATAMODULE: "data"}
# Where each built-in class is defined, so that any spelling of it counts as the built-in one.
_BUILTIN_ALIASES = {
    "ckless_lightning.training.module.CausalLMModule": BUILTIN_MODULE,
    "ckless_lightning.training.datamodule.TokenDataModule": BUILTIN_DATAMODULE,
}
_KINDS = {"module": "LightningModule", "datamodule": "LightningDataModule"}


@dataclass(frozen=True)
class ComponentConfig:
    """``key`` (``module`` or ``datamodule``): ``target`` and its keyword arguments ``kwargs``."""

    key: str
    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.key in _KINDS, self.key
        if not isinstance(self.target, str) or not self.target.strip():
            raise ValueError(
                f"{self.key}._target_ must name a {_KINDS[self.key]} class, e.g. "
                f"{self.key}._target_=my_package.My{_KINDS[self.key][9:]} "
                f"(default: {BUILTIN_MODULE if self.key == 'module' else BUILTIN_DATAMODULE})"
            )
        if self.builtin and self.kwargs:
            raise ValueError(
                f"{self.key}._target_={self.target} (built in) takes its arguments from "
                f"{_BUILTIN_SECTIONS[self.canonical]}, not from {self.key}."
                f"{'/'.join(sorted(self.kwargs))}: move them there, or name your own class"
            )

    @classmethod
    def from_mapping(cls, key: str, values: Any, default: str) -> ComponentConfig:
        """From the composed config's ``key`` entry (absent or null: ``default``)."""
        if values is None:
            return cls(key, default)
        if not isinstance(values, Mapping):
            raise ValueError(
                f"{key} must be a mapping with _target_ (the class) and its arguments, got {values!r}"
            )
        kwargs = {str(k): v for k, v in values.items() if k != "_target_"}
        hydra_keys = sorted(k for k in kwargs if k.startswith("_") and k.endswith("_"))
        if hydra_keys:
            raise ValueError(
                f"{key}.{hydra_keys[0]} is not supported: {key} is built with its keyword arguments only"
            )
        return cls(key, values.get("_target_") or default, kwargs)

    @property
    def canonical(self) -> str:
        return _BUILTIN_ALIASES.get(self.target, self.target)

    @property
    def builtin(self) -> bool:
        """The project's own class (built from the job's other sections), not a user's."""
        return self.canonical in _BUILTIN_SECTIONS

    def to_mapping(self) -> dict[str, Any]:
        """The ``hydra.utils.instantiate`` form."""
        return {"_target_": self.target, **self.kwargs}

    def check(self) -> None:
        """Import the target and check that it is a class (or factory) of the right kind that accepts
        ``kwargs``; raise ValueError naming the key and the fix. Imports the user's code (and with it
        Lightning): call it once, in the launcher."""
        if self.builtin:
            return
        try:
            target = import_object(self.target)
        except Exception as err:
            raise ValueError(
                f"{self.key}._target_={self.target} cannot be imported ({type(err).__name__}: {err}); "
                "is its package on "
                "PYTHONPATH (e.g. PYTHONPATH=path/to/your/code python launch.py ...) or installed?"
            ) from err
        if not callable(target):
            raise ValueError(f"{self.key}._target_={self.target} is not a class or a function")
        if isinstance(target, type):
            # The launcher does not import Lightning; a subclass of Lightning's class has imported it.
            base = getattr(sys.modules.get("lightning.pytorch"), _KINDS[self.key], None)
            if base is None or not issubclass(target, base):
                raise ValueError(
                    f"{self.key}._target_={self.target} is a {target.__name__}, not a "
                    f"lightning.pytorch.{_KINDS[self.key]} subclass"
                )
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return  # no signature to check (a builtin): the rank reports a bad argument
        try:
            signature.bind(**self.kwargs)
        except TypeError as err:
            known = [
                name
                for name, p in signature.parameters.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            ]
            raise ValueError(
                f"{self.key}: {self.target}({', '.join(f'{k}=...' for k in self.kwargs)}) does not "
                f"fit its signature ({err}); its arguments: {', '.join(known) or 'none'}"
            ) from err


def import_object(path: str) -> Any:
    """The object a dotted ``path`` names (``package.module.Class``), as ``_target_`` resolves it;
    an import error inside the user's module is raised as it is."""
    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:end])
        try:
            found: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is None or not module_name.startswith(err.name):
                raise  # the module exists and one of its own imports failed
            if end == 1:
                raise
            continue
        for attr in parts[end:]:
            found = getattr(found, attr)
        return found
    raise ValueError(f"{path!r} is not a dotted path (package.module.Name)")
