"""Where documents come from: text files (one document each) and corpus files of many documents each, JSON Lines
(``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``) and Parquet, the text under a field (``data.text_field``).

A ``FilePiece`` is a part of one file: a whole file, a byte range of a plain ``.jsonl`` (lines starting inside it), or
a range of a Parquet file's row groups. ``read_piece`` streams its records: a document's text, or a ``BadRecord``
(malformed JSON, no text field, a field that is not a string, bytes that are not UTF-8) naming its file and line
(row for Parquet). Nothing is read whole: lines one by one, Parquet a batch of rows at a time.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trident.errors import DataError

TEXT, JSONL, JSONL_GZ, JSONL_ZST, PARQUET = "text", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"
# Corpus files: picked up in directories whatever data.suffixes says.
CORPUS_SUFFIXES = (JSONL, JSONL_GZ, JSONL_ZST, PARQUET)
_PARQUET_BATCH_ROWS = 1024
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def kind_of(path: str | Path) -> str:
    """The reader a file takes, by its name: one of CORPUS_SUFFIXES, or TEXT (one document per file)."""
    name = str(path)
    return next((s for s in CORPUS_SUFFIXES if name.endswith(s)), TEXT)


def collect_text_files(paths: list[str], suffixes: list[str]) -> list[Path]:
    """Expand files, directories (searched for ``suffixes`` and the corpus suffixes) and globs into a sorted list."""
    found: set[Path] = set()
    wanted = (*suffixes, *CORPUS_SUFFIXES)
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
                files.update(p for p in path.rglob("*") if p.name.endswith(wanted) and p.is_file())
            elif path.is_file():
                files.add(path)
        if not files:
            raise DataError(
                f"data.text: {entry!r} has no files ending in {', '.join(wanted)}; "
                "add text files or change data.suffixes"
            )
        found.update(p.resolve() for p in files)
    if not found:
        raise DataError("data.text names no files; point it at text files or directories")
    return sorted(found)


def default_corpus_files() -> list[Path]:
    """The embedded corpus: the standard library's own source (~12 MB), present wherever Python is."""
    files = []
    for d, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = [x for x in dirs if x not in _EXCLUDED_DIRS]  # site-packages alone can be gigabytes
        files += [Path(d, n) for n in names if n.endswith(".py")]
    return sorted(files)


@dataclass(frozen=True)
class FilePiece:
    """Part of one file: ``[start, stop)`` bytes of a plain .jsonl or row groups of a .parquet; None: all of it.
    ``size`` is the input bytes it covers (progress and unit sizes); ``mtime_ns`` and ``file_size`` identify the
    file's version."""

    path: str
    kind: str
    size: int
    file_size: int
    mtime_ns: int
    start: int | None = None
    stop: int | None = None

    def describe(self) -> str:
        where = "" if self.start is None else f"[{self.start}:{self.stop}]"
        return f"{self.path}{where} {self.kind} {self.file_size} {self.mtime_ns}"


@dataclass(frozen=True)
class BadRecord:
    path: str
    line: int  # 1-based line of a JSON Lines file, or 1-based row of a Parquet file
    what: str

    def __str__(self) -> str:
        unit = "row" if self.path.endswith(PARQUET) else "line"
        return f"{self.path} {unit} {self.line}: {self.what}"


