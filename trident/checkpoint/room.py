"""Room on disk for a save: a full filesystem said as such, with the bytes needed against those free.

No room surfaces as ``[Errno 28] No space left on device``, or from torch.save's zip writer as ``unexpected pos
704 vs 598``: ``is_full`` knows both. Before a save, ``check`` compares the free space with the newest checkpoint's
size, so a save that cannot fit writes nothing.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from trident.errors import DiskFullError
from trident.memory.measure import format_bytes

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded|inline_container\.cc.*unexpected pos \d+ vs \d+")


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
        stack += [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]


def is_full(error: BaseException) -> bool:
    """Whether ``error`` (with its causes, and DCP's per-rank failures) is a write that found no room."""
    return any((isinstance(e, OSError) and e.errno in _FULL_ERRNOS) or _FULL_TEXT.search(str(e)) for e in _chain(error))


def mount_of(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def used_bytes(directory: Path) -> int:
    """A partial save's bytes, given back when it is removed; another rank may be removing it as it is counted, so
    files and folders that vanish mid-walk count as nothing."""
    total = 0
    for folder, _, names in os.walk(directory):  # os.walk skips a folder it can no longer list
        for name in names:
            try:
                total += os.stat(os.path.join(folder, name), follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    return total


def full_line(where: Path, needed: int, freed: int = 0) -> str:
    """``where`` (the checkpoint directory) has no room for a save of ``needed`` bytes; ``freed``: bytes the failed
    save had written, counted as free (its partial directory is removed)."""
    usage = shutil.disk_usage(where if where.exists() else where.parent)
    free, total = usage.free + freed, format_bytes(usage.total)
    said = f"had {format_bytes(free)} ({free:,} bytes) free of {total}"
    if free >= needed:  # statvfs sees room the write did not get: a quota, or no inodes left
        said = f"reports {format_bytes(free)} free of {total} but refused the write as full (a quota or its inodes?)"
    return (
        f"the disk is full: a checkpoint in {where} needs about {format_bytes(needed)} ({needed:,} bytes), and "
        f"the filesystem at {mount_of(where)} {said}"
    )


def check(root: Path, needed: int) -> None:
    """Raise ``DiskFullError`` if ``root``'s filesystem has fewer than ``needed`` bytes free."""
    if needed > shutil.disk_usage(root).free:
        raise DiskFullError(full_line(root, needed))
