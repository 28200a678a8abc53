"""A run owns its directory: one lock per run directory, and the leftovers of a killed run cleared by its owner.

The lock is ``fcntl.flock`` on ``<run dir>/.trident.lock``. The kernel releases it when the holding process
dies, however it dies, so a killed run never leaves a stale lock behind; the file keeps naming the last
holder so that a refused second run can say who has the directory.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
from pathlib import Path

import torch.distributed as dist

from trident.checkpoint.files import PARTIAL_SAVE_PATTERNS
from trident.errors import RunDirError
from trident.parallel.agree import on_one_rank

LOCK_FILE = ".trident.lock"


class RunDirLock:
    """An exclusive lock on one directory, held from ``acquire`` until ``release`` or the process's death."""

    def __init__(self, directory: Path, what: str = "run directory") -> None:
        self.directory, self.what = directory, what
        self.path = directory / LOCK_FILE
        self._file = None

    def acquire(self) -> None:
        """Take the lock or raise ``RunDirError`` naming the process that holds it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Opened without truncating: the holder's description must survive until we own the lock.
            f = open(self.path, "a+")
        except OSError as e:
            raise RunDirError(
                f"cannot write to {self.what} {self.directory}: {e.strerror}; point it at a writable directory"
            ) from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise RunDirError(
                f"{self.what} {self.directory} is in use by another run ({self._holder()}); wait for it to "
                "finish or stop it, or give this run its own directory (hydra.run.dir=...)"
            ) from None
        f.seek(0)
        f.truncate()
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
        f.write(json.dumps(holder) + "\n")
        f.flush()
        self._file = f

    def _holder(self) -> str:
        try:
            holder = json.loads(self.path.read_text())
            return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            # The holder took the lock a moment ago and has not written its name yet.
            return "a process that has not named itself yet"

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the last descriptor drops the flock
            self._file = None


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def remove_partial_saves(checkpoint_root: Path) -> list[Path]:
    """Delete what saves killed mid-write left under ``checkpoint_root``; return what was removed.

    Only the holder of the lock may call this: another run saving into the same root would lose its save.
    Complete checkpoints are never touched: their names have no leading dot.
    """
    if not checkpoint_root.is_dir():
        return []
    removed = []
    for pattern in PARTIAL_SAVE_PATTERNS:
        for path in sorted(checkpoint_root.glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def take_ownership(run_dir: Path, checkpoint_root: Path) -> list[RunDirLock]:
    """Lock the run directory (and ``checkpoint.dir`` when it lies outside it), then clear the partial saves
    of a killed run there. Called by the one rank that writes; returns the held locks, to release at the end."""
    locks = [RunDirLock(run_dir)]
    if not checkpoint_root.resolve().is_relative_to(run_dir.resolve()):
        # Two runs saving into one checkpoint.dir would overwrite each other's steps just the same.
        locks.append(RunDirLock(checkpoint_root, "checkpoint.dir"))
    held: list[RunDirLock] = []
    try:
        for lock in locks:
            lock.acquire()
            held.append(lock)
    except BaseException:
        for lock in held:
            lock.release()
        raise
    removed = remove_partial_saves(checkpoint_root)
    if removed:
        print(
            f"removed {len(removed)} unfinished checkpoint save(s) left by an interrupted run in {checkpoint_root}",
            flush=True,
        )
    return held


def claim_run_dir(run_dir: Path, checkpoint_dir: str | None, cleanup: contextlib.ExitStack) -> tuple[Path, Path]:
    """Every rank's run directory and checkpoint root, as rank 0 sees them (ranks started a second apart would
    each get a Hydra directory of their own), and rank 0's locks on them, released when ``cleanup`` closes.
    Rank 0 writes the checkpoints, so it owns the directories for as long as it lives. Collective."""
    agreed = [str(run_dir)]
    dist.broadcast_object_list(agreed, src=0)
    run_dir = Path(agreed[0])
    root = Path(checkpoint_dir).expanduser() if checkpoint_dir else run_dir / "checkpoints"
    locks = on_one_rank(lambda: take_ownership(run_dir, root), 0, f"lock the run directory {run_dir}")
    for lock in locks or []:
        cleanup.callback(lock.release)
    return run_dir, root
