"""Turn a source into packed, cached token rows that every rank can memory-map.

``prepare_dataset`` runs once (on the launcher or rank 0): it tokenizes, packs the token
stream into rows of ``seq_len + 1`` ids (model input plus the shifted target) and saves
them as Arrow under ``cache_dir/<key>``. Rank processes call ``load_prepared`` on that
path and never tokenize. Row ``i`` carries ``sample_id == i``, so a sample id names the
same tokens for as long as the cache key is unchanged.

Text is tokenized by ``data.tokenizer`` (a local Hugging Face tokenizer,
:mod:`~ckless_lightning.data.hf_tokenizer`; by default the byte tokenizer) and every
document is followed by its end-of-text id (the byte tokenizer's ``EOD_TOKEN``, 0) before
the documents are concatenated. Pre-tokenized rows (``format=tokenized``) are concatenated as
they are: their producer knows its own end-of-document id and must have appended it.
The stream is cut into whole rows and the tail shorter than one row is dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ckless_lightning.data.config import DataConfig
from ckless_lightning.data.corpus import file_fingerprints
from ckless_lightning.data.hf_tokenizer import load_tokenizer
from ckless_lightning.data.source import Source, resolve_source

if TYPE_CHECKING:
    # ``datasets`` (with pandas) is imported where it is used: a launcher whose data is cached
    # (every job after the first) does not need it.
    from datasets import Dataset

__all__ = ["FORMAT_VERSION", "PreparedData", "load_prepared", "prepare_dataset"]

log = logging.getLogger(__name__)

#: Bump when the packed layout or the packing rule changes; it is part of the cache key.
FORMAT_VERSION = 1
_META_FILE = "ckless_prepared.json"
_BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet"}
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class PreparedData:
    """Where the packed rows are and how many: hand ``path`` to the ranks' ``load_prepared``.

    ``num_tokens`` counts the whole token stream (separators included) before the tail was
    dropped; the rows hold ``num_samples * (seq_len + 1)`` of them.
    """

    path: Path
    num_samples: int
    num_tokens: int
    key: str
    seq_len: int
    from_cache: bool = False


def _cache_key(cfg: DataConfig, src: Source, tokenizer_name: str) -> str:
    """Hash of everything that changes the packed rows: input files, format, tokenizer and packing rule."""
    tokenized = src.format == "tokenized"
    parts = {
        "format_version": FORMAT_VERSION,
        "format": src.format,
        "text_column": None if tokenized else cfg.text_column,
        "seq_len": cfg.seq_len,
        "tokenizer": "pretokenized" if tokenized else tokenizer_name,
        "files": file_fingerprints(src.files),
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return f"{src.format}-L{cfg.seq_len}-{digest[:20]}"


def _tokenize(cfg: DataConfig, src: Source, work: Path, key: str, tokenizer: Any) -> Dataset:
    """One row per document with an ``input_ids`` id list (text sources end each with EOD)."""
    from datasets import Features, LargeList, Value, load_dataset

    num_proc = cfg.num_proc if cfg.num_proc > 1 else None
    kwargs = {"sample_by": "document", "encoding_errors": "replace"} if src.format == "text" else {}
    text_column = "text" if src.format == "text" else cfg.text_column
    ds = load_dataset(
        _BUILDERS[src.format],
        data_files=[str(f) for f in src.files],
        split="train",
        cache_dir=str(work / "hf"),
        num_proc=num_proc,
        **kwargs,
    )
    if text_column not in ds.column_names:
        raise ValueError(
            f"data.text_column={cfg.text_column!r} is not a column of data.source={src.label!r}; "
            f"columns found: {', '.join(ds.column_names)}. Set data.text_column to one of them."
        )
    feature = ds.features[text_column]
    if not (isinstance(feature, Value) and feature.dtype in ("string", "large_string")):
        raise ValueError(
            f"data.text_column={cfg.text_column!r} of data.source={src.label!r} holds {feature}, "
            "not strings; "
            "point data.text_column at a text column."
        )
    return (
        ds.select_columns([text_column])
        .with_format("arrow")
        .map(
            lambda batch: pa.table({"input_ids": tokenizer.encode_documents(batch[text_column])}),
            batched=True,
            batch_size=256,
            writer_batch_size=256,
            remove_columns=[text_column],
            features=Features({"input_ids": LargeList(Value("int32"))}),
            cache_file_name=str(work / "tokens.arrow"),
            new_fingerprint=f"{key}-tokens",
            num_proc=num_proc,
            desc="Tokenizing",
        )
    )


def _load_tokenized(src: Source) -> Dataset:
    """The ``input_ids`` column of a saved dataset, checked to hold non-negative int32-range ids."""
    from datasets import DatasetDict, load_from_disk

    assert src.directory is not None
    ds = load_from_disk(str(src.directory))
    if isinstance(ds, DatasetDict):
        if "train" not in ds:
            raise ValueError(
                f"data.source={src.label!r} is a DatasetDict without a 'train' split (has {', '.join(ds)}); "
                "point data.source at the split's directory."
            )
        ds = ds["train"]
    if "input_ids" not in ds.column_names:
        raise ValueError(
            f"data.source={src.label!r} (format tokenized) has no 'input_ids' column; "
            f"columns found: {', '.join(ds.column_names)}."
        )
    column = ds.with_format("arrow")[:]["input_ids"]
    kind = column.type
    if not (
        (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))
        and pa.types.is_integer(kind.value_type)
    ):
        raise ValueError(f"data.source={src.label!r}: 'input_ids' must hold lists of integers, found {kind}.")
    for chunk in column.chunks:
        bounds = pc.min_max(chunk.flatten())
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        if low is not None and (low < 0 or high > _INT32_MAX):
            raise ValueError(
                f"data.source={src.label!r}: token ids must lie in [0, {_INT32_MAX}], found [{low}, {high}]."
            )
    return ds.select_columns(["input_ids"])


class _Packer:
    """Batched map over packed-row ids: row ``i`` is tokens ``[i*L, (i+1)*L)`` of the stream.

    Stateless per batch (rows are located through the document offsets), so it gives the
    same rows with any ``num_proc`` and batch size.
    """

    def __init__(self, documents: Dataset, doc_offsets: np.ndarray, row_len: int) -> None:
        self.documents = documents.with_format("arrow", columns=["input_ids"])
        self.doc_offsets = doc_offsets
        self.row_len = row_len

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch["sample_id"].to_numpy()
        first, last = int(ids[0]), int(ids[-1])
        assert last - first + 1 == len(ids), "map batches must be contiguous row ranges"
        start, end = first * self.row_len, (last + 1) * self.row_len
        d0 = int(np.searchsorted(self.doc_offsets, start, side="right")) - 1
        d1 = int(np.searchsorted(self.doc_offsets, end, side="left"))
        chunks = self.documents[d0:d1]["input_ids"].chunks
        flat = pa.concat_arrays([c.flatten().cast(pa.int32()) for c in chunks] or [pa.array([], pa.int32())])
        base = int(self.doc_offsets[d0])
        window = flat.slice(start - base, end - start)
        assert len(window) == end - start, "packed row runs past the token stream"
        rows = pa.FixedSizeListArray.from_arrays(window, self.row_len)
        return pa.table({"sample_id": batch["sample_id"], "input_ids": rows})


def _read_meta(path: Path) -> dict | None:
    meta = path / _META_FILE
    return json.loads(meta.read_text()) if meta.is_file() else None


def prepare_dataset(cfg: DataConfig) -> PreparedData:
    """Tokenize and pack ``cfg``'s source once; later calls with unchanged inputs reuse the cache.

    The build happens in a temporary directory that is renamed into place only when
    complete, so a killed prepare never leaves a half cache and concurrent prepares of the
    same key are safe (the loser discards its copy). Raises ``FileNotFoundError`` or
    ``ValueError`` naming the ``data.*`` key to fix.
    """
    started = time.monotonic()
    src = resolve_source(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer) if src.format != "tokenized" else None
    key = _cache_key(cfg, src, tokenizer.name if tokenizer is not None else "pretokenized")
    root = Path(os.path.expanduser(cfg.cache_dir)).resolve()
    final = root / key
    meta = _read_meta(final)
    if meta is not None:
        log.info("data: using cached %s (%d samples)", final, meta["num_samples"])
        return PreparedData(final, meta["num_samples"], meta["num_tokens"], key, cfg.seq_len, from_cache=True)

    from datasets import Dataset, Features, List, Value

    root.mkdir(parents=True, exist_ok=True)
    work = root / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        documents = _load_tokenized(src) if tokenizer is None else _tokenize(cfg, src, work, key, tokenizer)
        lengths = pc.fill_null(pc.list_value_length(documents.with_format("arrow")[:]["input_ids"]), 0)
        doc_offsets = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum(lengths.to_numpy(), out=doc_offsets[1:])
        num_tokens = int(doc_offsets[-1])
        row_len = cfg.seq_len + 1
        num_samples = num_tokens // row_len
        if num_samples == 0:
            raise ValueError(
                f"data.source={src.label!r} yields {num_tokens} tokens, fewer than one row of "
                f"data.seq_len + 1 = {row_len}; lower data.seq_len or add data."
            )
        packed = (
            Dataset.from_dict({"sample_id": np.arange(num_samples, dtype=np.int64)})
            .with_format("arrow")
            .map(
                _Packer(documents, doc_offsets, row_len),
                batched=True,
                batch_size=1024,
                remove_columns=["sample_id"],
                features=Features(
                    {"sample_id": Value("int64"), "input_ids": List(Value("int32"), length=row_len)}
                ),
                cache_file_name=str(work / "packed.arrow"),
                new_fingerprint=f"{key}-packed",
                num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                desc="Packing",
            )
        )
        out = work / "out"
        packed.with_format(None).save_to_disk(str(out))
        meta = {
            "key": key,
            "format_version": FORMAT_VERSION,
            "format": src.format,
            "source": src.label,
            "seq_len": cfg.seq_len,
            "num_samples": num_samples,
            "num_tokens": num_tokens,
            "num_documents": len(documents),
        }
        (out / _META_FILE).write_text(json.dumps(meta, indent=1))
        try:
            os.rename(out, final)
        except OSError as err:
            if _read_meta(final) is None:
                raise FileExistsError(
                    f"{final} exists but is not a complete prepared dataset; delete it and prepare again."
                ) from err
            log.info("data: another process prepared %s first; using it", final)
            return PreparedData(final, num_samples, num_tokens, key, cfg.seq_len, from_cache=True)
    finally:
        shutil.rmtree(work)
    log.info(
        "data: prepared %d samples (%d tokens, %d documents) in %.1fs at %s",
        num_samples, num_tokens, len(documents), time.monotonic() - started, final,
    )  # fmt: skip
    return PreparedData(final, num_samples, num_tokens, key, cfg.seq_len)


def load_prepared(path: str | Path) -> Dataset:
    """Memory-map a prepared dataset for a rank; ``input_ids`` and ``sample_id`` come out as tensors."""
    from datasets import Dataset, load_from_disk

    path = Path(path)
    if _read_meta(path) is None:
        raise FileNotFoundError(f"{path} is not a prepared dataset (no {_META_FILE}); run prepare_dataset.")
    ds = load_from_disk(str(path), keep_in_memory=False)
    assert isinstance(ds, Dataset), f"{path} holds a {type(ds).__name__}, expected a Dataset"
    ds.set_format("torch", columns=["input_ids", "sample_id"])
    return ds
