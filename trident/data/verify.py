"""Each shard of a prepared dataset checked against the sha256 its record holds, once per run, before a damaged
shard can train a model without a word.

A corpus of up to ``SYNC_BYTES`` is hashed in full when the run opens it (a second at most), before any
collective: every rank finds the same damage and says so. A larger one is hashed by a background thread while
training runs, so a start never waits minutes; every read of the corpus (``ShardedTokens.read``, on the loader's
thread) first asks whether the thread found a damaged shard, and stops the run with the shard's name and how to
rebuild it. Training reads windows in shuffled order, so waiting for the shards a step needs would mean waiting for
most of the corpus; a large corpus is therefore caught within the steps it takes to hash it, not before step 1.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

from trident.data.meta import damaged
from trident.data.store import SHARDS, file_sha256
from trident.errors import DataError

# Corpora of at most this many bytes (about a second of hashing) are checked in full before training starts.
SYNC_BYTES = 1 << 30


class ShardCheck:
    """The shards of ``records`` (a dataset's meta.json ``shards``) checked against their recorded sha256s."""

    def __init__(self, dataset_dir: Path, records: list[dict], rebuild: str):
        self.rebuild = rebuild
        self.files = [
            (dataset_dir / SHARDS / f"{r['name']}.{ext}", r.get(key))
            for r in records
            for ext, key in (("bin", "sha256"), ("idx", "index_sha256"))
            if r.get(key) is not None
        ]
        self.failure: DataError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path, _ in self.files)

    def run(self) -> None:
        """Hash every shard now; raise the first damage found."""
        _hash_all(self.files, self.rebuild, self, threading.Event())
        self.raise_if_damaged()

    def start(self) -> None:
        """Hash every shard in a background thread, which stops at the first damage (``raise_if_damaged`` raises
        it) and when this object is dropped."""
        stop = self._stop
        me = weakref.ref(self)  # the thread must not keep the dataset alive
        args = (self.files, self.rebuild, me, stop)
        self._thread = threading.Thread(target=_hash_all, args=args, name="trident-shard-check", daemon=True)
        self._thread.start()
        weakref.finalize(self, stop.set)

    def wait(self, timeout: float | None = None) -> None:
        """Until the background thread has hashed every shard (or found damage)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def raise_if_damaged(self) -> None:
        if self.failure is not None:
            raise self.failure


def _hash_all(files: list[tuple[Path, str]], rebuild: str, owner: object, stop: threading.Event) -> None:
    for path, want in files:
        if stop.is_set():
            return
        try:
            got = file_sha256(path)
        except OSError as e:
            error = damaged(path, f"unreadable: {e.strerror or e}", rebuild)
        else:
            if got == want:
                continue
            error = damaged(path, f"sha256 {got[:12]}, but its record says {want[:12]}", rebuild)
        target = owner() if isinstance(owner, weakref.ref) else owner
        if target is not None:
            target.failure = error  # type: ignore[attr-defined]
        return


def check_shards(dataset_dir: Path, records: list[dict], rebuild: str) -> ShardCheck:
    """Check a dataset's shards: a small corpus now (raises DataError), a large one in the background."""
    check = ShardCheck(dataset_dir, records, rebuild)
    if check.total_bytes() <= SYNC_BYTES:
        check.run()
    else:
        check.start()
    return check
