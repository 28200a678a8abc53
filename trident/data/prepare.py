"""Turn a corpus into a training dataset: a tokenizer plus a sharded store of token ids (trident/data/store.py).

Inputs are text files (one document each), JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``) and Parquet files
(many documents each, the text under ``text_field``), streamed (trident/data/sources.py). The corpus is cut into
work units by the input alone (trident/data/units.py) and unit k becomes shard k, tokenized in this process or in
``workers`` processes (trident/data/workers.py): the bytes are the same for any number of workers. Without a
tokenizer, one is trained on the corpus first (trident/data/bpe.py).

What the directory holds is trident/data/meta.py's to say. It is built in the sibling ``DIR.partial`` and renamed
into place with ``meta.json`` written last, so a killed preparation never leaves something that looks complete; the
shards it finished (each renamed into place with its record) are reused by the next run of the same command.

``resolve_dataset`` is what training calls (through trident/data/dataset.py's ``open_dataset``): it either checks a
dataset made by ``tools/prepare_data.py`` or prepares one from ``data.text`` (or the standard library's source)
into a cache keyed by the files and the tokenizer (its settings when trained, its sha256 when given
by ``data.tokenizer``), so only the first run pays for it. Nothing below this module calls back into it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import numpy as np

from trident.config import DataConfig
from trident.data.bpe import MIN_VOCAB, train_bpe
from trident.data.meta import DATASET_FILES, FORMAT, load_meta, rebuild_hint, tokenizer_sha256
from trident.data.progress import Progress
from trident.data.sources import BadRecord, Reader, collect_text_files, default_corpus_files
from trident.data.store import SHARDS, finished_shard, shard_name, write_atomically
from trident.data.tokenizer import (
    FILE_NAMES,
    SENTENCEPIECE,
    SentencePieceTokenizer,
    Tokenizer,
    check_eos,
    check_vocab_fit,
    load_tokenizer,
)
from trident.data.units import UNIT_BYTES, Unit, plan_units
from trident.data.workers import EncodeJob, run_units
from trident.errors import DataError

# The bad-record threshold is also checked on every prefix of units holding at least this many records, so a
# wrong --text-field stops the preparation after its first units rather than at the end.
_EARLY_RECORDS = 1000
_MAX_EXAMPLES = 100
_LOCK, _TOKENIZER_KEY = ".lock", "tokenizer.key"

Log = Callable[[str], None]


def counted(n: int, noun: str) -> str:
    """``n noun`` in English: 1 file, 2 files."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def documents(units: list[Unit], text_field: str) -> Iterator[str]:
    """The non-empty documents of ``units`` in order (bad records left out: the workers count them)."""
    for unit in units:
        for piece in unit.pieces:
            for record in Reader(piece, text_field).records():
                if record and not isinstance(record, BadRecord):
                    yield record


def token_dtype(vocab_size: int) -> type:
    """The narrowest unsigned type holding ids below ``vocab_size``: uint16 up to 65536, else uint32 (Llama 3)."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _check_out_dir(out_dir: Path) -> None:
    """Refuse to replace anything but an older dataset."""
    if not out_dir.exists():
        return
    extra = {p.name for p in out_dir.iterdir()} - set(DATASET_FILES) if out_dir.is_dir() else {out_dir.name}
    if extra:
        raise DataError(
            f"{out_dir} exists and is not a trident dataset (it holds {sorted(extra)[0]!r}); "
            "choose another output directory"
        )


def _install(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``; an older dataset there is moved aside first and then deleted."""
    if out_dir.exists():
        old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)


