"""A user's train loader, positioned at the committed step: what a resume or a recovery needs.

Lightning saves a loader's ``state_dict`` in every checkpoint (and tier 4 in every step's
snapshot) and hands it back through ``load_state_dict`` on a restore. With torchdata's
``StatefulDataLoader`` that is the ecosystem's resumable loader, except for one thing: Lightning
fetches a batch ahead of the one it trains, so the loader's own state, read after step N, already
counts step N+1's batch, and a restore from it would skip a batch.

:class:`CommittedPositionLoader` wraps the loader: it records the loader's state after each batch
it yields, and ``state_dict`` reports the state after the last batch *trained*
(:meth:`~CommittedPositionLoader.commit_batch`, called by ``DataPositionCallback`` after each
batch). :func:`positioned_loader` is what ``CheckpointlessStrategy.process_dataloader`` applies
to a fit's train loader:

- a ``torch.utils.data.DataLoader`` or a ``StatefulDataLoader`` over a map-style dataset: rebuilt
  as a ``StatefulDataLoader`` with the same dataset, batch size, collate function and workers,
  whose random or sequential sampler becomes a ``DistributedSampler`` over the data-parallel ranks
  (the strategy shards the data: Lightning's ``use_distributed_sampler`` is not needed), then
  wrapped. A shuffled order then depends on the job's seed and the epoch only: Lightning's own
  injection would wrap a ``StatefulDataLoader``'s random sampler, whose order is drawn from the
  global RNG when the loader is built, which differs after a recovery;
- a ``StatefulDataLoader`` over an ``IterableDataset``: wrapped as it is (the dataset's
  ``state_dict`` is its position);
- a loader that keeps its own position (``state_dict`` / ``load_state_dict``, as the built-in
  ``StepBatchLoader``): used as it is;
- anything else has no position to restore, and is refused with an error naming the fix.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ckless_lightning.runtime.contract import UsageTypeError

__all__ = ["CommittedPositionLoader", "positioned_loader"]


class CommittedPositionLoader:
    """``loader`` (a ``StatefulDataLoader``) whose saved state is the one after the last trained batch.

    Call contract: iterate it as the loader; call :meth:`commit_batch` once after each batch has
    been trained, in order. Any other attribute is the wrapped loader's (Lightning reads its
    ``sampler``, ``batch_size``, ``dataset``).
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._yielded: deque[dict[str, Any]] = deque()  # states after yielded, not yet trained batches
        self._committed: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        self._yielded.clear()
        self._committed = self.loader.state_dict()  # nothing trained yet in this pass
        for batch in self.loader:
            self._yielded.append(self.loader.state_dict())
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def commit_batch(self) -> None:
        """The oldest batch yielded and not yet committed has been trained."""
        assert self._yielded, "commit_batch() without a batch yielded"
        self._committed = self._yielded.popleft()

    def state_dict(self) -> dict[str, Any]:
        """The loader's state after the last trained batch (before any: its state now)."""
        return self._committed if self._committed is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        self._yielded.clear()
        self._committed = None

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


def positioned_loader(loader: object, *, rank: int, world_size: int, seed: int) -> object:
    """``loader`` ready to be saved and restored at the committed step, reading data-parallel rank
    ``rank``'s part of ``world_size`` (see the module docstring); raises TypeError for a loader with
    no position. ``seed``: the job's, which orders a shuffled dataset (with the epoch)."""
    if isinstance(loader, CommittedPositionLoader):
        return loader
    if type(loader) is DataLoader or _is_stateful_dataloader(loader):
        return CommittedPositionLoader(_rebuilt(loader, rank=rank, world_size=world_size, seed=seed))
    if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
        return loader  # keeps its own position (the built-in loaders)
    raise UsageTypeError(
        f"the train loader ({type(loader).__module__}.{type(loader).__qualname__}) cannot be positioned: a "
        "resume or a recovery would restart its data from the beginning. Return a "
        "torch.utils.data.DataLoader over a map-style dataset or torchdata's StatefulDataLoader "
        "(from torchdata.stateful_dataloader import StatefulDataLoader) from train_dataloader(), or a "
        "loader with state_dict()/load_state_dict() that saves the position of the last trained batch"
    )


def _is_stateful_dataloader(loader: object) -> bool:
    """Whether ``loader`` is torchdata's ``StatefulDataLoader``, without importing torchdata where no
    loader can be one (the built-in loaders: a spare-born rank imports nothing after its hand-over)."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    return module is not None and isinstance(loader, module.StatefulDataLoader)


def _rebuilt(loader: DataLoader, *, rank: int, world_size: int, seed: int) -> Any:
    """A ``StatefulDataLoader`` over ``loader``'s dataset, batches, collate function and workers that
    reads rank ``rank``'s part: a random or sequential sampler becomes a ``DistributedSampler``
    (shuffled from ``seed`` and the epoch: the same order whenever the loader is built, which a
    random sampler seeded from the global RNG is not); a sampler of the user's own is kept (it must
    give this rank its part, in the same order for the same epoch)."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader import sampler as stateful

    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        if isinstance(loader, StatefulDataLoader):
            return loader  # the dataset's own state_dict() is its position
        raise UsageTypeError(
            f"the train loader's dataset ({type(dataset).__qualname__}) is an IterableDataset, whose "
            "position a DataLoader cannot save: use torchdata's StatefulDataLoader with a dataset that "
            "implements state_dict()/load_state_dict(), or a map-style dataset"
        )
    sampler = loader.sampler
    if loader.batch_sampler is not None and getattr(loader.batch_sampler, "sampler", None) is not None:
        sampler = loader.batch_sampler.sampler  # where Lightning's injection puts it
    if type(sampler).__name__ == "DistributedSamplerWrapper":
        raise UsageTypeError(
            "the train loader's sampler was wrapped by Lightning's DistributedSamplerWrapper, whose "
            "order a recovery cannot repeat: build the Trainer with use_distributed_sampler=False "
            "(CheckpointlessStrategy gives each rank its part itself)"
        )
    if isinstance(sampler, (RandomSampler, stateful.RandomSampler, SequentialSampler)):
        if getattr(sampler, "replacement", False):
            raise UsageTypeError(
                "the train loader samples with replacement (RandomSampler(replacement=True)), which a "
                "DistributedSampler cannot split between ranks: give each rank a sampler of its own"
            )
        sampler = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=not isinstance(sampler, SequentialSampler),
            seed=seed,
        )
    common: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        # Its own generator: a loader without one draws its workers' base seed from torch's global
        # RNG when it starts iterating, which after a resume would shift the module's random draws.
        "generator": loader.generator or torch.Generator().manual_seed(seed * 1_000_003 + rank),
        "prefetch_factor": loader.prefetch_factor if loader.num_workers else None,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if isinstance(loader, StatefulDataLoader):
        common["snapshot_every_n_steps"] = loader.snapshot_every_n_steps
    batches = loader.batch_sampler
    if batches is None:  # batch_size=None: one sample at a time
        return StatefulDataLoader(dataset, batch_size=None, sampler=sampler, **common)
    if type(batches) in (BatchSampler, stateful.BatchSampler):
        batches = stateful.BatchSampler(sampler, batches.batch_size, batches.drop_last)
    return StatefulDataLoader(dataset, batch_sampler=batches, **common)
