"""Turn text files into a training dataset: a tokenizer plus one flat array of token ids.

A dataset directory holds its tokenizer under the tokenizer's own file name (``tokenizer.model``, a
sentencepiece model trident trained or was given, or a Hugging Face ``tokenizer.json``), ``tokens.bin``
(every document's ids followed by eos, back to back) and ``meta.json``, which records the tokenizer
(file name, sha256, vocab_size, eos_id). It is built in a temporary sibling directory and renamed into
place, with ``meta.json`` written last, so a crash never leaves something that looks complete.
Datasets from before ``meta.json`` named its tokenizer hold ``tokenizer.model`` and stay readable.

``resolve_dataset`` is what training calls: it either checks a dataset made by
``tools/prepare_data.py`` or prepares one from ``data.text`` (or the standard library's source)
into a cache keyed by the files and the tokenizer (its settings when trained, its sha256 when given
by ``data.tokenizer``), so only the first run pays for it.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import io
import json
import os
import random
import secrets
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import sentencepiece as spm

from trident.config import DataConfig
from trident.data.tokenizer import (
    EOS_TOKENS,
    FILE_NAMES,
    HF,
    SENTENCEPIECE,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
)
from trident.errors import ConfigError, DataError

FORMAT = 1
# Every file a dataset directory may hold: one of the tokenizer files, besides meta.json and tokens.bin.
DATASET_FILES = ("meta.json", "tokens.bin", *FILE_NAMES)
# Byte fallback reserves 256 byte pieces; unk and eos come on top, and at least one character.
MIN_VOCAB = 256 + 2 + 1
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
# Texts are encoded in groups of about this many characters to bound memory on large corpora.
_ENCODE_CHUNK_CHARS = 32 << 20

Log = Callable[[str], None]


def default_corpus_files() -> list[Path]:
    """The embedded corpus: the standard library's own source (~12 MB), present wherever Python is."""
    files = []
    for d, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = [x for x in dirs if x not in _EXCLUDED_DIRS]  # site-packages alone can be gigabytes
        files += [Path(d, n) for n in names if n.endswith(".py")]
    return sorted(files)


def collect_text_files(paths: list[str], suffixes: list[str]) -> list[Path]:
    """Expand files, directories (searched for ``suffixes``) and globs into a sorted list of files."""
    found: set[Path] = set()
    for entry in paths:
        expanded = os.path.expanduser(entry)
        if os.path.exists(expanded):
            matches = [Path(expanded)]
        else:
            matches = [Path(m) for m in glob.glob(expanded, recursive=True)]
        if not matches:
            if glob.has_magic(expanded):
                raise DataError(f"data.text: {entry!r} matches no files; point data.text at text files")
            raise DataError(f"data.text: {entry!r} does not exist; point data.text at text files or directories")
        files: set[Path] = set()
        for path in matches:
            if path.is_dir():
                files.update(p for p in path.rglob("*") if p.suffix in suffixes and p.is_file())
            elif path.is_file():
                files.add(path)
        if not files:
            raise DataError(
                f"data.text: {entry!r} has no files ending in {', '.join(suffixes)}; "
                "add text files or change data.suffixes"
            )
        found.update(p.resolve() for p in files)
    if not found:
        raise DataError("data.text names no files; point it at text files or directories")
    return sorted(found)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _sample_lines(files: list[Path], k: int, seed: int) -> list[str]:
    """A uniform sample of ``k`` non-empty lines (reservoir sampling: one pass, memory of ``k`` lines).

    Sampling here rather than in sentencepiece keeps the tokenizer a function of the text and seed
    alone; sentencepiece's own shuffle differs from run to run, and every node that prepares the
    same data must get the same tokenizer.
    """
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for path in files:
        for line in _read(path).splitlines():
            if not line.strip():
                continue
            if seen < k:
                sample.append(line)
            else:
                j = rng.randrange(seen + 1)
                if j < k:
                    sample[j] = line
            seen += 1
    return sample


