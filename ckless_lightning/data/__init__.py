"""Data pipeline: prepare once (tokenize, pack, cache), then step-addressable per-rank batches.

Rank processes only memory-map the prepared Arrow data (``load_prepared``) and draw
batches that are a pure function of ``(seed, step, dp_rank)`` (``StepBatchLoader``), so a
replacement rank can resume at any step without replaying the pipeline.
"""

from __future__ import annotations

from ckless_lightning.data.config import FORMATS, DataConfig
from ckless_lightning.data.corpus import DefaultCorpus, default_corpus, file_fingerprints
from ckless_lightning.data.loader import StepBatchLoader, epoch_seed
from ckless_lightning.data.packing import FORMAT_VERSION, PreparedData, load_prepared, prepare_dataset
from ckless_lightning.data.tokenizer import EOD_TOKEN, ByteTokenizer, check_vocab

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
