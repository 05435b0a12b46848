"""Data pipeline: prepare once (tokenize, pack, cache), then step-addressable per-rank batches.

Rank processes only memory-map the prepared Arrow data (``load_prepared``) and draw
batches that are a pure function of ``(seed, step, dp_rank)`` (``StepBatchLoader``), so a
replacement rank can resume at any step without replaying the pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckless_lightning.data.config import FORMATS, DataConfig
from ckless_lightning.runtime.lazy import lazy_attributes

if TYPE_CHECKING:
    from ckless_lightning.data.corpus import DefaultCorpus, default_corpus, file_fingerprints
    from ckless_lightning.data.loader import StepBatchLoader, epoch_seed
    from ckless_lightning.data.packing import FORMAT_VERSION, PreparedData, load_prepared, prepare_dataset
    from ckless_lightning.data.tokenizer import EOD_TOKEN, ByteTokenizer, check_vocab

# Loaded on first use: the loader imports torch, packing pyarrow and numpy; ``DataConfig`` is what
# launch.py needs to validate a config (before it imports torch).
_LAZY = {
    "DefaultCorpus": "corpus",
    "default_corpus": "corpus",
    "file_fingerprints": "corpus",
    "StepBatchLoader": "loader",
    "epoch_seed": "loader",
    "FORMAT_VERSION": "packing",
    "PreparedData": "packing",
    "load_prepared": "packing",
    "prepare_dataset": "packing",
    "EOD_TOKEN": "tokenizer",
    "ByteTokenizer": "tokenizer",
    "check_vocab": "tokenizer",
}
__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "EOD_TOKEN",
    "FORMATS",
    "FORMAT_VERSION",
    "ByteTokenizer",
    "DataConfig",
    "DefaultCorpus",
    "PreparedData",
    "StepBatchLoader",
    "check_vocab",
    "default_corpus",
    "epoch_seed",
    "file_fingerprints",
    "load_prepared",
    "prepare_dataset",
]
