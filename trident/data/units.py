"""Work units: the corpus cut into parts by the input alone, so unit k (and so shard k) is the same whatever the
number of workers.

Files are taken in order and cut into pieces of about ``unit_bytes`` (a large plain .jsonl by byte ranges, a
Parquet file by row groups, anything else whole: ``sources.pieces_of``); consecutive pieces are then grouped into
units of at most ``unit_bytes`` (a piece alone may be more), so a directory of small text files makes a few units,
not one per file. A unit's ``key`` names exactly the work it stands for (its pieces with each file's size and
mtime, the tokenizer, the text field): a rerun reuses a shard only when its key is the same.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from trident.data.sources import FilePiece, pieces_of

UNIT_BYTES = 32 << 20


@dataclass(frozen=True)
class Unit:
    index: int
    pieces: tuple[FilePiece, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)

    def key(self, salt: str) -> str:
        h = hashlib.sha256(salt.encode())
        for p in self.pieces:
            h.update(b"\0" + p.describe().encode())
        return h.hexdigest()


def plan_units(files: list[Path], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    units: list[Unit] = []
    group: list[FilePiece] = []
    size = 0
    for path in files:
        for piece in pieces_of(path, unit_bytes):
            if group and size + piece.size > unit_bytes:
                units.append(Unit(len(units), tuple(group)))
                group, size = [], 0
            group.append(piece)
            size += piece.size
    if group:
        units.append(Unit(len(units), tuple(group)))
    return units