def _train_tokenizer(files: list[Path], vocab_size: int, tokenizer_lines: int, seed: int) -> bytes:
    """The serialized model of a BPE tokenizer trained on a sample of the lines of ``files``."""
    lines = _sample_lines(files, tokenizer_lines, seed)
    if not lines:
        raise DataError(f"the {len(files)} text files are empty; add text")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            # Identity normalization and kept whitespace make decode(encode(text)) == text for code.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            # The merges depend on the thread count; one thread makes them the same on every machine
            # and costs little (BPE training on the 12 MB stdlib takes about two seconds).
            num_threads=1,
            minloglevel=2,
            max_sentence_length=16384,
            unk_id=0,
            bos_id=-1,
            eos_id=1,
            pad_id=-1,
        )
    except RuntimeError as e:
        msg = str(e)
        if "too high" in msg:
            raise DataError(
                f"vocab_size {vocab_size} is too large for this text; lower model.vocab_size or add more text"
            ) from None
        if "smaller than required_chars" in msg:
            need = msg.rsplit(" vs ", 1)[-1].split(".")[0]
            raise DataError(
                f"vocab_size {vocab_size} is too small for this text: its characters need at least {need}; "
                "raise model.vocab_size"
            ) from None
        raise
    return model.getvalue()


def token_dtype(vocab_size: int) -> type:
    """The narrowest unsigned type holding ids below ``vocab_size``: uint16 up to 65536, else uint32 (Llama 3)."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _encode(files: list[Path], tokenizer: Tokenizer, out: Path, dtype: type) -> tuple[int, int]:
    """Append each non-empty document's ids and eos to ``out``; return (tokens, documents)."""
    eos = tokenizer.eos_id
    n_tokens = n_docs = 0

    def flush(texts: list[str], f) -> None:
        nonlocal n_tokens, n_docs
        for ids in tokenizer.encode_batch(texts):
            ids = np.asarray([*ids, eos], dtype=np.int64)
            if ids.min() < 0 or ids.max() >= tokenizer.vocab_size:  # a tokenizer.json may map text to a stray id
                bad = int(ids.max() if ids.max() >= tokenizer.vocab_size else ids.min())
                raise DataError(
                    f"tokenizer {tokenizer.file_name} gave id {bad}, outside its vocabulary of {tokenizer.vocab_size}; "
                    "the tokenizer file is inconsistent: use another"
                )
            ids.astype(dtype).tofile(f)
            n_tokens += len(ids)
            n_docs += 1

    with open(out, "wb") as f:
        texts: list[str] = []
        chars = 0
        for path in files:
            text = _read(path)
            if not text:
                continue
            texts.append(text)
            chars += len(text)
            if chars >= _ENCODE_CHUNK_CHARS:
                flush(texts, f)
                texts, chars = [], 0
        flush(texts, f)
    return n_tokens, n_docs


def _check_eos(tokenizer: Tokenizer, where: str) -> None:
    """A dataset ends every document with eos: a tokenizer without one cannot make it."""
    if tokenizer.eos_id is None:
        which = "its eos id is -1" if tokenizer.file_name == SENTENCEPIECE else f"none of {' '.join(EOS_TOKENS)}"
        raise DataError(
            f"tokenizer {where} has no end-of-text token ({which}), and a dataset ends every document with one; "
            "use a tokenizer that has one"
        )


