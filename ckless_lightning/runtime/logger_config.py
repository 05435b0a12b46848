"""The job's experiment logger: the ``logger`` config group (``conf/logger/``), checked before ranks start.

``logger`` is a mapping: ``_target_`` names a Lightning ``Logger`` class and the other keys are its
keyword arguments. Rank 0 builds it with ``hydra.utils.instantiate``
(:func:`ckless_lightning.training.job.build_logger`); :class:`LoggerConfig` checks it in
``launch.py`` first, so a typo or a missing package fails there, not in a rank.

The checks do not import Lightning (it costs the launcher seconds): the Lightning loggers that
``conf/logger/`` configures are known by name (:data:`KNOWN_LOGGERS`), with the packages they need,
the pip extra of this project that installs them, and their constructor's parameters
(``tests/test_loggers.py`` fails when the table falls behind Lightning). Any other ``_target_`` is
imported and must be a ``lightning.pytorch.loggers.Logger`` subclass.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CSV_LOGGER", "KNOWN_LOGGERS", "LoggerConfig", "LoggerSpec"]

_PREFIX = "lightning.pytorch.loggers."
CSV_LOGGER = _PREFIX + "CSVLogger"


@dataclass(frozen=True)
class LoggerSpec:
    """What a known Lightning logger needs.

    ``packages``: for each requirement, the modules of which one must be importable (the first is
    the pip package to name); ``extra``: this project's pip extra that installs them; ``params``: the
    constructor's keyword parameters; ``forwards_kwargs``: the class passes other keywords on (to
    ``SummaryWriter``, ``wandb.init``), so they are checked when rank 0 builds the logger.
    """

    packages: tuple[tuple[str, ...], ...]
    extra: str | None
    params: frozenset[str]
    forwards_kwargs: bool = False


# Written against Lightning 2.6 (tests/test_loggers.py compares it with the installed Lightning).
KNOWN_LOGGERS: dict[str, LoggerSpec] = {
    CSV_LOGGER: LoggerSpec(
        (), None, frozenset("save_dir name version prefix flush_logs_every_n_steps".split())
    ),
    _PREFIX + "TensorBoardLogger": LoggerSpec(
        (("tensorboard", "tensorboardX"),),
        "tensorboard",
        frozenset("save_dir name version log_graph default_hp_metric prefix sub_dir".split()),
        forwards_kwargs=True,
    ),
    _PREFIX + "WandbLogger": LoggerSpec(
        (("wandb",),),
        "wandb",
        frozenset(
            "name save_dir version offline dir id anonymous project log_model experiment prefix "
            "checkpoint_name add_file_policy".split()
        ),
        forwards_kwargs=True,
    ),
    _PREFIX + "MLFlowLogger": LoggerSpec(
        (("mlflow",),),
        "mlflow",
        frozenset(
            "experiment_name run_name tracking_uri tags save_dir log_model prefix artifact_location "
            "run_id synchronous".split()
        ),
    ),
}

# MLflow's database stores (conf/logger/mlflow.yaml: sqlite under the run dir) need these as well.
_MLFLOW_DATABASE = (("sqlalchemy",), ("alembic",))


def _installed(module: str) -> bool:
    """Whether top-level ``module`` can be imported (found on the path; nothing is imported)."""
    return importlib.util.find_spec(module) is not None


def _is_hydra_key(key: str) -> bool:
    """``_recursive_``, ``_convert_``, ``_partial_``, ``_args_``: for ``instantiate``, not the class."""
    return key.startswith("_") and key.endswith("_")


@dataclass
class LoggerConfig:
    """``logger``: ``target`` is its ``_target_``, ``kwargs`` the rest (the class's keyword arguments).

    Build it from the config's mapping with :meth:`from_mapping`; :meth:`to_mapping` gives it back
    for ``hydra.utils.instantiate``. Raises ``ValueError`` naming the key for a missing or
    unimportable ``_target_``, a class that is not a Lightning logger, an unknown keyword, or a
    package the logger needs that is not installed (with the pip extra that installs it).
    """

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target.strip():
            raise ValueError(
                "logger._target_ is missing: choose a logger with logger=csv | tensorboard | wandb | mlflow, "
                f"or name a Lightning logger class, e.g. logger._target_={CSV_LOGGER}"
            )
        bad_keys = sorted(repr(k) for k in self.kwargs if not isinstance(k, str))
        if bad_keys:
            raise ValueError(f"logger keys must be strings, got {', '.join(bad_keys)}")
        spec = KNOWN_LOGGERS.get(self.target)
        if spec is None:
            spec = self._imported_spec()
        self._check_params(spec)
        self._check_packages(spec)

    @classmethod
    def from_mapping(cls, values: Any) -> LoggerConfig:
        """The config's ``logger`` node (``_target_`` and keyword arguments), validated."""
        if not isinstance(values, Mapping):
            raise ValueError(
                f"logger must be a mapping with a _target_ (e.g. logger=csv), got {type(values).__name__}"
            )
        kwargs = dict(values)
        return cls(kwargs.pop("_target_", ""), kwargs)  # a missing or bad _target_: __post_init__ says so

    @classmethod
    def csv(cls, run_dir: str) -> LoggerConfig:
        """The default, what ``conf/logger/csv.yaml`` sets: ``<run_dir>/logs/version_<N>/metrics.csv``."""
        return cls(CSV_LOGGER, {"save_dir": run_dir, "name": "logs"})

    def to_mapping(self) -> dict[str, Any]:
        """``{"_target_": ..., **kwargs}``, for ``hydra.utils.instantiate``."""
        return {"_target_": self.target, **self.kwargs}

    def _imported_spec(self) -> LoggerSpec:
        """A ``_target_`` outside the table: import it (the user's module; Lightning comes with it)."""
        module_name, _, name = self.target.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name) if module_name else None
        except (ImportError, AttributeError) as err:
            cls, reason = None, f"{type(err).__name__}: {err}"
        else:
            reason = "not a class" if module_name else "give the class's full path"
        if not isinstance(cls, type):
            raise ValueError(
                f"logger._target_={self.target!r} cannot be imported ({reason}); name a Lightning logger "
                "class or choose logger=csv | tensorboard | wandb | mlflow"
            )
        # Any module that defines a Lightning logger has imported Lightning: look it up, do not
        # import it (runtime/ imports no Lightning; tests/test_layout.py).
        loggers = sys.modules.get("lightning.pytorch.loggers")
        if loggers is None or not issubclass(cls, loggers.Logger):
            raise ValueError(
                f"logger._target_={self.target!r} is not a Lightning logger "
                "(a subclass of lightning.pytorch.loggers.Logger)"
            )
        parameters = inspect.signature(cls.__init__).parameters.values()
        return LoggerSpec(
            packages=(),
            extra=None,
            params=frozenset(
                p.name
                for p in parameters
                if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            ),
            forwards_kwargs=any(p.kind == p.VAR_KEYWORD for p in parameters),
        )

    def _check_params(self, spec: LoggerSpec) -> None:
        if spec.forwards_kwargs:
            return
        unknown = sorted(k for k in self.kwargs if k not in spec.params and not _is_hydra_key(k))
        if unknown:
            name = self.target.rsplit(".", 1)[-1]
            known = ", ".join(sorted(spec.params))
            raise ValueError(
                f"unknown config key(s) {', '.join(f'logger.{k}' for k in unknown)}; "
                f"known keys under logger ({name}): {known}"
            )

    def _check_packages(self, spec: LoggerSpec) -> None:
        needed = list(spec.packages)
        uri = self.kwargs.get("tracking_uri")
        if self.target == _PREFIX + "MLFlowLogger" and isinstance(uri, str) and uri.startswith("sqlite:"):
            needed += _MLFLOW_DATABASE
        for modules in needed:
            if not any(_installed(m) for m in modules):
                extra = f" (the project's extra: pip install -e '.[{spec.extra}]')" if spec.extra else ""
                raise ValueError(
                    f"logger._target_={self.target} needs the package {modules[0]}, which is not "
                    f"installed: pip install {modules[0]}{extra}"
                )
