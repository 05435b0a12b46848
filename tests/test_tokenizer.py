"""``data.tokenizer``: the user's Hugging Face tokenizer, from local files, checked before ranks start.

The tokenizer is a small byte-level BPE trained inside the test on the built-in corpus (nothing is
downloaded), saved as ``tokenizer.json``.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from conftest import launch_job

from ckless_lightning.data import DataConfig, default_corpus, prepare_dataset
from ckless_lightning.data.hf_tokenizer import HFTokenizer
from ckless_lightning.record.loss_log import read_losses

VOCAB = 512


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = default_corpus(max_source_bytes=300_000)
    tokenizer.train([str(f) for f in corpus.files], trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_documents_end_with_the_tokenizers_end_of_text(bpe):
    tokenizer = HFTokenizer(bpe)
    assert tokenizer.vocab_size == VOCAB and tokenizer.eod_token == 0  # the first special token
    rows = tokenizer.encode_documents(pa.array(["def f(x):\n    return x", None, "import os"])).to_pylist()
    assert rows[0] == [*tokenizer.encode("def f(x):\n    return x"), 0]
    assert rows[1] == [0]
    assert rows[2] == [*tokenizer.encode("import os"), 0]
    assert len(rows[0]) < len("def f(x):\n    return x")  # merges: fewer ids than bytes
    assert HFTokenizer(bpe.parent).name == tokenizer.name  # a directory holding tokenizer.json


def test_another_tokenizer_gets_its_own_data_cache(bpe, tmp_path):
    common = {"cache_dir": str(tmp_path), "max_source_bytes": 200_000, "seq_len": 32}
    by_bytes = prepare_dataset(DataConfig(**common))
    by_bpe = prepare_dataset(DataConfig(**common, tokenizer=str(bpe)))
    assert by_bpe.path != by_bytes.path
    assert by_bpe.num_tokens < by_bytes.num_tokens


def test_a_recipe_trains_with_the_users_tokenizer(bpe, tmp_path, data_cache):
    run = tmp_path / "run"
    result = launch_job(
        run, data_cache, f"data.tokenizer={bpe}", f"model.vocab_size={VOCAB}", "trainer.max_steps=3"
    )
    assert f"tokenizer: {bpe} ({VOCAB} ids" in result.stdout
    assert sorted(read_losses(run / "losses.jsonl")) == [1, 2, 3]


def test_a_vocabulary_larger_than_the_models_is_refused_before_ranks_start(bpe, tmp_path, data_cache):
    result = launch_job(
        tmp_path / "run", data_cache, f"data.tokenizer={bpe}", "model.vocab_size=256", expect=2
    )
    assert "model.vocab_size=256 is smaller than the tokenizer's vocabulary (512)" in result.stderr
    missing = launch_job(tmp_path / "r2", data_cache, f"data.tokenizer={tmp_path}/nope.json", expect=2)
    assert "data.tokenizer=" in missing.stderr and "does not exist" in missing.stderr
