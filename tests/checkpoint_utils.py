"""Read a sharded DCP checkpoint into one flat dict, and compare two bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def load_full_checkpoint(path: Path, scratch: Path) -> dict[str, Any]:
    """Model weights and optimizer state of a DCP checkpoint folder, unsharded, as one nested dict."""
    out = scratch / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        flat: dict[str, Any] = {}
        for key, value in obj.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    if isinstance(obj, (list, tuple)):
        flat = {}
        for i, value in enumerate(obj):
            flat.update(flatten(value, f"{prefix}{i}."))
        return flat
    return {prefix.rstrip("."): obj}


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> int:
    """Every leaf equal: tensors by ``torch.equal`` (same dtype, shape, bits), others by ``==``.

    Returns the number of tensor elements compared.
    """
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys(), f"different keys: {sorted(fa.keys() ^ fb.keys())[:10]}"
    elements = 0
    for key in sorted(fa):
        x, y = fa[key], fb[key]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, key
            assert torch.equal(x, y), f"{key}: max abs diff {(x.double() - y.double()).abs().max().item()}"
            elements += x.numel()
        else:
            assert x == y, f"{key}: {x!r} != {y!r}"
    return elements


def assert_same_run(run: Path, reference: Path, scratch: Path, steps: int) -> None:
    """``run`` ended bitwise equal to ``reference``: every step's loss, final weights and optimizer state."""
    from ckless_lightning.record.loss_log import read_losses
    from ckless_lightning.runtime.checkpointing import checkpoint_name

    losses, expected = read_losses(run / "losses.jsonl"), read_losses(reference / "losses.jsonl")
    assert sorted(expected) == list(range(1, steps + 1))
    assert losses == expected
    final = checkpoint_name(steps)
    assert_bitwise_equal(
        load_full_checkpoint(run / "checkpoints" / final, scratch),
        load_full_checkpoint(reference / "checkpoints" / final, scratch),
    )
