"""The user's Hugging Face tokenizer (``data.tokenizer``), read from local files only.

``data.tokenizer`` is a path:

- a ``tokenizer.json`` file, or a directory holding one (a model directory usually does): read by
  the ``tokenizers`` library (a dependency of this project);
- a model directory without ``tokenizer.json`` (a SentencePiece ``tokenizer.model`` ...): read by
  ``transformers.AutoTokenizer`` with ``local_files_only=True`` (``pip install transformers``).

Nothing is fetched at run time. Every document is followed by the tokenizer's end-of-text token
(the first of :data:`EOD_NAMES` it has), as the byte tokenizer follows each with ``EOD_TOKEN``.
The tokenizer's name in the data cache key is a digest of its files, so another tokenizer never
reads a cache the first one wrote. ``launch.py`` loads it before any rank starts and checks its
vocabulary against ``model.vocab_size`` (:func:`~ckless_lightning.data.tokenizer.check_vocab`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["EOD_NAMES", "HFTokenizer", "load_tokenizer"]

#: End-of-text tokens looked up, in order (Llama 3, GPT-2 style, SentencePiece, Gemma).
EOD_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


class HFTokenizer:
    """Encodes documents with a local Hugging Face tokenizer; ``name``, ``vocab_size`` and
    ``eod_token`` as :class:`~ckless_lightning.data.tokenizer.ByteTokenizer` has them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise FileNotFoundError(
                f"data.tokenizer={str(path)!r} does not exist; point it at a tokenizer.json or a local "
                "model directory (nothing is downloaded)"
            )
        file = self.path if self.path.is_file() else self.path / "tokenizer.json"
        if file.is_file():
            from tokenizers import Tokenizer

            self._fast: Any = Tokenizer.from_file(str(file))
            self._auto: Any = None
            self.vocab_size = int(self._fast.get_vocab_size(with_added_tokens=True))
            vocab = self._fast.get_vocab(with_added_tokens=True)
            files = [file]
        else:
            self._fast, self._auto = None, _auto_tokenizer(self.path)
            self.vocab_size = len(self._auto)
            vocab = self._auto.get_vocab()
            files = [self.path / name for name in _FILES if (self.path / name).is_file()]
        eod = next((vocab[name] for name in EOD_NAMES if name in vocab), None)
        if eod is None:
            raise ValueError(
                f"data.tokenizer={str(path)!r} has none of the end-of-text tokens {', '.join(EOD_NAMES)}, "
                "which separate documents; add one to the tokenizer (a special token)"
            )
        self.eod_token = int(eod)
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
        self.name = f"hf-{digest.hexdigest()[:20]}"

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=False).ids)
        return list(self._auto(text, add_special_tokens=False)["input_ids"])

    def encode_documents(self, texts: pa.Array | pa.ChunkedArray) -> pa.LargeListArray:
        """One ``int32`` id list per row, each ending with ``eod_token``; a null row is empty."""
        strings = [t if t is not None else "" for t in texts.to_pylist()]
        if self._fast is not None:
            ids = [e.ids for e in self._fast.encode_batch(strings, add_special_tokens=False)]
        else:
            ids = self._auto(strings, add_special_tokens=False)["input_ids"]
        lengths = np.fromiter((len(i) + 1 for i in ids), dtype=np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.full(int(offsets[-1]), self.eod_token, dtype=np.int32)
        for start, row in zip(offsets[:-1], ids, strict=True):
            values[start : start + len(row)] = row
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def _auto_tokenizer(directory: Path) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ValueError(
            f"data.tokenizer={str(directory)!r} has no tokenizer.json; reading it needs transformers "
            "(pip install transformers), or point data.tokenizer at a tokenizer.json"
        ) from err
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def load_tokenizer(path: str | Path | None) -> Any:
    """``data.tokenizer``'s tokenizer, or the byte tokenizer for None."""
    if path is None:
        from ckless_lightning.data.tokenizer import ByteTokenizer

        return ByteTokenizer()
    return HFTokenizer(path)
