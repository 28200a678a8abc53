"""Checksums of a checkpoint's files: recorded when it is saved, verified when it is read.

``meta.json``'s ``files`` lists every other file with its size and CRC-32 (zlib's: ~1.4 GB/s here, GIL released,
so a background save hashes beside training). Each rank hashes the tensor files it wrote, right after writing them;
rank 0 the small files it adds on publishing (files.py). Reading verifies before any tensor is loaded, the ranks
sharing the files (file i by rank i mod world) and agreeing on the first damaged one. A checkpoint written before
the record has no ``files`` and loads unverified, said once (``UNRECORDED``).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch.distributed as dist

from trident.errors import CheckpointError
from trident.parallel.agree import on_every_rank

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
    ok = lambda e: isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("crc32"), str)  # noqa: E731
    if record is not None and not (isinstance(record, dict) and all(ok(v) for v in record.values())):
        raise CheckpointError(f"checkpoint {path}: meta.json's {RECORD!r} is not a list of file checksums")
    return record


def damage(path: Path, record: dict[str, dict], rank: int = 0, world: int = 1) -> str | None:
    """The first file of this rank's share (sorted names, i mod ``world`` == ``rank``) unlike its record, in a line."""
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


def verify_everywhere(path: Path) -> bool:
    """``verify``, every rank checking its share and all raising the first damage; one process alone: every file."""
    if not dist.is_initialized():
        return verify(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    return on_every_rank(lambda: verify(path, rank, world), f"verify checkpoint {path}")
