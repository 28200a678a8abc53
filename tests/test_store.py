"""The sharded token store: windows across shard boundaries, document boundaries, format-1 datasets beside it, and
training on either."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.corpus import make_corpus
from tests.helpers.layouts import tiny, train_in_process
from trident.config import DataConfig
from trident.data.dataset import TokenDataset, TokenWindows, open_dataset
from trident.data.meta import load_meta
from trident.data.prepare import prepare_dataset
from trident.data.store import ShardedTokens, ShardWriter
from trident.errors import DataError

SIZES = [300, 1, 0, 450, 250]  # tokens per shard: a one-token shard and an empty one among them


def _sharded(root: Path, sizes: list[int], doc_len: int = 7) -> tuple[Path, np.ndarray]:
    """A format-2 dataset whose token at position i is i (documents of ``doc_len`` tokens, cut at shard ends too);
    and the document ends it must report."""
    (root / "shards").mkdir(parents=True)
    (root / "tokenizer.model").write_bytes(b"")
    records, ends, start = [], [], 0
    for k, n in enumerate(sizes):
        writer = ShardWriter(root / "shards", k, np.dtype(np.uint16))
        lengths = [doc_len] * (n // doc_len) + ([n % doc_len] if n % doc_len else [])
        writer.add(np.arange(start, start + n), np.asarray(lengths, dtype=np.int64))
        records.append(writer.finish({"key": "test"}))
        ends += list(start + np.cumsum(lengths))
        start += n
    meta = {
        "format": 2,
        "vocab_size": 65536,
        "dtype": "uint16",
        "n_tokens": start,
        "eos_id": 1,
        "shards": [{k: r[k] for k in ("name", "n_tokens", "n_documents")} for r in records],
    }
    (root / "meta.json").write_text(json.dumps(meta))
    return root, np.asarray(ends, dtype=np.int64)


def _format1_copy(dataset: Path, root: Path) -> Path:
    """A format-1 dataset (one tokens.bin, no shards) holding the same tokens as ``dataset``."""
    root.mkdir()
    meta = load_meta(dataset)
    tokens = np.asarray(TokenDataset(dataset).tokens[:]).astype(meta["dtype"])
    tokens.tofile(root / "tokens.bin")
    shutil.copy(dataset / meta["tokenizer_file"], root)
    old = {k: meta[k] for k in ("vocab_size", "dtype", "n_tokens", "eos_id", "tokenizer_file", "tokenizer_sha256")}
    (root / "meta.json").write_text(json.dumps({"format": 1, **old, "n_documents": meta["n_documents"]}))
    return root


def test_windows_across_shard_boundaries_read_the_right_tokens(tmp_path):
    d, _ = _sharded(tmp_path / "ds", SIZES)
    ds = TokenDataset(d)
    assert ds.n_tokens == len(ds.tokens) == 1001 and len(ds.tokens.arrays) == 4
    train, val = ds.split(seq_len=10, val_fraction=0.1)
    assert (len(train), len(val)) == (89, 10)
    x, y = train.batch(torch.arange(len(train)))
    assert torch.equal(x, torch.arange(890).view(89, 10)) and torch.equal(y, x + 1)
    # Window 29 is tokens 290..300: it ends on the first token of shard 1; window 30 spans shards 1 and 3.
    assert x[29].tolist() == list(range(290, 300)) and y[29, -1].item() == 300
    assert x[30].tolist() == list(range(300, 310))
    vx, vy = val.batch(torch.tensor([0, 9]))
    assert vx[0, 0].item() == 900 and vy[1, -1].item() == 1000
    with pytest.raises(IndexError):
        train.batch(torch.tensor([89]))
    # Windows of any length and start, read straight from the shards.
    for start, length in [(0, 1001), (299, 3), (300, 1), (301, 450), (750, 251), (1000, 1)]:
        assert ds.tokens.read(np.asarray([start]), length)[0].tolist() == list(range(start, start + length))
    with pytest.raises(IndexError):
        ds.tokens.read(np.asarray([1000]), 2)
    assert ds.tokens[-1] == 1000 and list(ds.tokens[298:302]) == [298, 299, 300, 301]


def test_document_ends_are_exposed(tmp_path):
    d, ends = _sharded(tmp_path / "ds", SIZES)
    ds = TokenDataset(d)
    assert ds.document_ends.dtype == np.int64 and np.array_equal(ds.document_ends, ends)
    assert ds.document_ends[-1] == ds.n_tokens and len(ends) == 43 + 1 + 65 + 36


def test_a_window_reader_takes_one_array_too():
    windows = TokenWindows(np.arange(101, dtype=np.uint16), 10, 2, 3)
    x, y = windows.batch(torch.tensor([2]))
    assert x[0].tolist() == list(range(40, 50)) and y[0, -1].item() == 50
    assert isinstance(windows.tokens, ShardedTokens)


def test_a_format1_dataset_reads_as_its_sharded_twin(tiny_dataset, tmp_path):
    old = _format1_copy(tiny_dataset, tmp_path / "old")
    new, old_ds = TokenDataset(tiny_dataset), open_dataset(DataConfig(dataset_dir=str(old)), 512)
    assert old_ds.format == 1 and new.format == 2 and len(load_meta(tiny_dataset)["shards"]) >= 1
    assert (old_ds.n_tokens, old_ds.vocab_size, old_ds.eos_id) == (new.n_tokens, new.vocab_size, new.eos_id)
    (a, va), (b, vb) = (d.split(64, 0.05, 16) for d in (new, old_ds))
    idx = torch.arange(len(a))
    assert torch.equal(a.batch(idx)[0], b.batch(idx)[0]) and torch.equal(va.batch(idx[:4])[1], vb.batch(idx[:4])[1])
    assert np.array_equal(old_ds.document_ends, new.document_ends)


def test_a_damaged_shard_index_is_one_line(tiny_dataset, tmp_path):
    d = tmp_path / "ds"
    shutil.copytree(tiny_dataset, d)
    path = d / "shards" / "00000.idx"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(DataError) as e:
        TokenDataset(d)
    assert str(e.value).startswith(f"dataset file {path} is damaged (") and "\n" not in str(e.value)
    meta = json.loads((d / "meta.json").read_text())
    meta["format"] = 3
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"has format 3, this version reads formats 1, 2; prepare it again: python"):
        TokenDataset(d)


@pytest.mark.multiprocess
def test_a_format1_dataset_trains_as_its_sharded_twin(tiny_dataset, tmp_path):
    """The same tokens in the old layout and the new give the same losses."""
    old = _format1_copy(tiny_dataset, tmp_path / "old")
    runs = [
        train_in_process(tmp_path / name, tiny(d, "train.steps=3"))[0]
        for name, d in (("new", tiny_dataset), ("old", old))
    ]
    assert [r["step"] for r in runs[0]] == [1, 2, 3]
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]]


@pytest.mark.multiprocess
def test_training_on_a_prepared_jsonl_corpus(tmp_path):
    corpus = make_corpus(tmp_path / "in", n=600)
    d = prepare_dataset(
        corpus.files, tmp_path / "ds", 512, log=lambda _: None, max_bad_fraction=0.05, workers=2, unit_bytes=64 << 10
    )
    assert len(load_meta(d)["shards"]) > 3
    history = train_in_process(tmp_path / "run", tiny(d, "train.steps=3"))[0]
    assert [r["step"] for r in history] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in history)
