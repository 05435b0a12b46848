"""The ``logger`` config group: choices compose and validate, bad ones fail naming the key, each builds.

The four choices of ``conf/logger/`` are built as rank 0 builds them (``build_logger``) and write
where docs/configuration.md "Loggers" says: CSV and TensorBoard version folders, a W&B offline
run, an MLflow database, all in the run dir.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from ckless_lightning.runtime import logger_config
from ckless_lightning.runtime.config import job_config_from_dict
from ckless_lightning.runtime.logger_config import KNOWN_LOGGERS, LoggerConfig


def _job(compose, *overrides: str):
    return job_config_from_dict(compose("fault=none", *overrides))


def test_default_is_csv_in_the_run_dir(compose, tmp_path: Path) -> None:
    job = _job(compose)
    assert job.logger == LoggerConfig.csv(str(tmp_path / "run"))


def test_a_choice_composes_and_its_fields_override(compose, tmp_path: Path) -> None:
    job = _job(compose, "logger=tensorboard", "logger.name=tb")
    assert job.logger is not None
    assert job.logger.target == "lightning.pytorch.loggers.TensorBoardLogger"
    assert job.logger.kwargs == {"save_dir": str(tmp_path / "run"), "name": "tb", "default_hp_metric": False}
    mlflow = _job(compose, "logger=mlflow").logger
    assert mlflow is not None and mlflow.kwargs["tracking_uri"] == f"sqlite:///{tmp_path}/run/mlflow.db"


def test_an_old_config_without_logger_gets_the_default(compose, tmp_path: Path) -> None:
    cfg = compose("fault=none")
    del cfg["logger"]
    assert job_config_from_dict(cfg).logger == LoggerConfig.csv(str(tmp_path / "run"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["~logger._target_"], r"logger\._target_ is missing"),
        (["logger._target_=no_such_module.Logger"], r"logger\._target_='no_such_module\.Logger' cannot be "),
        (["logger._target_=NoDots"], r"logger\._target_='NoDots' cannot be imported \(give the class's full"),
        (
            ["logger._target_=collections.OrderedDict"],
            r"logger\._target_='collections\.OrderedDict' is not a",
        ),
        (["+logger.nme=x"], r"unknown config key\(s\) logger\.nme; known keys under logger \(CSVLogger\)"),
        (["logger=mlflow", "+logger.save_dri=x"], r"logger\.save_dri"),
    ],
)
def test_bad_logger_fails_naming_the_key(compose, overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _job(compose, *overrides)


@pytest.mark.parametrize(
    ("choice", "missing", "extra"),
    [
        ("wandb", "wandb", "wandb"),
        ("tensorboard", "tensorboard", "tensorboard"),
        ("mlflow", "sqlalchemy", "mlflow"),
    ],
)
def test_a_missing_package_names_it_and_the_extra(compose, monkeypatch, choice, missing, extra) -> None:
    absent = {missing, "tensorboardX"}  # TensorBoardLogger also runs on tensorboardX
    monkeypatch.setattr(logger_config, "_installed", lambda module: module not in absent)
    with pytest.raises(
        ValueError, match=rf"needs the package {missing}, which is not installed.*'\.\[{extra}\]'"
    ):
        _job(compose, f"logger={choice}")


class FlavouredLogger(CSVLogger):
    """A user's own logger class: not in KNOWN_LOGGERS, so it is imported and its signature read."""

    def __init__(self, save_dir: str, *, flavour: str = "plain") -> None:
        super().__init__(save_dir)


def test_a_custom_logger_class_is_checked_by_its_signature() -> None:
    target = f"{__name__}.FlavouredLogger"
    assert LoggerConfig(target, {"save_dir": "x", "flavour": "tart"}).target == target
    with pytest.raises(
        ValueError, match=r"logger\.colour; known keys under logger \(FlavouredLogger\): flavour"
    ):
        LoggerConfig(target, {"save_dir": "x", "colour": "red"})


def test_the_table_matches_lightning() -> None:
    """KNOWN_LOGGERS lets launch.py check a logger without importing Lightning: it must stay true."""
    from hydra.utils import get_class

    for target, spec in KNOWN_LOGGERS.items():
        params = inspect.signature(get_class(target).__init__).parameters.values()
        named = {p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD}
        assert named == spec.params, (target, sorted(named ^ spec.params))
        assert any(p.kind is p.VAR_KEYWORD for p in params) == spec.forwards_kwargs, target


def _build(compose, *overrides: str):
    from ckless_lightning.training.job import build_logger

    job = _job(compose, *overrides)
    Path(job.run_dir).mkdir(parents=True)  # launch.py makes it before ranks start
    logger = build_logger(job)
    logger.log_metrics({"recovery/seconds": 1.5}, step=3)
    logger.finalize("success")
    return Path(job.run_dir), logger


def test_csv_writes_a_version_folder(compose) -> None:
    run_dir, _ = _build(compose)
    text = (run_dir / "logs" / "version_0" / "metrics.csv").read_text()
    assert text.splitlines() == ["recovery/seconds,step", "1.5,3"]


def test_tensorboard_writes_event_files(compose) -> None:
    pytest.importorskip("tensorboard")
    run_dir, _ = _build(compose, "logger=tensorboard")
    assert list((run_dir / "tensorboard" / "version_0").glob("events.out.tfevents.*"))


def test_wandb_offline_writes_its_run_in_the_run_dir(compose, monkeypatch) -> None:
    wandb = pytest.importorskip("wandb")
    from ckless_lightning.training.job import _finish_wandb_run

    monkeypatch.setenv("WANDB_SILENT", "true")
    try:
        run_dir, logger = _build(compose, "logger=wandb")
        assert logger.experiment.settings.mode in ("offline", "dryrun")  # dryrun: its internal name
    finally:
        _finish_wandb_run()  # what train_rank does at the end: tiers 3-4's ranks skip atexit
    assert wandb.run is None
    [run] = (run_dir / "wandb").glob("offline-run-*")
    [data] = run.glob("run-*.wandb")
    assert b"recovery/seconds" in data.read_bytes()  # written out by the finish


def test_mlflow_writes_its_database_in_the_run_dir(compose) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    run_dir, logger = _build(compose, "logger=mlflow")
    history = logger.experiment.get_metric_history(logger.run_id, "recovery/seconds")
    assert [(m.step, m.value) for m in history] == [(3, 1.5)]
    assert (run_dir / "mlflow.db").is_file()