def pieces_of(path: Path, unit_bytes: int) -> list[FilePiece]:
    """``path`` cut at about ``unit_bytes``: plain .jsonl by byte ranges (at line boundaries when read), Parquet by
    row groups; every other file is one piece (a compressed stream cannot be entered in the middle)."""
    st = path.stat()
    kind = kind_of(path)
    base = {"path": str(path), "kind": kind, "file_size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if kind == JSONL and st.st_size > unit_bytes:
        cuts = list(range(0, st.st_size, unit_bytes)) + [st.st_size]
        return [FilePiece(size=b - a, start=a, stop=b, **base) for a, b in zip(cuts, cuts[1:], strict=False)]
    if kind == PARQUET:
        meta = _parquet_file(path).metadata
        sizes = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
        pieces, first, acc = [], 0, 0
        for i, size in enumerate(sizes):
            acc += size
            if acc >= unit_bytes or i == len(sizes) - 1:
                # The file's bytes shared out by the groups' share of the uncompressed size.
                share = st.st_size * acc // max(1, sum(sizes))
                pieces.append(FilePiece(size=share, start=first, stop=i + 1, **base))
                first, acc = i + 1, 0
        return pieces or [FilePiece(size=st.st_size, start=0, stop=0, **base)]
    return [FilePiece(size=st.st_size, **base)]


class Reader:
    """Streams one piece's records; ``done`` is the input bytes consumed so far (for the progress bar)."""

    def __init__(self, piece: FilePiece, text_field: str):
        self.piece, self.field, self.done = piece, text_field, 0

    def records(self) -> Iterator[str | BadRecord]:
        kind = self.piece.kind
        if kind == TEXT:
            yield Path(self.piece.path).read_text(encoding="utf-8", errors="replace")
            self.done = self.piece.size
        elif kind == PARQUET:
            yield from self._parquet()
        else:
            yield from self._jsonl()

    def _jsonl(self) -> Iterator[str | BadRecord]:
        p = self.piece
        with open(p.path, "rb") as raw:
            first_line = 1
            if p.start:  # the first line starting at or after ``start``: skip the rest of the line before it
                raw.seek(p.start - 1)
                raw.readline()
                first_line = None  # counted only if a bad record needs it
            begin = raw.tell()
            stream = _decompressed(raw, p.kind)
            for offset, line in enumerate(stream):
                if p.stop is not None and raw.tell() - len(line) >= p.stop and p.kind == JSONL:
                    # Plain files only: ``raw`` is the stream read, so its position is exact (unbuffered below).
                    break
                self.done = min(p.size, raw.tell() - (p.start or 0))
                if not line.strip():
                    continue
                record = self._json_record(line)
                if isinstance(record, str):
                    yield record
                    continue
                if first_line is None:
                    first_line = _count_lines(p.path, begin) + 1
                yield BadRecord(p.path, first_line + offset, record.what)
        self.done = p.size

    def _json_record(self, line: bytes) -> str | BadRecord:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            return BadRecord("", 0, f"not UTF-8 (byte {e.start})")
        try:
            record = json.loads(text)
        except ValueError as e:
            return BadRecord("", 0, f"not JSON ({' '.join(str(e).split())})")
        if not isinstance(record, dict):
            return BadRecord("", 0, f"not a JSON object but {_json_type(record)}")
        if self.field not in record:
            return BadRecord("", 0, f"no field {self.field!r}")
        value = record[self.field]
        if not isinstance(value, str):
            return BadRecord("", 0, f"field {self.field!r} is {_json_type(value)}, not a string")
        return value

    def _parquet(self) -> Iterator[str | BadRecord]:
        p = self.piece
        pf = _parquet_file(Path(p.path))
        meta = pf.metadata
        groups = list(range(p.start or 0, p.stop if p.stop is not None else meta.num_row_groups))
        row = sum(meta.row_group(i).num_rows for i in range(groups[0] if groups else 0)) + 1
        total = max(1, sum(meta.row_group(i).num_rows for i in groups))
        seen = 0
        if not groups:
            return
        if pf.schema_arrow.get_field_index(self.field) < 0:
            for i in range(total):
                yield BadRecord(p.path, row + i, f"no column {self.field!r}")
            self.done = p.size
            return
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=groups, columns=[self.field]):
            for value in batch.column(0).to_pylist():
                if isinstance(value, bytes):
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError as e:
                        value = BadRecord(p.path, row, f"not UTF-8 (byte {e.start})")
                if isinstance(value, str | BadRecord):
                    yield value
                else:
                    what = "null" if value is None else f"{type(value).__name__}, not a string"
                    yield BadRecord(p.path, row, f"column {self.field!r} is {what}")
                row += 1
            seen += batch.num_rows
            self.done = p.size * seen // total
        self.done = p.size


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = {int: "a number", float: "a number", str: "a string", list: "an array", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _decompressed(raw: io.BufferedReader, kind: str) -> Iterator[bytes]:
    if kind == JSONL_GZ:
        return gzip.GzipFile(fileobj=raw)
    if kind == JSONL_ZST:
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return _lines(raw)


def _lines(raw: io.BufferedReader) -> Iterator[bytes]:
    """Lines of a plain file read so that ``raw.tell()`` stays exact after each (``for line in raw`` reads ahead)."""
    while line := raw.readline():
        yield line


def _count_lines(path: str, end: int) -> int:
    """Newlines in the first ``end`` bytes of ``path``: the line number before a byte range."""
    n = 0
    with open(path, "rb") as f:
        while end > 0 and (block := f.read(min(end, 1 << 24))):
            n += block.count(b"\n")
            end -= len(block)
    return n


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:  # a dependency of the package; only a broken install lacks it
        raise DataError(f"{path}: reading Parquet needs pyarrow; pip install pyarrow") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses on a damaged file
        raise DataError(f"{path} is not a readable Parquet file: {' '.join(str(e).split())}") from None