def check_vocab_fit(tokenizer: Tokenizer, where: str, vocab_size: int) -> None:
    """The model's embedding must have a row for every id of the tokenizer (more rows are fine: unused)."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {where} has a vocabulary of {tokenizer.vocab_size} but model.vocab_size is {vocab_size}; "
            f"set model.vocab_size>={tokenizer.vocab_size}"
        )


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
) -> Path:
    """Tokenize ``files`` and write the dataset to ``out_dir``, with ``tokenizer`` when given, else with a BPE
    tokenizer of ``vocab_size`` pieces trained on them (``tokenizer_lines`` and ``seed`` are its settings).

    A trained tokenizer has byte fallback: every byte sequence encodes losslessly, so any text file works
    and indentation, tabs and newlines survive a round trip.
    """
    if (vocab_size is None) == (tokenizer is None):
        raise ValueError("prepare_dataset takes exactly one of vocab_size (train a tokenizer) and tokenizer")
    if not files:
        raise DataError("no text files to prepare; point data.text at text files or directories")
    if tokenizer is not None:
        _check_eos(tokenizer, tokenizer.file_name)
    elif vocab_size < MIN_VOCAB:
        raise DataError(
            f"vocab_size {vocab_size} is too small: a byte-fallback tokenizer needs at least {MIN_VOCAB} "
            "(256 bytes, unk, eos and the text's characters); raise model.vocab_size"
        )
    source_bytes = sum(p.stat().st_size for p in files)
    if source_bytes == 0:
        raise DataError(f"the {len(files)} text files are empty; add text")
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        if tokenizer is None:
            log(f"training a {vocab_size}-piece BPE tokenizer on up to {tokenizer_lines:,} lines")
            tokenizer = SentencePieceTokenizer(_train_tokenizer(files, vocab_size, tokenizer_lines, seed))
        (tmp / tokenizer.file_name).write_bytes(tokenizer.data)
        dtype = token_dtype(tokenizer.vocab_size)
        log(f"tokenizing {len(files)} files ({source_bytes / 1e6:.1f} MB) with {tokenizer.file_name}")
        n_tokens, n_docs = _encode(files, tokenizer, tmp / "tokens.bin", dtype)
        meta = {
            "format": FORMAT,
            "vocab_size": tokenizer.vocab_size,
            "dtype": np.dtype(dtype).name,
            "n_tokens": n_tokens,
            "eos_id": tokenizer.eos_id,
            "tokenizer_file": tokenizer.file_name,
            "tokenizer_sha256": tokenizer.sha256,
            "n_documents": n_docs,
            "sources": [str(p) for p in files],
            "source_bytes": source_bytes,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        _install(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# The fields of meta.json that reading a dataset relies on, with their types.
_META_FIELDS = {"vocab_size": int, "eos_id": int, "n_tokens": int, "dtype": str}
# The fields that name its tokenizer, with what a dataset from before them means (its tokenizer.model, no sha256).
_TOKENIZER_FIELDS = {"tokenizer_file": (str, SENTENCEPIECE), "tokenizer_sha256": (str, None)}


def rebuild_hint(
    dataset_dir: Path, vocab_size: int | str = "N", cached: bool = False, tokenizer: str | None = None
) -> str:
    """The command that makes a damaged dataset anew: a cached one is simply prepared again on the next run.

    A dataset of a given tokenizer (``tokenizer``: data.tokenizer, or a dataset holding a tokenizer.json) is made
    again with ``--tokenizer``, a trained one with ``--vocab-size``."""
    if cached:
        return f"rm -r {dataset_dir} and run again to prepare it anew"
    if tokenizer is None and (Path(dataset_dir).expanduser() / HF).is_file():
        tokenizer = "YOUR_TOKENIZER"
    how = f"--vocab-size {vocab_size}" if tokenizer is None else f"--tokenizer {tokenizer}"
    return f"python tools/prepare_data.py --text YOUR_TEXT --out {dataset_dir} {how}"


def damaged(path: Path, what: str, rebuild: str) -> DataError:
    return DataError(f"dataset file {path} is damaged ({what}); rebuild it: {rebuild}")


def load_meta(dataset_dir: str | Path, rebuild: str | None = None) -> dict:
    """Read and check a dataset's ``meta.json``; a directory that is not a complete dataset is a DataError.

    ``rebuild`` is the command the error suggests (default: tools/prepare_data.py into the same directory).
    """
    d = Path(dataset_dir).expanduser()
    missing = [name for name in ("meta.json", "tokens.bin") if not (d / name).is_file()]
    if not any((d / name).is_file() for name in FILE_NAMES):
        missing.append(SENTENCEPIECE)  # the tokenizer of any dataset from before tokenizer_file
    if missing:
        raise DataError(
            f"data.dataset_dir {str(d)!r} is not a prepared dataset (missing {', '.join(missing)}); "
            "run tools/prepare_data.py --out DIR to make one"
        )
    rebuild = rebuild or rebuild_hint(d)
    path = d / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise damaged(path, f"not JSON: {' '.join(str(e).split())}", rebuild) from None
    if not isinstance(meta, dict):
        raise damaged(path, "not a JSON object", rebuild)
    if meta.get("format") != FORMAT:
        raise DataError(
            f"dataset {d} has format {meta.get('format')}, this version reads format {FORMAT}; "
            f"prepare it again: {rebuild}"
        )
    for key, kind in _META_FIELDS.items():
        if not isinstance(meta.get(key), kind):
            raise damaged(path, f"no {kind.__name__} {key}", rebuild)
    try:
        np.dtype(meta["dtype"])
    except TypeError:
        raise damaged(path, f"unknown dtype {meta['dtype']!r}", rebuild) from None
    for key, (kind, default) in _TOKENIZER_FIELDS.items():
        meta.setdefault(key, default)
        if meta[key] is not None and not isinstance(meta[key], kind):
            raise damaged(path, f"no {kind.__name__} {key}", rebuild)
    if meta["tokenizer_file"] not in FILE_NAMES:
        raise damaged(path, f"tokenizer_file {meta['tokenizer_file']!r} is none of {', '.join(FILE_NAMES)}", rebuild)
    if not (d / meta["tokenizer_file"]).is_file():
        raise DataError(
            f"data.dataset_dir {str(d)!r} is not a prepared dataset (missing {meta['tokenizer_file']}); "
            "run tools/prepare_data.py --out DIR to make one"
        )
    return meta


def tokenizer_sha256(dataset_dir: Path, meta: dict) -> str:
    """The sha256 of a dataset's tokenizer: as recorded, or (a dataset from before the record) of its file."""
    if meta["tokenizer_sha256"] is not None:
        return meta["tokenizer_sha256"]
    return hashlib.sha256((dataset_dir / meta["tokenizer_file"]).read_bytes()).hexdigest()


