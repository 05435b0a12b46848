"""Per-rank batches that are a pure function of (seed, step, dp rank): resumable from a step number.

Checkpointless recovery restarts a rank at an arbitrary step without replaying the data
pipeline, so nothing about the next batch may depend on iteration history. A "step" here
is the loader's batch index: one micro-batch per rank per step, ``accumulate`` loader steps
per optimizer step.

The rule, by global sample index: optimizer step ``n`` takes the samples at positions
``[n * B, (n + 1) * B)`` of the sample stream, ``B = micro_batch_size * dp_size * accumulate``
(the global batch); the stream is epoch after epoch of a seeded random permutation of the
whole dataset, ``num_samples // B`` optimizer steps per epoch (the remainder is skipped each
epoch). Within its step, micro-batch ``k`` of dp rank ``r`` is the ``micro_batch_size`` chunk
at offset ``k * micro_batch_size * dp_size + r * micro_batch_size``. No sample repeats within
an epoch, the union over ranks and micro-batches of one optimizer step is exactly that step's
slice, and that slice does not depend on the data-parallel width: an elastic job that trains
a step at another width (``accumulate`` changed with it) reads the same samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count
from typing import Any

import torch

__all__ = ["StepBatchLoader", "epoch_seed"]

_MASK64 = (1 << 64) - 1


def epoch_seed(seed: int, epoch: int) -> int:
    """Generator seed of an epoch's permutation: splitmix64 of ``(seed, epoch)``.

    Mixed rather than ``seed + epoch`` so that seed 1 epoch 1 and seed 2 epoch 0 differ.
    Stable across runs and machines; the permutation itself is ``torch.randperm``'s.
    """
    z = (seed * 0x9E3779B97F4A7C15 + epoch + 1) & _MASK64
    for _ in range(2):
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z >> 1  # 63 bits: fits every manual_seed implementation


class StepBatchLoader:
    """The training iterable of one dp rank; yields ``{"input_ids", "sample_ids", "step"}`` dicts.

    ``input_ids`` is a ``LongTensor[micro_batch_size, seq_len + 1]``, ``sample_ids`` a
    ``LongTensor[micro_batch_size]`` read from the dataset's ``sample_id`` column.
    ``dataset`` is what :func:`~ckless_lightning.data.load_prepared` returns (anything with
    ``len`` and list indexing to those two columns works).

    Position contract: ``__iter__`` starts at ``start_step`` (constructor,
    ``set_start_step`` or ``load_state_dict``) and stops before ``max_steps`` (never, if
    ``None``). Lightning prefetches a batch ahead, so how many batches were *yielded* is not
    how many were *trained on*: the training module owns the committed position and stores
    it in ``position`` (via ``set_position``) after each optimizer step. ``state_dict()``
    reports ``next_step = position`` when it was set since the current iteration began, and
    otherwise the yield count (the step after the last yielded batch, or the start step).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        start_step: int = 0,
        max_steps: int | None = None,
        num_samples: int | None = None,
        accumulate: int = 1,
        elastic: bool = False,
    ) -> None:
        if accumulate < 1:
            raise ValueError(f"accumulate={accumulate} (micro-batches per optimizer step) must be >= 1.")
        if micro_batch_size < 1:
            raise ValueError(f"data.micro_batch_size={micro_batch_size} must be positive.")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size}).")
        if max_steps is not None and max_steps < 0:
            raise ValueError(f"max_steps={max_steps} must be non-negative or None.")
        self.dataset = dataset
        self.seed = int(seed)
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.max_steps = max_steps
        # A subclass that serves batches from elsewhere (the tier-2 batch cache) passes
        # ``num_samples`` and no dataset; the epoch arithmetic stays the same.
        self.num_samples = len(dataset) if num_samples is None else num_samples
        self.accumulate = accumulate
        self.elastic = elastic  # load_state_dict accepts a state saved at another dp width
        self.global_batch_size = micro_batch_size * dp_size * accumulate  # samples per optimizer step
        optimizer_steps = self.num_samples // self.global_batch_size
        if optimizer_steps == 0:
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch of "
                f"data.micro_batch_size * world size * accumulation = {micro_batch_size} * {dp_size} * "
                f"{accumulate} = {self.global_batch_size}; "
                "lower trainer.global_batch_size or data.micro_batch_size, or add data."
            )
        self.steps_per_epoch = optimizer_steps * accumulate  # loader steps
        self._start_step = self._check_step(start_step)
        self._yield_next = self._start_step
        #: Committed next step, owned by the training module; ``None`` until it sets one.
        self.position: int | None = None
        # The last epoch's permutation, as one (epoch, permutation) pair: replaced in one assignment,
        # so a thread never reads one epoch's number with another's permutation.
        self._perm: tuple[int, torch.Tensor] = (-1, torch.empty(0, dtype=torch.long))

    @staticmethod
    def _check_step(step: int) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"loader step {step!r} must be a non-negative integer.")
        return step

    def _permutation(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s sample order (safe to call from several threads: each gets its epoch's)."""
        cached_epoch, perm = self._perm
        if cached_epoch != epoch:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            perm = torch.randperm(self.num_samples, generator=generator)
            self._perm = (epoch, perm)
        return perm

    def sample_indices(self, step: int, dp_rank: int | None = None) -> list[int]:
        """Dataset row indices of ``dp_rank``'s micro-batch at ``step`` (default: this rank)."""
        rank = self.dp_rank if dp_rank is None else dp_rank
        assert 0 <= rank < self.dp_size, f"dp_rank {rank} outside [0, {self.dp_size})"
        optimizer_step, micro = divmod(self._check_step(step), self.accumulate)
        epoch, within = divmod(optimizer_step, self.steps_per_epoch // self.accumulate)
        begin = (
            within * self.global_batch_size
            + micro * self.micro_batch_size * self.dp_size
            + rank * self.micro_batch_size
        )
        return self._permutation(epoch)[begin : begin + self.micro_batch_size].tolist()

    def batch(self, step: int) -> dict[str, Any]:
        """This rank's batch at ``step``; what ``__iter__`` yields for it."""
        rows = self.dataset[self.sample_indices(step)]
        return {
            "input_ids": torch.as_tensor(rows["input_ids"], dtype=torch.long),
            "sample_ids": torch.as_tensor(rows["sample_id"], dtype=torch.long),
            "step": step,
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # Reset eagerly (not inside the generator) so a set_position right after iter() sticks.
        start = self._start_step
        self._yield_next = start
        self.position = None
        return self._generate(start)

    def _generate(self, start: int) -> Iterator[dict[str, Any]]:
        steps = count(start) if self.max_steps is None else range(start, self.max_steps)
        for step in steps:
            item = self.batch(step)
            self._yield_next = step + 1
            yield item

    def __len__(self) -> int:
        """``max_steps``, counted from step 0 (Lightning counts restored batches towards it)."""
        if self.max_steps is None:
            raise TypeError("StepBatchLoader without max_steps is infinite and has no length")
        return self.max_steps

    def set_position(self, step: int) -> None:
        """Record the committed next step (call after each optimizer step); ``state_dict`` reports it."""
        self.position = self._check_step(step)

    def set_start_step(self, step: int) -> None:
        """Start the next ``__iter__`` at ``step``; also makes it the committed position."""
        self._start_step = self._check_step(step)
        self._yield_next = self._start_step
        self.position = self._start_step

    def state_dict(self) -> dict[str, int]:
        """Lightning's resumable-loader hook; see the class docstring for ``next_step``."""
        next_step = self.position if self.position is not None else self._yield_next
        return {
            "next_step": next_step,
            "seed": self.seed,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "accumulate": self.accumulate,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume at ``state_dict["next_step"]`` on the next ``__iter__``; the sample order must match."""
        for key in ("next_step", "seed", "dp_size"):
            if key not in state_dict:
                raise ValueError(f"loader state is missing {key!r}; it has {sorted(state_dict)}.")
        if state_dict["seed"] != self.seed:
            raise ValueError(
                f"loader state was saved with data.seed={state_dict['seed']}, this run uses {self.seed}: "
                "resuming would read a different sample order. Set data.seed back or start a fresh run."
            )
        next_step = int(state_dict["next_step"])
        if state_dict["dp_size"] != self.dp_size:
            next_step = self._rescaled(state_dict)
        self.set_start_step(next_step)
        self.position = None

    def _rescaled(self, state_dict: dict[str, int]) -> int:
        """An elastic job's state saved at another dp width: the same optimizer step at this one."""
        saved_dp, saved_accumulate = int(state_dict["dp_size"]), int(state_dict.get("accumulate", 1))
        saved_batch = self.micro_batch_size * saved_dp * saved_accumulate
        if not self.elastic or saved_batch != self.global_batch_size:
            raise ValueError(
                f"loader state was saved with {saved_dp} data-parallel ranks x {saved_accumulate} "
                f"micro-batches, this run has {self.dp_size} x {self.accumulate}: the global batch and "
                "sample order differ. Resume with the same world size (or, elastic.enabled, the same "
                "trainer.global_batch_size) or start a fresh run."
            )
        optimizer_step, micro = divmod(int(state_dict["next_step"]), saved_accumulate)
        if micro:
            raise ValueError(
                f"loader state at micro-batch {micro} of optimizer step {optimizer_step + 1} cannot move "
                "to another data-parallel width: only a state saved between optimizer steps can"
            )
        return optimizer_step * self.accumulate
