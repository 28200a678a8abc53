"""The sharded token store: a dataset's tokens as many files, read as one sequence.

Shard k (``shards/00007.bin`` for k = 7) holds the tokens of work unit k: each document's ids followed by eos, back
to back, in the dataset's dtype. ``shards/00007.idx`` holds where each of its documents ends (little-endian int64,
counted in tokens from the shard's start, so document i is ``[ends[i-1], ends[i])``), and ``shards/00007.json`` is
the shard's record (its counts, the sha256 of both files, the key of the work that made it). A shard is written
under temporary names and renamed into place, its record last, so a record only ever describes complete files:
a killed preparation leaves finished shards that a rerun can trust, and nothing else.

``ShardedTokens`` presents the shards (memory-mapped) as one token sequence: reading a window costs a slice of one
or two maps, never a copy of the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import numpy as np

SHARDS = "shards"
INDEX_DTYPE = np.dtype("<i8")


def shard_name(k: int) -> str:
    return f"{k:05d}"


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class ShardWriter:
    """Writes shard ``k`` of ``shard_dir``: ``add`` documents, then ``finish`` (or ``abort``)."""

    def __init__(self, shard_dir: Path, k: int, dtype: np.dtype):
        self.dir, self.name, self.dtype = shard_dir, shard_name(k), np.dtype(dtype)
        tag = f"tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self.tmp = {ext: shard_dir / f"{self.name}.{ext}.{tag}" for ext in ("bin", "idx")}
        self.files = {ext: open(path, "wb") for ext, path in self.tmp.items()}
        self.sha = {ext: hashlib.sha256() for ext in self.tmp}
        self.n_tokens = self.n_documents = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents back to back: ``tokens`` (eos included) of documents ``lengths`` tokens long."""
        ends = self.n_tokens + np.cumsum(lengths, dtype=np.int64)
        for ext, data in (("bin", tokens.astype(self.dtype).tobytes()), ("idx", ends.astype(INDEX_DTYPE).tobytes())):
            self.files[ext].write(data)
            self.sha[ext].update(data)
        self.n_tokens += int(len(tokens))
        self.n_documents += int(len(lengths))

    def finish(self, record: dict) -> dict:
        """Rename the files into place and write the record (``record`` plus the counts and hashes) last."""
        for f in self.files.values():
            f.close()
        record = {
            **record,
            "name": self.name,
            "n_tokens": self.n_tokens,
            "n_documents": self.n_documents,
            "sha256": self.sha["bin"].hexdigest(),
            "index_sha256": self.sha["idx"].hexdigest(),
        }
        for ext, tmp in self.tmp.items():
            os.replace(tmp, self.dir / f"{self.name}.{ext}")
        write_atomically(self.dir / f"{self.name}.json", json.dumps(record, indent=1).encode() + b"\n")
        return record

    def abort(self) -> None:
        for f in self.files.values():
            f.close()
        for tmp in self.tmp.values():
            tmp.unlink(missing_ok=True)


def finished_shard(shard_dir: Path, k: int, key: str, dtype: np.dtype) -> dict | None:
    """Shard ``k``'s record when the shard was finished by the same work (``key``) and its files are intact."""
    name = shard_name(k)
    try:
        record = json.loads((shard_dir / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    for ext, sha, size in (
        ("bin", record.get("sha256"), record.get("n_tokens", -1) * np.dtype(dtype).itemsize),
        ("idx", record.get("index_sha256"), record.get("n_documents", -1) * INDEX_DTYPE.itemsize),
    ):
        path = shard_dir / f"{name}.{ext}"
        try:
            if path.stat().st_size != size or file_sha256(path) != sha:
                return None
        except OSError:
            return None
    return record


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


class ShardedTokens:
    """Token arrays (memory maps) seen as one sequence: ``len``, ``read`` of windows, slices and items."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = [a for a in arrays if len(a)]
        self.offsets = np.concatenate([[0], np.cumsum([len(a) for a in self.arrays], dtype=np.int64)])
        # Called before every read: raises when the shards' check (trident/data/verify.py) found damage.
        self.check: Callable[[], None] | None = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Tokens ``[s, s + length)`` for each ``s`` of ``starts``: an int64 array [len(starts), length]."""
        if self.check is not None:
            self.check()
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(np.asarray(starts, dtype=np.int64).tolist()):
            out[row] = self._span(start, start + length)
        return out

    def _span(self, start: int, stop: int) -> np.ndarray:
        if start < 0 or stop > len(self) or start > stop:
            raise IndexError(f"tokens [{start}, {stop}) are not in [0, {len(self)})")
        s = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts = []
        while start < stop:
            local = start - int(self.offsets[s])
            take = min(stop - start, len(self.arrays[s]) - local)
            parts.append(self.arrays[s][local : local + take])
            start += take
            s += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getitem__(self, key: int | slice) -> np.ndarray | int:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            return self._span(start, max(start, stop))[::step]
        i = key + len(self) if key < 0 else key
        return int(self._span(i, i + 1)[0])


def open_shards(dataset_dir: Path, records: list[dict], dtype: np.dtype) -> list[np.ndarray]:
    """The token memmap of each shard (empty arrays for shards without tokens: a zero-byte file cannot be mapped)."""
    arrays = []
    for r in records:
        path = dataset_dir / SHARDS / f"{r['name']}.bin"
        n = r["n_tokens"]
        arrays.append(np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.empty(0, dtype=dtype))
    return arrays


def document_ends(dataset_dir: Path, records: list[dict]) -> np.ndarray:
    """Where every document of the store ends, in tokens from the start of the whole sequence (int64)."""
    parts, offset = [], 0
    for r in records:
        if r["n_documents"]:
            ends = np.fromfile(dataset_dir / SHARDS / f"{r['name']}.idx", dtype=INDEX_DTYPE)
            parts.append(ends.astype(np.int64) + offset)
        offset += r["n_tokens"]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