def prepare_dataset(
    files: list[Path],
    out_dir: Path,
    vocab_size: int | None = None,
    tokenizer_lines: int = 200_000,
    seed: int = 0,
    log: Log = print,
    tokenizer: Tokenizer | None = None,
    *,
    text_field: str = "text",
    workers: int = 1,
    max_bad_fraction: float = 0.01,
    unit_bytes: int = UNIT_BYTES,
    progress: TextIO | None = None,
) -> Path:
    """Tokenize ``files`` and write the dataset to ``out_dir``, with ``tokenizer`` when given, else with a BPE
    tokenizer of ``vocab_size`` pieces trained on them (``tokenizer_lines`` and ``seed`` are its settings).

    A trained tokenizer has byte fallback: every byte sequence encodes losslessly, so any text file works
    and indentation, tabs and newlines survive a round trip. ``workers`` processes tokenize (the bytes are the same
    for any count); ``progress`` is where the progress bar goes (None: no bar). More bad records than
    ``max_bad_fraction`` of all records stop the preparation (a DataError naming the first).
    """
    if (vocab_size is None) == (tokenizer is None):
        raise ValueError("prepare_dataset takes exactly one of vocab_size (train a tokenizer) and tokenizer")
    if not files:
        raise DataError("no text files to prepare; point data.text at text files or directories")
    if tokenizer is not None:
        check_eos(tokenizer, tokenizer.file_name)
    elif vocab_size < MIN_VOCAB:
        raise DataError(
            f"vocab_size {vocab_size} is too small: a byte-fallback tokenizer needs at least {MIN_VOCAB} "
            "(256 bytes, unk, eos and the text's characters); raise model.vocab_size"
        )
    sources = [{"path": str(p), "bytes": (st := p.stat()).st_size, "mtime_ns": st.st_mtime_ns} for p in files]
    source_bytes = sum(s["bytes"] for s in sources)
    if source_bytes == 0:
        raise DataError(f"the {counted(len(files), 'text file')} {'is' if len(files) == 1 else 'are'} empty; add text")
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.with_name(f"{out_dir.name}.partial")
    (partial / SHARDS).mkdir(parents=True, exist_ok=True)
    with open(partial / _LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"another preparation is writing {out_dir} (it holds {partial / _LOCK})") from None
        try:
            units = plan_units(files, unit_bytes)
            if workers > len(units):  # said first: the units are fixed by the input, so a dataset's bytes are too
                log(
                    f"using {counted(len(units), 'worker')}, not the {workers} asked for: a worker takes "
                    f"whole work units of up to {unit_bytes / (1 << 20):g} MiB of input, and this input is "
                    f"{counted(len(units), 'unit')}"
                )
            if tokenizer is None:
                tokenizer = _trained_tokenizer(partial, units, vocab_size, tokenizer_lines, seed, text_field, log)
            meta = _tokenize(partial, units, tokenizer, text_field, workers, max_bad_fraction, log, progress)
        except BaseException:
            if not any((partial / SHARDS).glob("*.json")):  # nothing a rerun could reuse
                shutil.rmtree(partial, ignore_errors=True)
            raise
        meta.update(sources=sources, source_bytes=source_bytes)
        (partial / _TOKENIZER_KEY).unlink(missing_ok=True)
        for name in FILE_NAMES:
            if name != tokenizer.file_name:
                (partial / name).unlink(missing_ok=True)
        (partial / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        _install(partial, out_dir)
        (out_dir / _LOCK).unlink(missing_ok=True)
    return out_dir


def _trained_tokenizer(
    partial: Path, units: list[Unit], vocab_size: int, lines: int, seed: int, text_field: str, log: Log
) -> Tokenizer:
    """The BPE tokenizer trained on a sample of the corpus's lines, or the one an interrupted run already trained."""
    key = hashlib.sha256(f"{FORMAT}\0{vocab_size}\0{lines}\0{seed}\0{text_field}".encode())
    for unit in units:
        for piece in unit.pieces:
            key.update(b"\0" + piece.describe().encode())
    path, key_path = partial / SENTENCEPIECE, partial / _TOKENIZER_KEY
    if path.is_file() and key_path.is_file() and key_path.read_text() == key.hexdigest():
        log(f"reusing the {vocab_size}-piece tokenizer an earlier run trained")
        return SentencePieceTokenizer(path.read_bytes())
    log(f"training a {vocab_size}-piece BPE tokenizer on up to {lines:,} lines")
    tokenizer = SentencePieceTokenizer(train_bpe(documents(units, text_field), vocab_size, lines, seed))
    write_atomically(path, tokenizer.data)
    write_atomically(key_path, key.hexdigest().encode())
    return tokenizer


def _tokenize(
    partial: Path,
    units: list[Unit],
    tokenizer: Tokenizer,
    text_field: str,
    workers: int,
    max_bad_fraction: float,
    log: Log,
    progress: TextIO | None,
) -> dict:
    """Write every unit's shard into ``partial`` (reusing those an earlier run finished); return meta.json's fields
    but the sources."""
    if not (partial / tokenizer.file_name).is_file() or (partial / tokenizer.file_name).read_bytes() != tokenizer.data:
        write_atomically(partial / tokenizer.file_name, tokenizer.data)
    dtype = np.dtype(token_dtype(tokenizer.vocab_size))
    shard_dir = partial / SHARDS
    salt = f"{FORMAT}\0{tokenizer.file_name}\0{tokenizer.sha256}{tokenizer.encoding}\0{text_field}\0{dtype.name}"
    jobs = [EncodeJob(u, u.key(salt), str(shard_dir), text_field, dtype.name) for u in units]
    records: dict[int, dict] = {}
    for job in jobs:
        if (record := finished_shard(shard_dir, job.unit.index, job.key, dtype)) is not None:
            records[job.unit.index] = record
        else:  # another corpus's, tokenizer's or version's: never to be taken for this one
            (shard_dir / f"{shard_name(job.unit.index)}.json").unlink(missing_ok=True)
    _remove_strays(shard_dir, len(units))
    total = sum(u.size for u in units)
    if records:
        log(f"reusing {len(records)} of {counted(len(units), 'shard')} an earlier run finished")
    todo = [job for job in jobs if job.unit.index not in records]
    n_workers = max(1, min(workers, len(todo)))
    log(
        f"tokenizing {counted(len(units), 'unit')} ({total / 1e6:.1f} MB, {len(todo)} to do) with "
        f"{tokenizer.file_name} on {counted(n_workers, 'worker')}"
    )
    done = [sum(r["n_documents"] for r in records.values()), sum(r["n_tokens"] for r in records.values()), 0]
    done[2] = sum(jobs[k].unit.size for k in records)
    bar = Progress(total, progress, done_bytes=done[2]) if progress is not None else None

    def report(documents: int, tokens: int, done_bytes: int) -> None:
        done[0] += documents
        done[1] += tokens
        done[2] += done_bytes
        if bar is not None:
            bar.show(*done)

    checked = _BadRecords(max_bad_fraction)
    checked.advance(records, len(units))
    for record in run_units(todo, tokenizer, workers, report):
        records[record["unit"]] = record
        checked.advance(records, len(units))
    if bar is not None:
        bar.show(*done, final=True)
    checked.check(len(units), final=True)
    ordered = [records[k] for k in range(len(units))]
    if checked.bad:
        log(f"skipped {checked.bad:,} bad records of {checked.records:,}, the first: {checked.examples[0]}")
    return {
        "format": FORMAT,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "n_tokens": sum(r["n_tokens"] for r in ordered),
        "eos_id": tokenizer.eos_id,
        "tokenizer_file": tokenizer.file_name,
        "tokenizer_sha256": tokenizer.sha256,
        "n_documents": sum(r["n_documents"] for r in ordered),
        "n_records": checked.records,
        "bad_records": checked.bad,
        "bad_examples": checked.examples,
        "text_field": text_field,
        "shards": [
            {k: r[k] for k in ("name", "n_tokens", "n_documents", "sha256", "index_sha256", "source_bytes")}
            for r in ordered
        ],
    }


class _BadRecords:
    """The bad-record threshold, checked on the units in order (unit 0, then 0-1, ...): the same verdict for any
    number of workers, and early when a prefix of enough records is already over it."""

    def __init__(self, max_fraction: float):
        self.max, self.next, self.records, self.bad = max_fraction, 0, 0, 0
        self.examples: list[str] = []

    def advance(self, records: dict[int, dict], n_units: int) -> None:
        while self.next in records:
            r = records[self.next]
            self.records += r["n_records"]
            self.bad += r["n_bad"]
            self.examples += r["bad_examples"][: _MAX_EXAMPLES - len(self.examples)]
            self.next += 1
            if self.records >= _EARLY_RECORDS:
                self.check(n_units)

    def check(self, n_units: int, final: bool = False) -> None:
        if not self.bad or self.bad <= self.max * self.records:
            return
        where = "" if final else f" in the first {self.next} of {n_units} work units"
        raise DataError(
            f"{self.bad:,} of {self.records:,} records are bad ({self.bad / self.records:.1%}){where}, more than "
            f"max_bad_fraction {self.max:g}; the first: {self.examples[0]}; fix the input, name the documents' "
            "field with --text-field (data.text_field), or raise --max-bad-fraction (data.max_bad_fraction)"
        )


def _remove_strays(shard_dir: Path, n_units: int) -> None:
    """Temporary files of a killed run, and shards past the last unit (the corpus shrank since)."""
    keep = {shard_name(k) for k in range(n_units)}
    for path in shard_dir.iterdir():
        if ".tmp-" in path.name or path.name.split(".")[0] not in keep:
            path.unlink(missing_ok=True)


def _cache_key(
    files: list[Path], vocab_size: int, tokenizer_lines: int, tokenizer: Tokenizer | None = None, text_field="text"
) -> str:
    """A trained tokenizer is a function of the text and its settings; a given one is its file's sha256 (and how
    ``encode`` reads it)."""
    if tokenizer is None:
        settings = f"{vocab_size}\0{tokenizer_lines}"
    else:
        settings = f"{tokenizer.file_name}\0{tokenizer.sha256}{tokenizer.encoding}"
    h = hashlib.sha256(f"{FORMAT}\0{settings}\0{text_field}".encode())
    for p in files:
        st = p.stat()
        h.update(f"\0{p}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def resolve_dataset(data: DataConfig, vocab_size: int, log: Log = print, progress: TextIO | None = sys.stderr) -> Path:
    """Return a complete dataset directory for ``data``, preparing and caching it on first use; ``progress``: where
    the preparation's progress bar goes (None: none).

    Every rank on a node may call this at once: an exclusive file lock lets the first prepare
    the dataset while the others wait and then find it complete.
    """
    tokenizer = None
    if data.tokenizer is not None:
        where = f"data.tokenizer={data.tokenizer}"
        tokenizer = load_tokenizer(data.tokenizer)
        check_vocab_fit(tokenizer, where, vocab_size)
        check_eos(tokenizer, where)
    if data.dataset_dir is not None:
        d = Path(data.dataset_dir).expanduser()
        meta = load_meta(d, rebuild_hint(d, vocab_size, tokenizer=data.tokenizer))
        if tokenizer is not None and (sha := tokenizer_sha256(d, meta)) != tokenizer.sha256:
            raise DataError(
                f"{where} (sha256 {tokenizer.sha256[:12]}) is not the tokenizer data.dataset_dir={d} was prepared "
                f"with (its {meta['tokenizer_file']}, sha256 {sha[:12]}); drop data.tokenizer to use the dataset's "
                f"own, or prepare the dataset again: python tools/prepare_data.py --text YOUR_TEXT --out DIR "
                f"--tokenizer {data.tokenizer}"
            )
        if meta["vocab_size"] > vocab_size:
            raise DataError(
                f"dataset vocab {meta['vocab_size']} > model.vocab_size {vocab_size}; "
                f"set model.vocab_size >= {meta['vocab_size']} or prepare the dataset again"
            )
        return d

    files = collect_text_files(data.text, data.suffixes) if data.text is not None else default_corpus_files()
    if not files:
        raise DataError("the embedded corpus (the standard library's source) was not found; set data.text")
    key = _cache_key(files, vocab_size, data.tokenizer_lines, tokenizer, data.text_field)[:16]
    cache = Path(data.cache_dir).expanduser()
    out_dir = cache / key
    if (out_dir / "meta.json").is_file():
        return out_dir
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / f"{key}.lock", "w")
    except OSError as e:
        raise DataError(
            f"cannot write the dataset cache data.cache_dir={data.cache_dir}: {e.strerror}; "
            "set data.cache_dir to a writable directory"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (out_dir / "meta.json").is_file():
                # Holding the lock, nobody else is building this key: leftovers are from a crash.
                for stale in cache.glob(f"{key}.tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                mb = sum(p.stat().st_size for p in files) / 1e6
                log(f"preparing dataset: {counted(len(files), 'file')}, {mb:.1f} MB -> {out_dir} (first run only)")
                how = {"text_field": data.text_field, "workers": data.workers, "progress": progress}
                how["max_bad_fraction"] = data.max_bad_fraction
                if tokenizer is None:
                    prepare_dataset(files, out_dir, vocab_size, data.tokenizer_lines, log=log, **how)
                else:
                    prepare_dataset(files, out_dir, tokenizer=tokenizer, log=log, **how)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out_dir
