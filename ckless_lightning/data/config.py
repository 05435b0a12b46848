"""Data configuration: what to read, how to pack it and where to cache it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FORMATS", "DataConfig"]

#: Accepted values of ``data.format``; ``auto`` picks one of the others from the source.
FORMATS = ("auto", "text", "jsonl", "parquet", "tokenized")


@dataclass
class DataConfig:
    """Where the training tokens come from and how they are packed.

    ``source`` is ``None`` for the built-in corpus (the running Python's standard library,
    no download), else a file, a directory of files or a glob. ``format="auto"`` decides by
    file extension (a ``save_to_disk`` directory is ``tokenized``). Whether ``source`` exists
    is checked by :func:`~ckless_lightning.data.prepare_dataset`, not here, so a config can be
    built on a machine that does not hold the data. ``max_source_bytes`` caps how much of the
    built-in corpus is read (for fast smoke runs); with a ``source`` it is ignored (set to None: a
    recipe's cap does not stop ``data.source=`` on the command line).
    """

    source: str | None = None
    format: str = "auto"
    text_column: str = "text"
    seq_len: int = 128
    micro_batch_size: int = 4
    cache_dir: str = "~/.cache/ckless_lightning/data"
    seed: int = 1234
    max_source_bytes: int | None = None
    num_proc: int = 1
    # Tier 2: a per-node batch cache in shared memory, filled ahead by one reader per node.
    mmap_cache: bool = False
    mmap_cache_base: str = "/dev/shm"
    prefetch: int = 8  # loader steps the reader keeps ready ahead of the slowest rank
    lookback: int = 4  # loader steps kept behind it, for replays after a rollback
    # A reader that leaves a step a rank waits for unbuilt this long (running, not dead or stopped:
    # those are found at once) is taken for wedged: the agent kills and restarts it.
    reader_timeout_s: float = 30.0
    record_samples: bool = False  # write each rank's sample ids per step to <run_dir>/samples/
    # A local Hugging Face tokenizer (tokenizer.json, or a model directory); None: the byte tokenizer.
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r} is not supported; use one of {', '.join(FORMATS)}")
        if self.source is not None and not str(self.source).strip():
            raise ValueError("data.source is empty; set a path or glob, or null for the built-in corpus.")
        if self.source is None and self.format not in ("auto", "text"):
            raise ValueError(
                f"data.format={self.format!r} needs data.source (the built-in corpus is plain text); "
                "set data.source to your data or data.format to auto."
            )
        if not self.text_column:
            raise ValueError("data.text_column is empty; set it to the name of the column holding the text.")
        for key in ("seq_len", "micro_batch_size", "num_proc", "prefetch"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{key}={value!r} must be a positive integer.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"data.seed={self.seed!r} must be a non-negative integer.")
        if self.max_source_bytes is not None:
            if isinstance(self.max_source_bytes, bool) or not isinstance(self.max_source_bytes, int):
                raise ValueError(f"data.max_source_bytes={self.max_source_bytes!r} must be an int or null.")
            if self.max_source_bytes < 1:
                raise ValueError(
                    f"data.max_source_bytes={self.max_source_bytes} must be positive; use null for no cap."
                )
            if self.source is not None:  # a recipe's cap of the built-in corpus: not for your data
                self.max_source_bytes = None
        if isinstance(self.lookback, bool) or not isinstance(self.lookback, int) or self.lookback < 0:
            raise ValueError(f"data.lookback={self.lookback!r} must be a non-negative integer.")
        if not self.reader_timeout_s > 0:
            raise ValueError(f"data.reader_timeout_s={self.reader_timeout_s!r} must be > 0 (seconds).")
        if self.tokenizer is not None and (not str(self.tokenizer).strip() or self.format == "tokenized"):
            raise ValueError(
                f"data.tokenizer={self.tokenizer!r}: set it to a local tokenizer.json or model directory "
                "for text sources, or null (pre-tokenized data, data.format=tokenized, needs none)"
            )
        if not self.cache_dir:
            raise ValueError("data.cache_dir is empty; set it to a writable directory.")