def _cache_key(files: list[Path], vocab_size: int, tokenizer_lines: int, tokenizer: Tokenizer | None = None) -> str:
    """A trained tokenizer is a function of the text and its settings; a given one is its file's sha256."""
    settings = f"{vocab_size}\0{tokenizer_lines}" if tokenizer is None else f"{tokenizer.file_name}\0{tokenizer.sha256}"
    h = hashlib.sha256(f"{FORMAT}\0{settings}".encode())
    for p in files:
        st = p.stat()
        h.update(f"\0{p}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def resolve_dataset(data: DataConfig, vocab_size: int, log: Log = print) -> Path:
    """Return a complete dataset directory for ``data``, preparing and caching it on first use.

    Every rank on a node may call this at once: an exclusive file lock lets the first prepare
    the dataset while the others wait and then find it complete.
    """
    tokenizer = None
    if data.tokenizer is not None:
        where = f"data.tokenizer={data.tokenizer}"
        tokenizer = load_tokenizer(data.tokenizer)
        check_vocab_fit(tokenizer, where, vocab_size)
        _check_eos(tokenizer, where)
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
    key = _cache_key(files, vocab_size, data.tokenizer_lines, tokenizer)[:16]
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
                log(f"preparing dataset: {len(files)} files, {mb:.1f} MB -> {out_dir} (first run only)")
                if tokenizer is None:
                    prepare_dataset(files, out_dir, vocab_size, data.tokenizer_lines, log=log)
                else:
                    prepare_dataset(files, out_dir, tokenizer=tokenizer, log=log)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out_dir
