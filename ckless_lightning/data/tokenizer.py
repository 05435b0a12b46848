"""Byte-level tokenizer: needs no vocabulary file, so the built-in corpus works offline.

Full-size recipes should feed pre-tokenized data (``data.format=tokenized``) produced by
their real tokenizer; the byte tokenizer is for smoke runs and tests. Either way the
model's embedding must cover the tokenizer's ids: the caller checks that with
:func:`check_vocab` before building the model.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["EOD_TOKEN", "ByteTokenizer", "check_vocab"]

#: End-of-document separator inserted after every document when packing text.
#: It is byte 0 (NUL), which real text practically never contains.
EOD_TOKEN = 0


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256); ``decode`` replaces invalid sequences."""

    name = "byte-utf8-v1"
    vocab_size = 256
    eod_token = EOD_TOKEN

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; a cut multi-byte character decodes to U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_documents(self, texts: pa.Array | pa.ChunkedArray) -> pa.LargeListArray:
        """Encode an Arrow string column, one ``int32`` id list per row, each ending with ``EOD_TOKEN``.

        Vectorized (Arrow strings are already UTF-8, so their bytes are the ids); a null
        row becomes an empty document (just the separator).
        """
        if isinstance(texts, pa.ChunkedArray):
            texts = texts.combine_chunks() if texts.num_chunks else pa.array([], pa.large_string())
        binary = pc.fill_null(texts, "").cast(pa.large_binary())
        _, offsets_buf, data_buf = binary.buffers()
        n = len(binary)
        offsets = np.frombuffer(offsets_buf, dtype=np.int64)[binary.offset : binary.offset + n + 1]
        lengths = np.diff(offsets)
        raw = (
            np.frombuffer(data_buf, dtype=np.uint8)[offsets[0] : offsets[-1]]
            if data_buf is not None
            else np.empty(0, np.uint8)
        )
        out_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths + 1, out=out_offsets[1:])
        values = np.full(int(out_offsets[-1]), EOD_TOKEN, dtype=np.int32)
        # Byte j of document i lands at its source position shifted by the i separators before it.
        values[np.arange(raw.size, dtype=np.int64) + np.repeat(np.arange(n, dtype=np.int64), lengths)] = raw
        return pa.LargeListArray.from_arrays(pa.array(out_offsets), pa.array(values))


def check_vocab(tokenizer_vocab: int, model_vocab: int) -> None:
    """Raise if the model's embedding cannot hold every id the tokenizer emits."""
    if model_vocab < tokenizer_vocab:
        raise ValueError(
            f"model.vocab_size={model_vocab} is smaller than the tokenizer's vocabulary ({tokenizer_vocab}); "
            f"set model.vocab_size >= {tokenizer_vocab}."
        )
