"""One plan per node: the ranks of a ``parallel.auto`` launch each plan alike (trident/plan/auto.py), so the first
to get here plans and leaves its answer, and the others, waiting on the same lock, read it.

The answer is filed under a digest of everything the plan reads: the composed config, the world, the layout keys
given, the profile (the calibration it ranks with) and the source of the code that plans (its files' sizes and
times). A change to any of them is another file, so an answer is never read for a question it did not answer. The
lock is ``flock``: the kernel releases it when its holder exits, so a rank that dies while planning leaves the lock
to the next, which plans itself; nothing waits on a rank that is gone. A cache that cannot be written (a read-only
home) costs each rank its own plan, nothing more. At most ``KEEP`` answers are kept, the oldest removed first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import trident

PLANS = Path("~/.cache/trident/plans")
KEEP = 64


def source_stamp() -> str:
    """The planning code's identity: every Python file of trident, parallel/ and models/ with its size and time."""
    here = Path(trident.__file__).parent  # in a wheel parallel/ and models/ are inside it; in a checkout beside it
    roots = {here, *(Path(p) / name for p in trident.__path__ for name in ("parallel", "models"))}
    files = sorted(f for r in roots if r.is_dir() for f in r.rglob("*.py"))
    return "\n".join(f"{f} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in files)


def digest(*parts: object) -> str:
    """A file name for the question ``parts`` ask (their reprs, then the code's stamp)."""
    h = hashlib.sha256()
    for part in (*parts, source_stamp()):
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """Hold ``path``'s lock (True), or nothing when the lock file cannot be made (False)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _prune(folder: Path) -> None:
    answers = sorted(folder.glob("*.json"), key=lambda f: f.stat().st_mtime)
    for old in answers[:-KEEP]:
        with contextlib.suppress(OSError):
            old.unlink()
            old.with_suffix(".lock").unlink()


def once_per_node(key: str, compute: Callable[[], dict], folder: Path = PLANS) -> dict:
    """``compute()``'s JSON answer for ``key``: read when a rank before this one left it, else computed and left."""
    folder = folder.expanduser()
    answer = folder / f"{key}.json"
    with _locked(folder / f"{key}.lock") as held:
        if held:
            with contextlib.suppress(OSError, ValueError):
                return json.loads(answer.read_text())
        result = compute()
        if held:
            with contextlib.suppress(OSError):
                tmp = answer.with_name(f"{answer.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(result))
                os.replace(tmp, answer)
                _prune(folder)
        return result
