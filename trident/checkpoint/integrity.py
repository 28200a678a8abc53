"""Checksums of a checkpoint's files: recorded when it is saved, verified when it is read.

Every file a save writes is listed in ``meta.json``'s ``files`` with its size and CRC-32 (zlib's, which runs at
about 1.5 GB/s here and releases the GIL, so a background save hashes beside training; any single flipped bit or
burst of up to 32 changes it). Each rank hashes the tensor files it wrote itself, right after writing them, while
their pages are still in memory; rank 0 hashes the small files it adds when it publishes the directory
(files.py). ``meta.json`` itself is not listed: it is written last and a damaged one makes the checkpoint
incomplete (files.py ``is_complete``).

Reading verifies before any tensor is loaded: the ranks of a run share the files (file i by rank i mod world, so a
large checkpoint is read once, not once per rank) and agree on the first damaged one (``damage``). A checkpoint
written before checksums were recorded has no ``files`` and loads unverified, said once (``UNRECORDED``).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from trident.errors import CheckpointError

RECORD = "files"  # the key of meta.json that holds {file name: {"bytes": n, "crc32": "%08x"}}
_CHUNK = 16 * 2**20


def file_digest(path: Path) -> dict:
    """The size and CRC-32 of one file, read in 16 MiB pieces."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while piece := f.read(_CHUNK):
            crc, size = zlib.crc32(piece, crc), size + len(piece)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def digests(directory: Path, names: list[str]) -> dict[str, dict]:
    """``file_digest`` of each of ``names`` in ``directory``, by name."""
    return {name: file_digest(directory / name) for name in names}


def read_record(path: Path) -> dict[str, dict] | None:
    """The checksums a checkpoint's meta.json records, or None for one written before they were (unverifiable)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint file {path / 'meta.json'}: {e}") from None
    record = meta.get(RECORD) if isinstance(meta, dict) else None
    if record is None:
        return None
    if not isinstance(record, dict) or not all(_well_formed(v) for v in record.values()):
        raise CheckpointError(f"checkpoint {path}: meta.json's {RECORD!r} is not a list of file checksums")
    return record


def _well_formed(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("crc32"), str)


def damage(path: Path, record: dict[str, dict], rank: int = 0, world: int = 1) -> str | None:
    """The first file of this rank's share of ``record`` (file i of the sorted names, for i mod ``world`` ==
    ``rank``) whose size or checksum differs from the record, as one line; None if all match."""
    for name in sorted(record)[rank::world]:
        want = record[name]
        file = path / name
        try:
            got = file_digest(file)
        except FileNotFoundError:
            return f"checkpoint {path} is damaged: {name} is missing"
        except OSError as e:
            return f"checkpoint {path} is damaged: cannot read {name}: {e.strerror or e}"
        if got["bytes"] != want["bytes"]:
            return f"checkpoint {path} is damaged: {name} is {got['bytes']} bytes, its record says {want['bytes']}"
        if got["crc32"] != want["crc32"]:
            return (
                f"checkpoint {path} is damaged: {name} has CRC-32 {got['crc32']}, its record says {want['crc32']} "
                "(its bytes changed after it was saved)"
            )
    return None


UNRECORDED = "note: checkpoint {path} has no checksums (written before trident recorded them): loaded unverified"


def verify(path: Path, rank: int = 0, world: int = 1) -> bool:
    """Raise ``CheckpointError`` naming the first damaged file of this rank's share; return False if the checkpoint
    records no checksums (nothing to verify), True if its share is intact. For one process alone (the tools):
    ``verify(path)`` checks every file."""
    record = read_record(path)
    if record is None:
        return False
    problem = damage(path, record, rank, world)
    if problem is not None:
        raise CheckpointError(problem)
    return True
