"""Data pipeline: tokenizer, prepare/cache for every source format, and the step-addressable loader."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets import Dataset

from ckless_lightning.data import (
    EOD_TOKEN,
    ByteTokenizer,
    DataConfig,
    StepBatchLoader,
    check_vocab,
    default_corpus,
    load_prepared,
    prepare_dataset,
)

SEQ = 16
ROW = SEQ + 1


def _rows(prepared) -> tuple[np.ndarray, np.ndarray]:
    ds = load_prepared(prepared.path)
    batch = ds[:]
    return batch["input_ids"].numpy(), batch["sample_id"].numpy()


def _expected_rows(stream: list[int], row_len: int) -> np.ndarray:
    n = len(stream) // row_len
    return np.asarray(stream[: n * row_len], dtype=np.int64).reshape(n, row_len)


def _docs_stream(texts: list[str]) -> list[int]:
    tok = ByteTokenizer()
    return [t for text in texts for t in [*tok.encode(text), EOD_TOKEN]]


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "béta", "γάμμα", "delta", "日本", "\n", "🎉", "x" * 7]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 30)))) for _ in range(n)]


# --- tokenizer and config ------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "plain ASCII, naïve café, Ελληνικά, 日本語, emoji 🎉\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # a cut character decodes, replaced

    docs = pa.array(["héllo", None, "", "🎉"])
    encoded = tok.encode_documents(pa.chunked_array([docs])).to_pylist()
    assert encoded == [[*tok.encode(t or ""), EOD_TOKEN] for t in ["héllo", None, "", "🎉"]]


def test_check_vocab():
    check_vocab(256, 256)
    check_vocab(256, 50_000)
    with pytest.raises(ValueError, match=r"model\.vocab_size"):
        check_vocab(256, 255)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"seq_len": 0}, "data.seq_len"),
        ({"micro_batch_size": -1}, "data.micro_batch_size"),
        ({"num_proc": 0}, "data.num_proc"),
        ({"format": "csv"}, "data.format"),
        ({"format": "tokenized"}, "data.source"),
        ({"max_source_bytes": 0}, "data.max_source_bytes"),
        ({"text_column": ""}, "data.text_column"),
    ],
)
def test_config_rejects(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        DataConfig(**kwargs)


def test_config_does_not_check_source_exists(tmp_path):
    DataConfig(source=str(tmp_path / "not-there.jsonl"))


def test_a_recipes_corpus_cap_does_not_apply_to_your_source():
    """llama3_tiny caps the built-in corpus; data.source=... on the command line is not refused for it."""
    assert DataConfig(source="x.txt", max_source_bytes=10).max_source_bytes is None


# --- prepare: default corpus and cache -----------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    cfg = DataConfig(max_source_bytes=300_000, cache_dir=str(tmp_path_factory.mktemp("cache")), seq_len=128)
    return cfg, prepare_dataset(cfg)


def test_default_corpus_prepare(stdlib_cache):
    cfg, prepared = stdlib_cache
    assert not prepared.from_cache
    corpus = default_corpus(cfg.max_source_bytes)
    assert 0 < corpus.num_bytes <= 300_000
    assert list(corpus.files) == sorted(corpus.files, key=lambda p: p.relative_to(corpus.root).as_posix())
    full = default_corpus()
    assert len(full.files) > len(corpus.files) and full.files[: len(corpus.files)] == corpus.files
    skipped = {"test", "tests", "idle_test", "site-packages"}
    assert not any(skipped & set(p.relative_to(full.root).parts) for p in full.files)

    ids, sample_ids = _rows(prepared)
    assert ids.shape == (prepared.num_samples, 129)
    assert sample_ids.tolist() == list(range(prepared.num_samples))
    stream = [b for f in corpus.files for b in [*f.read_bytes(), EOD_TOKEN]]
    assert prepared.num_tokens == len(stream)
    np.testing.assert_array_equal(ids, _expected_rows(stream, 129))
    assert prepared.path.parent == Path(cfg.cache_dir)
    assert [p.name for p in Path(cfg.cache_dir).iterdir()] == [prepared.key]  # no temp dirs left


def test_second_prepare_hits_cache(stdlib_cache):
    cfg, first = stdlib_cache
    mtime = first.path.stat().st_mtime_ns
    files = {p.name: p.stat().st_mtime_ns for p in first.path.iterdir()}
    again = prepare_dataset(cfg)
    assert again.from_cache
    assert (again.key, again.path, again.num_samples, again.num_tokens) == (
        first.key,
        first.path,
        first.num_samples,
        first.num_tokens,
    )
    assert first.path.stat().st_mtime_ns == mtime
    assert {p.name: p.stat().st_mtime_ns for p in first.path.iterdir()} == files
    other = prepare_dataset(DataConfig(max_source_bytes=300_000, cache_dir=cfg.cache_dir, seq_len=64))
    assert other.key != first.key and not other.from_cache


# --- prepare: user sources ------------------------------------------------------------------------------


def _cfg(tmp_path: Path, source, **kw) -> DataConfig:
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), seq_len=SEQ, **kw)


def test_text_directory_source(tmp_path):
    texts = ["first file\nwith two lines\n", "zweite Datei — ünïcödé 🎉\n" * 5, "third"]
    src = tmp_path / "txt"
    src.mkdir()
    for i, text in enumerate(texts):
        (src / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    prepared = prepare_dataset(_cfg(tmp_path, src))
    ids, sample_ids = _rows(prepared)
    stream = _docs_stream(texts)
    assert prepared.num_tokens == len(stream)
    np.testing.assert_array_equal(ids, _expected_rows(stream, ROW))
    assert sample_ids.tolist() == list(range(len(ids)))

    (src / "03.txt").write_text("a new file changes the key")
    assert prepare_dataset(_cfg(tmp_path, src)).key != prepared.key


def test_jsonl_source_and_glob(tmp_path):
    texts = _texts(40)
    lines = [json.dumps({"body": t, "n": i}) + "\n" for i, t in enumerate(texts)]
    (tmp_path / "a.jsonl").write_text("".join(lines))
    prepared = prepare_dataset(_cfg(tmp_path, tmp_path / "*.jsonl", text_column="body"))
    ids, _ = _rows(prepared)
    np.testing.assert_array_equal(ids, _expected_rows(_docs_stream(texts), ROW))

    with pytest.raises(ValueError, match=r"data\.text_column='text'.*columns found: body, n"):
        prepare_dataset(_cfg(tmp_path, tmp_path / "a.jsonl"))
    with pytest.raises(ValueError, match=r"data\.text_column='n'.*not strings"):
        prepare_dataset(_cfg(tmp_path, tmp_path / "a.jsonl", text_column="n"))


def test_parquet_source(tmp_path):
    texts = _texts(30, seed=1)
    Dataset.from_dict({"text": texts, "id": list(range(30))}).to_parquet(str(tmp_path / "part.parquet"))
    prepared = prepare_dataset(_cfg(tmp_path, tmp_path / "part.parquet"))
    ids, _ = _rows(prepared)
    np.testing.assert_array_equal(ids, _expected_rows(_docs_stream(texts), ROW))


def test_tokenized_source_is_packed_without_separators(tmp_path):
    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 50_000, size=int(rng.integers(0, 40))).tolist() for _ in range(25)]
    Dataset.from_dict({"input_ids": docs, "meta": ["m"] * 25}).save_to_disk(str(tmp_path / "tok"))
    prepared = prepare_dataset(_cfg(tmp_path, tmp_path / "tok"))
    assert prepared.key.startswith("tokenized-")
    ids, _ = _rows(prepared)
    stream = [t for d in docs for t in d]
    assert prepared.num_tokens == len(stream)
    np.testing.assert_array_equal(ids, _expected_rows(stream, ROW))

    Dataset.from_dict({"tokens": [[1, 2]]}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=r"no 'input_ids' column.*tokens"):
        prepare_dataset(_cfg(tmp_path, tmp_path / "bad"))


def test_num_proc_gives_same_rows(tmp_path):
    texts = _texts(60, seed=3)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    one = prepare_dataset(_cfg(tmp_path, tmp_path / "a.jsonl"))
    two = prepare_dataset(_cfg(tmp_path / "other", tmp_path / "a.jsonl", num_proc=2))
    assert one.key == two.key and not two.from_cache
    np.testing.assert_array_equal(_rows(one)[0], _rows(two)[0])


def test_killed_prepare_leaves_no_cache(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("some text " * 20)
    cfg = _cfg(tmp_path, tmp_path / "a.txt")

    def killed(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(Dataset, "save_to_disk", killed)
        with pytest.raises(KeyboardInterrupt):
            prepare_dataset(cfg)
    assert list((tmp_path / "cache").iterdir()) == []
    prepared = prepare_dataset(cfg)
    assert not prepared.from_cache and prepared.num_samples == 200 // ROW

    (tmp_path / "b.txt").write_text("other text " * 20)
    half = tmp_path / "cache" / prepare_dataset(_cfg(tmp_path, tmp_path / "b.txt")).key
    (half / "ckless_prepared.json").unlink()  # a cache dir without its completion marker is not used
    (half / "junk").write_text("x")
    with pytest.raises(FileExistsError, match="not a complete prepared dataset"):
        prepare_dataset(_cfg(tmp_path, tmp_path / "b.txt"))


def test_source_errors(tmp_path):
    missing = tmp_path / "nope" / "data.jsonl"
    with pytest.raises(FileNotFoundError, match=r"data\.source") as err:
        prepare_dataset(_cfg(tmp_path, missing))
    assert str(missing) in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"data\.source.*glob matches no files"):
        prepare_dataset(_cfg(tmp_path, tmp_path / "*.parquet"))

    (tmp_path / "tiny.txt").write_text("short")
    with pytest.raises(ValueError, match=r"data\.seq_len"):
        prepare_dataset(_cfg(tmp_path, tmp_path / "tiny.txt"))

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("x" * 100)
    (mixed / "b.jsonl").write_text('{"text": "y"}\n')
    with pytest.raises(ValueError, match=r"mixes jsonl, text.*data\.format"):
        prepare_dataset(_cfg(tmp_path, mixed))
    (mixed / "c.bin").write_bytes(b"\x00")
    with pytest.raises(ValueError, match=r"\.bin.*data\.format"):
        prepare_dataset(_cfg(tmp_path, mixed))
    assert prepare_dataset(_cfg(tmp_path, mixed / "a.txt", format="text")).num_samples == 100 // ROW


# --- loader ---------------------------------------------------------------------------------------------

N_SAMPLES = 50


@pytest.fixture(scope="module")
def toy_dataset():
    ds = Dataset.from_dict(
        {"sample_id": list(range(N_SAMPLES)), "input_ids": [[i] * ROW for i in range(N_SAMPLES)]}
    )
    ds.set_format("torch", columns=["input_ids", "sample_id"])
    return ds


def _loader(ds, rank, *, dp_size=3, mbs=2, seed=7, **kw) -> StepBatchLoader:
    return StepBatchLoader(ds, seed=seed, micro_batch_size=mbs, dp_rank=rank, dp_size=dp_size, **kw)


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_loader_batches_are_pure_in_step(toy_dataset):
    spe = N_SAMPLES // 6  # 8 steps per epoch; 2 samples skipped each epoch
    total = 3 * spe + 3
    for rank in range(3):
        reference = _take(_loader(toy_dataset, rank), total)
        for i, batch in enumerate(reference):
            assert batch["step"] == i
            assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (2, ROW)
            assert batch["sample_ids"].dtype == torch.long and batch["sample_ids"].shape == (2,)
            assert torch.equal(batch["input_ids"][:, 0], batch["sample_ids"])  # toy rows hold their id
        for start in (1, spe - 1, spe, spe + 3, 2 * spe + 1):
            resumed = _take(_loader(toy_dataset, rank, start_step=start), total - start)
            for got, want in zip(resumed, reference[start:], strict=True):
                assert got["step"] == want["step"]
                assert torch.equal(got["sample_ids"], want["sample_ids"])
                assert torch.equal(got["input_ids"], want["input_ids"])


def test_loader_epoch_covers_without_repeats(toy_dataset):
    loaders = [_loader(toy_dataset, r) for r in range(3)]
    spe = loaders[0].steps_per_epoch
    assert spe == 8
    epochs = []
    for epoch in range(2):
        seen = []
        for step in range(epoch * spe, (epoch + 1) * spe):
            per_rank = [loaders[r].sample_indices(step) for r in range(3)]
            union = [i for ids in per_rank for i in ids]
            assert union == loaders[0]._permutation(epoch)[(step % spe) * 6 : (step % spe + 1) * 6].tolist()
            assert per_rank[1] == loaders[0].sample_indices(step, dp_rank=1)
            seen += union
        assert len(seen) == len(set(seen)) == spe * 6
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    assert _loader(toy_dataset, 0, seed=8).sample_indices(0) != loaders[0].sample_indices(0)


def test_loader_length_and_bounds(toy_dataset):
    loader = _loader(toy_dataset, 0, start_step=3, max_steps=10)
    assert len(loader) == 10
    assert [b["step"] for b in loader] == list(range(3, 10))
    with pytest.raises(TypeError):
        len(_loader(toy_dataset, 0))
    with pytest.raises(ValueError, match=r"data\.micro_batch_size"):
        _loader(toy_dataset, 0, mbs=20)
    with pytest.raises(ValueError, match="dp_rank"):
        _loader(toy_dataset, 3)


def test_loader_state_round_trip(toy_dataset):
    reference = _take(_loader(toy_dataset, 1), 20)
    loader = _loader(toy_dataset, 1)
    assert loader.state_dict() == {"next_step": 0, "seed": 7, "dp_rank": 1, "dp_size": 3, "accumulate": 1}
    it = iter(loader)
    for _ in range(5):
        next(it)
    assert loader.state_dict()["next_step"] == 5  # no committed position: the yield count
    loader.set_position(4)  # the trainer committed 4 steps; batch 4 was only prefetched
    next(it)
    state = loader.state_dict()
    assert state["next_step"] == 4

    restored = _loader(toy_dataset, 1)
    restored.load_state_dict(state)
    assert restored.state_dict()["next_step"] == 4
    resumed = _take(restored, 10)
    assert [b["step"] for b in resumed] == list(range(4, 14))
    for got, want in zip(resumed, reference[4:14], strict=True):
        assert torch.equal(got["sample_ids"], want["sample_ids"])

    explicit = _loader(toy_dataset, 1)
    explicit.set_start_step(12)
    assert explicit.state_dict()["next_step"] == 12
    assert next(iter(explicit))["step"] == 12

    with pytest.raises(ValueError, match=r"data\.seed"):
        _loader(toy_dataset, 1, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="data-parallel ranks"):
        _loader(toy_dataset, 1, dp_size=2, mbs=3).load_state_dict(state)


def _step_samples(loaders, accumulate, step):
    """The sample ids of optimizer step ``step`` (0-based) over every rank and micro-batch."""
    return sorted(
        i
        for loader in loaders
        for k in range(accumulate)
        for i in loader.sample_indices(step * accumulate + k)
    )


def test_an_optimizer_steps_samples_do_not_depend_on_the_data_parallel_width(toy_dataset):
    # An elastic job's global batch of 12: 6 ranks x 1 micro-batch, 3 x 2, 2 x 3 (mbs 2).
    widths = {6: 1, 3: 2, 2: 3}
    loaders = {
        d: [_loader(toy_dataset, r, dp_size=d, accumulate=a) for r in range(d)] for d, a in widths.items()
    }
    per_epoch = N_SAMPLES // 12
    assert all(ls[0].steps_per_epoch == per_epoch * widths[d] for d, ls in loaders.items())
    seen = []
    for step in range(2 * per_epoch + 1):  # across an epoch boundary
        samples = {d: _step_samples(ls, widths[d], step) for d, ls in loaders.items()}
        assert samples[6] == samples[3] == samples[2], step
        assert len(set(samples[6])) == 12
        seen.append(samples[6])
    first_epoch = [i for s in seen[:per_epoch] for i in s]
    assert len(first_epoch) == len(set(first_epoch)) == per_epoch * 12  # each sample once per epoch


def test_an_elastic_loader_resumes_a_state_saved_at_another_width(toy_dataset):
    saved = _loader(toy_dataset, 1, dp_size=3, accumulate=2, elastic=True)
    saved.set_start_step(10)  # optimizer step 5 of 3 x 2 micro-batches
    narrow = _loader(toy_dataset, 0, dp_size=2, accumulate=3, elastic=True)
    narrow.load_state_dict(saved.state_dict())
    assert narrow.state_dict()["next_step"] == 15  # optimizer step 5 of 2 x 3
    with pytest.raises(ValueError, match="data-parallel ranks"):  # not elastic: refused as before
        _loader(toy_dataset, 0, dp_size=2, accumulate=3).load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match="global_batch_size"):  # another global batch: refused
        _loader(toy_dataset, 0, dp_size=2, accumulate=2, elastic=True).load_state_dict(saved.state_dict())
    saved.set_start_step(11)  # inside an optimizer step
    with pytest.raises(ValueError, match="micro-batch 1 of optimizer step 6"):
        narrow.load_state_dict(saved.state_dict())


def test_loader_on_prepared_data(stdlib_cache):
    _, prepared = stdlib_cache
    ds = load_prepared(prepared.path)
    loader = StepBatchLoader(ds, seed=1, micro_batch_size=4, dp_rank=1, dp_size=2, max_steps=3)
    batches = list(loader)
    assert len(batches) == 3
    for b in batches:
        assert b["input_ids"].shape == (4, 129) and b["input_ids"].dtype == torch.long
        assert torch.equal(b["input_ids"], ds[b["sample_ids"].tolist()]["input_ids"])


def test_one_loader_read_from_two_threads_gives_each_step_its_own_epochs_order(toy_dataset):
    # A batch-cache reader thread and a checking thread once shared a loader: one asked for a step
    # of the next epoch while the other read the cached order, and got the next epoch's.
    spe = N_SAMPLES // 6
    want = {step: _loader(toy_dataset, 0).batch(step)["sample_ids"] for step in range(4 * spe)}
    shared = _loader(toy_dataset, 0)
    wrong: list[int] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can

    def read(steps: range) -> None:
        for _ in range(150):
            for step in steps:
                if not torch.equal(shared.batch(step)["sample_ids"], want[step]):
                    wrong.append(step)

    try:
        threads = [threading.Thread(target=read, args=(range(e * spe, (e + 1) * spe),)) for e in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert wrong == []
