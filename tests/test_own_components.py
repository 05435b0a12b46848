"""The pieces that let a user's own module and data in: the ``module`` / ``datamodule`` config
entries, the train loader positioned at the committed batch, and the unsharded-module trap."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ckless_lightning.data.positioned_loader import CommittedPositionLoader, positioned_loader
from ckless_lightning.runtime.component_config import BUILTIN_MODULE, ComponentConfig
from ckless_lightning.runtime.config import job_config_from_dict
from ckless_lightning.training.strategy import _check_sharded

warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated")
DATA = TensorDataset(torch.arange(60))


class _Module(pl.LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)


def _train(loader: CommittedPositionLoader, batches: int) -> tuple[list[list[int]], list[list[int]]]:
    """Iterate as Lightning does (one batch fetched ahead), committing ``batches`` batches; returns
    (the trained batches, the rest of the pass)."""
    it = iter(loader)
    trained, batch = [], next(it)
    for _ in range(batches):
        ahead = next(it)
        loader.commit_batch()
        trained.append(batch[0].tolist())
        batch = ahead
    return trained, [batch[0].tolist()] + [b[0].tolist() for b in it]


@pytest.mark.parametrize("make", [DataLoader, StatefulDataLoader], ids=["DataLoader", "StatefulDataLoader"])
def test_a_restored_loader_goes_on_after_the_last_trained_batch(make):
    def build(global_seed: int) -> CommittedPositionLoader:
        torch.manual_seed(global_seed)  # the global RNG differs after a recovery: the order must not
        loader = positioned_loader(make(DATA, batch_size=3, shuffle=True), rank=1, world_size=2, seed=7)
        assert isinstance(loader, CommittedPositionLoader)
        return loader

    first = build(0)
    trained, rest = _train(first, 4)
    saved = first.state_dict()
    again = build(123)
    again.load_state_dict(saved)
    assert [b[0].tolist() for b in again] == rest
    # and the whole pass, from the start, is the same order whatever the global RNG
    assert [b[0].tolist() for b in build(5)] == trained + rest


def test_each_rank_reads_its_own_part():
    parts = [
        {
            i
            for b in positioned_loader(
                DataLoader(DATA, batch_size=4, shuffle=True), rank=r, world_size=3, seed=1
            )
            for i in b[0].tolist()
        }
        for r in range(3)
    ]
    assert set().union(*parts) == set(range(60)) and sum(map(len, parts)) == 60


def test_loaders_without_a_position_are_refused_with_the_fix():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(5))

    with pytest.raises(TypeError, match="StatefulDataLoader"):
        positioned_loader(DataLoader(Stream(), batch_size=2), rank=0, world_size=1, seed=0)
    with pytest.raises(TypeError, match="cannot be positioned"):
        positioned_loader([torch.zeros(2)], rank=0, world_size=1, seed=0)
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import RandomSampler

    injected = DistributedSamplerWrapper(RandomSampler(DATA), num_replicas=2, rank=0)  # Lightning's default
    with pytest.raises(TypeError, match="use_distributed_sampler=False"):
        positioned_loader(DataLoader(DATA, batch_size=2, sampler=injected), rank=0, world_size=2, seed=0)
    own = StatefulDataLoader(Stream(), batch_size=2)  # its dataset's state is its position
    assert isinstance(positioned_loader(own, rank=0, world_size=1, seed=0), CommittedPositionLoader)


def test_module_and_datamodule_entries(compose):
    job = job_config_from_dict(compose())
    assert job.module.builtin and job.datamodule.builtin and job.data.mmap_cache
    mod = f"{__name__}._Module"
    job = job_config_from_dict(
        compose(f"module._target_={mod}", "+module.width=8", "datamodule._target_=own_module.RegressionData")
    )
    assert job.module.to_mapping() == {"_target_": mod, "width": 8}
    assert not job.data.mmap_cache  # the batch cache serves the built-in pipeline only
    job.module.check()


def test_bad_module_entries_name_the_key_and_the_fix(compose):
    with pytest.raises(ValueError, match=r"module\._target_=no_such\.Module cannot be imported.*PYTHONPATH"):
        ComponentConfig("module", "no_such.Module").check()
    with pytest.raises(ValueError, match=r"not a lightning\.pytorch\.LightningModule subclass"):
        ComponentConfig("module", "torch.nn.Linear").check()
    with pytest.raises(ValueError, match=r"module: .*_Module\(depth=...\) does not fit.*width"):
        ComponentConfig("module", f"{__name__}._Module", {"depth": 3}).check()
    with pytest.raises(ValueError, match="takes its arguments from model, optim and fsdp"):
        ComponentConfig("module", BUILTIN_MODULE, {"hidden": 3})
    with pytest.raises(ValueError, match="model is missing"):
        job_config_from_dict({**compose(), "model": None})
    with pytest.raises(ValueError, match=r"data\.record_samples=true needs the built-in data pipeline"):
        job_config_from_dict(compose("datamodule._target_=x.Y", "data.record_samples=true"))


def test_unsharded_parameters_on_several_ranks_are_an_error_naming_fully_shard():
    with pytest.raises(ValueError, match=r"'layer.weight' and 1 more is not sharded.*fully_shard"):
        _check_sharded(_Module(), world_size=2)
    _check_sharded(_Module(), world_size=1)  # one rank: nothing to shard
