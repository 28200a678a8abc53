"""A dataset directory as it is read: its ``meta.json`` checked before anything is opened, the error a damaged file
gives, and the command that makes a damaged dataset again. trident/data/prepare.py writes such a directory;
trident/data/dataset.py reads it.

A dataset directory (format 2) holds its tokenizer under the tokenizer's own file name (``tokenizer.model``, a
sentencepiece model trident trained or was given, or a Hugging Face ``tokenizer.json``), ``shards/`` (tokens,
document ends and a record per shard: trident/data/store.py) and ``meta.json``: the tokenizer (file name, sha256,
vocab_size, eos_id), the dtype, the sources (path, bytes, mtime), the counts (documents, tokens, records, bad
records) and the shards. Format 1 datasets (one ``tokens.bin``) stay readable, and datasets from before
``meta.json`` named its tokenizer hold ``tokenizer.model``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from trident.data.store import SHARDS
from trident.data.tokenizer import FILE_NAMES, HF, SENTENCEPIECE
from trident.errors import DataError

FORMAT = 2
READABLE_FORMATS = (1, 2)
# Every file a dataset directory may hold: one of the tokenizer files, besides meta.json and its tokens (format 2:
# shards/, format 1: tokens.bin).
DATASET_FILES = ("meta.json", SHARDS, "tokens.bin", *FILE_NAMES)
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
    missing = [name for name in ("meta.json",) if not (d / name).is_file()]
    if not any((d / name).is_file() for name in FILE_NAMES):
        missing.append(SENTENCEPIECE)  # the tokenizer of any dataset from before tokenizer_file
    if missing:
        raise _not_a_dataset(d, missing)
    rebuild = rebuild or rebuild_hint(d)
    path = d / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise damaged(path, f"not JSON: {' '.join(str(e).split())}", rebuild) from None
    if not isinstance(meta, dict):
        raise damaged(path, "not a JSON object", rebuild)
    if meta.get("format") not in READABLE_FORMATS:
        raise DataError(
            f"dataset {d} has format {meta.get('format')}, this version reads formats "
            f"{', '.join(map(str, READABLE_FORMATS))}; prepare it again: {rebuild}"
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
        raise _not_a_dataset(d, [meta["tokenizer_file"]])
    if meta["format"] == 1:
        if not (d / "tokens.bin").is_file():
            raise _not_a_dataset(d, ["tokens.bin"])
        return meta
    shards = meta.get("shards")
    fields = {"name": str, "n_tokens": int, "n_documents": int}
    if not isinstance(shards, list) or not all(
        isinstance(r, dict) and all(isinstance(r.get(k), t) for k, t in fields.items()) for r in shards
    ):
        raise damaged(path, "no list of shards with name, n_tokens and n_documents", rebuild)
    if sum(r["n_tokens"] for r in shards) != meta["n_tokens"]:
        raise damaged(path, f"its shards hold {sum(r['n_tokens'] for r in shards):,} tokens, not n_tokens", rebuild)
    return meta


def _not_a_dataset(d: Path, missing: list[str]) -> DataError:
    return DataError(
        f"data.dataset_dir {str(d)!r} is not a prepared dataset (missing {', '.join(missing)}); "
        "run tools/prepare_data.py --out DIR to make one"
    )


def tokenizer_sha256(dataset_dir: Path, meta: dict) -> str:
    """The sha256 of a dataset's tokenizer: as recorded, or (a dataset from before the record) of its file."""
    if meta["tokenizer_sha256"] is not None:
        return meta["tokenizer_sha256"]
    return hashlib.sha256((dataset_dir / meta["tokenizer_file"]).read_bytes()).hexdigest()
