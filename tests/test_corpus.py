"""Corpora of JSON Lines (plain, gzip, zstd), Parquet and text files with bad records among them: the prepared
dataset holds exactly the tokenizer's encoding of each document plus one eos, whatever the number of workers, and the
bad records are counted and named by file and line (row)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.corpus import Corpus, make_corpus, texts
from tests.helpers.processes import tool_process
from trident.config import DataConfig
from trident.data.dataset import TokenDataset
from trident.data.meta import load_meta
from trident.data.prepare import prepare_dataset, resolve_dataset
from trident.data.sources import FilePiece, Reader, collect_text_files
from trident.data.tokenizer import load_tokenizer
from trident.data.units import plan_units
from trident.errors import DataError

VOCAB = 512
UNIT = 16 << 10  # small work units: the corpus makes many shards, a.jsonl several byte ranges


def quiet(msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "in")


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    """Prepared by one worker with a tokenizer trained on the corpus itself."""
    out = tmp_path_factory.mktemp("prepared") / "ds"
    return prepare_dataset(corpus.files, out, VOCAB, log=quiet, max_bad_fraction=0.05, unit_bytes=UNIT)


def _all_files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_directories_pick_up_corpus_files(corpus):
    assert collect_text_files([str(corpus.root)], [".txt"]) == corpus.files
    assert collect_text_files([str(corpus.root)], [".md"]) == [p for p in corpus.files if p.suffix != ".txt"]
    assert [p.name for p in collect_text_files([str(corpus.root / "*.jsonl*")], [])] == [
        "a.jsonl",
        "b.jsonl.gz",
        "c.jsonl.zst",
    ]


def test_units_cut_large_jsonl_at_line_boundaries_and_parquet_by_row_groups(corpus):
    units = plan_units(corpus.files, UNIT)
    pieces = [p for u in units for p in u.pieces]
    a = [p for p in pieces if p.path.endswith("a.jsonl")]
    assert len(a) > 3 and a[0].start == 0 and a[-1].stop == (corpus.root / "a.jsonl").stat().st_size
    assert all(x.stop == y.start for x, y in zip(a, a[1:], strict=False))
    parquet = [p for p in pieces if p.kind == ".parquet"]
    assert (
        len(parquet) > 1
        and parquet[0].start == 0
        and all(x.stop == y.start for x, y in zip(parquet, parquet[1:], strict=False))
    )
    # Every record is read exactly once across the byte ranges: the ranges' documents are the file's.
    whole = FilePiece(str(corpus.root / "a.jsonl"), ".jsonl", 0, a[0].file_size, a[0].mtime_ns)
    assert [r for p in a for r in Reader(p, "text").records()] == list(Reader(whole, "text").records())
    assert [u.index for u in units] == list(range(len(units))) and len(units) == len(plan_units(corpus.files, UNIT))


def test_the_dataset_is_each_document_encoded_with_one_eos(corpus, prepared):
    tok = load_tokenizer(prepared)
    meta = load_meta(prepared)
    expected = [np.asarray([*tok.encode(t), tok.eos_id]) for t in corpus.documents]
    ds = TokenDataset(prepared)
    assert np.array_equal(np.asarray(ds.tokens[:]), np.concatenate(expected))
    assert ds.n_tokens == meta["n_tokens"] == sum(map(len, expected))
    assert np.array_equal(ds.document_ends, np.cumsum([len(e) for e in expected]))
    assert meta["n_documents"] == len(corpus.documents) and meta["n_records"] == corpus.records
    assert len(meta["shards"]) == len(plan_units(corpus.files, UNIT)) > 5
    # Text survives: the non-ASCII document and the text file decode back.
    ends = ds.document_ends
    last = np.asarray(ds.tokens[int(ends[-2]) : int(ends[-1]) - 1]).tolist()
    assert tok.decode(last) == corpus.documents[-1]


def test_bad_records_are_counted_with_file_and_line(corpus, prepared):
    meta = load_meta(prepared)
    assert meta["bad_records"] == len(corpus.bad) == 8
    assert [e.split(":")[0] for e in meta["bad_examples"]] == corpus.bad
    what = [e.split(": ", 1)[1] for e in meta["bad_examples"]]
    assert what[0].startswith("not JSON") and what[1].startswith("not UTF-8")
    assert what[2] == "field 'text' is a number, not a string" and what[3] == "not a JSON object but an array"
    assert what[4] == "no field 'text'" and what[5] == "field 'text' is null, not a string"
    assert what[6].startswith("not JSON")
    assert what[7] == "column 'text' is null"


def test_past_the_threshold_the_preparation_stops_in_one_line(corpus, tmp_path):
    fraction = len(corpus.bad) / corpus.records
    out = tmp_path / "ds"
    with pytest.raises(DataError) as e:
        prepare_dataset(corpus.files, out, VOCAB, log=quiet, max_bad_fraction=fraction * 0.9, unit_bytes=UNIT)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{len(corpus.bad)} of {corpus.records:,} records are bad ({fraction:.1%}), more than")
    assert f"the first: {corpus.bad[0]}: not JSON" in message and "--max-bad-fraction" in message
    assert not out.exists() and not (tmp_path / "ds.partial" / "meta.json").exists()
    # At the threshold itself it passes.
    prepare_dataset(corpus.files, out, VOCAB, log=quiet, max_bad_fraction=fraction, unit_bytes=UNIT)
    assert load_meta(out)["bad_records"] == len(corpus.bad)


def test_a_wrong_text_field_stops_after_the_first_units(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    docs = [t[:200] for t in texts(4500)]
    for k in range(3):
        (root / f"part{k}.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in docs[k::3]))
    files, unit = sorted(root.iterdir()), 64 << 10
    with pytest.raises(DataError) as e:
        prepare_dataset(files, tmp_path / "ds", VOCAB, log=quiet, unit_bytes=unit, text_field="body2")
    assert str(e.value).startswith("the text is empty")  # training the tokenizer finds no text at all
    tok = prepare_dataset(files[:1], tmp_path / "tok", VOCAB, log=quiet, text_field="body")
    with pytest.raises(DataError) as e:
        prepare_dataset(files, tmp_path / "ds", tokenizer=load_tokenizer(tok), log=quiet, unit_bytes=unit)
    n_units = len(plan_units(files, unit))
    assert "records are bad (100.0%) in the first " in str(e.value) and f" of {n_units} work units" in str(e.value)
    assert f"the first: {files[0]} line 1: no field 'text'" in str(e.value)
    # It stopped early: fewer shards were written than there are units.
    assert 0 < len(list((tmp_path / "ds.partial" / "shards").glob("*.json"))) < n_units


@pytest.mark.multiprocess
def test_two_workers_write_the_same_bytes(corpus, prepared, tmp_path):
    out = prepare_dataset(
        corpus.files, tmp_path / "w2", VOCAB, log=quiet, max_bad_fraction=0.05, unit_bytes=UNIT, workers=2
    )
    assert _all_files(out) == _all_files(prepared)


@pytest.mark.multiprocess
def test_a_given_tokenizer_over_two_workers_matches_the_tokenizer(corpus, prepared, tmp_path):
    tok = load_tokenizer(prepared / "tokenizer.model")
    kw = {"log": quiet, "max_bad_fraction": 0.05, "unit_bytes": UNIT}
    out = prepare_dataset(corpus.files, tmp_path / "given", tokenizer=tok, workers=2, **kw)
    ds = TokenDataset(out)
    expected = np.concatenate([[*tok.encode(t), tok.eos_id] for t in corpus.documents])
    assert np.array_equal(np.asarray(ds.tokens[:]), expected)
    assert _all_files(out) == _all_files(prepared)


def test_training_prepares_data_text_with_its_text_field(tmp_path):
    """resolve_dataset (data.text at training time) reads JSON Lines under data.text_field, into a cache keyed by it."""
    root = tmp_path / "in"
    root.mkdir()
    docs = texts(300)
    (root / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in docs))
    cfg = DataConfig(text=[str(root)], cache_dir=str(tmp_path / "cache"), text_field="body", max_bad_fraction=0.0)
    d = resolve_dataset(cfg, VOCAB, log=quiet)
    ds = TokenDataset(d)
    tok = load_tokenizer(d)
    assert np.array_equal(np.asarray(ds.tokens[:]), np.concatenate([[*tok.encode(t), tok.eos_id] for t in docs]))
    assert load_meta(d)["text_field"] == "body"
    with pytest.raises(DataError, match=r"^the text is empty"):  # under "text" there is none: another dataset
        resolve_dataset(dataclasses.replace(cfg, text_field="text"), VOCAB, log=quiet)


@pytest.mark.multiprocess
def test_the_command_shows_progress_and_counts(corpus, prepared, tmp_path):
    args = ["--text", str(corpus.root), "--out", str(tmp_path / "ds"), "--vocab-size", str(VOCAB), "--workers", "2"]
    args += ["--shard-mb", str(UNIT / 2**20)]
    r = tool_process("prepare_data", *args, timeout=300)
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith(f"error: {len(corpus.bad)} of ")
    r = tool_process("prepare_data", *args, "--max-bad-fraction", "0.05", timeout=300)
    assert r.returncode == 0, r.stderr
    progress = [line for line in r.stderr.splitlines() if line.startswith("tokenizing 100% |####################| ")]
    assert len(progress) == 1 and f"{len(corpus.documents):,} docs, " in progress[0] and " MB/s, in " in progress[0]
    assert f"skipped {len(corpus.bad)} bad records of {corpus.records:,}, the first: {corpus.bad[0]}: " in r.stderr
    assert (
        f", {len(corpus.documents):,} documents, " in r.stdout
        and f", {len(corpus.bad)} bad records skipped" in r.stdout
    )
    assert _all_files(tmp_path / "ds") == _all_files(prepared)
