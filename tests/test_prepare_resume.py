"""A preparation killed half-way (a worker, or the whole command) leaves no dataset that looks complete, and the same
command again reuses the shards it finished and gives the same bytes as a preparation never stopped."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.corpus import make_corpus
from tests.helpers.processes import tool_process
from tests.helpers.warm import WarmProcess
from trident.data.prepare import prepare_dataset
from trident.errors import DataError

VOCAB = 512
UNIT = 16 << 10
KW = {"max_bad_fraction": 0.05, "unit_bytes": UNIT}


def _all_files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _finished(partial: Path) -> list[Path]:
    return sorted((partial / "shards").glob("*.json"))


def _wait_for_shards(partial: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(_finished(partial)) < n:
        assert time.monotonic() < deadline, f"{partial}: fewer than {n} shards finished in {timeout}s"
        time.sleep(0.002)


def _stamps(files: list[Path]) -> dict[str, tuple[int, int]]:
    """Each file's inode and mtime: a reused shard keeps both, one written again changes them."""
    return {f"{p.parent.name}/{p.name}": (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}


def _recorded(d: Path) -> list[Path]:
    """The files of the shards that have a record (finished ones)."""
    return [d / "shards" / f"{p.stem}.{ext}" for p in _finished(d) for ext in ("json", "bin", "idx")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus") / "in", n=1500)


@pytest.fixture(scope="module")
def clean(corpus, tmp_path_factory) -> Path:
    """The same corpus prepared without interruption."""
    return prepare_dataset(corpus.files, tmp_path_factory.mktemp("clean") / "ds", VOCAB, log=lambda _: None, **KW)


@pytest.mark.multiprocess
def test_a_killed_worker_stops_it_and_the_rerun_reuses_the_finished_shards(corpus, clean, tmp_path):
    out, partial = tmp_path / "ds", tmp_path / "ds.partial"

    others = {p.pid for p in mp.active_children()}  # an earlier test's rank pool, say

    def kill_a_worker() -> None:
        _wait_for_shards(partial, 3)
        os.kill(next(p.pid for p in mp.active_children() if p.pid not in others), signal.SIGKILL)

    killer = threading.Thread(target=kill_a_worker)
    killer.start()
    with pytest.raises(DataError) as e:
        prepare_dataset(corpus.files, out, VOCAB, log=lambda _: None, workers=2, **KW)
    killer.join()
    assert str(e.value).startswith("a tokenizing worker process died") and "\n" not in str(e.value)
    assert not out.exists() and not (partial / "meta.json").exists()
    kept = _recorded(partial)
    before = _stamps(kept)
    finished = len(_finished(partial))
    assert 3 <= finished < len(_finished(clean)) and {p.pid for p in mp.active_children()} == others

    logs: list[str] = []
    prepare_dataset(corpus.files, out, VOCAB, log=logs.append, workers=2, **KW)
    assert f"reusing {finished} of {len(_finished(clean))} shards an earlier run finished" in logs
    assert "reusing the 512-piece tokenizer an earlier run trained" in logs
    assert _stamps([out / "shards" / p.name for p in kept]) == before
    assert _all_files(out) == _all_files(clean) and not partial.exists()


@pytest.mark.multiprocess
def test_a_killed_command_leaves_no_dataset_and_the_rerun_finishes_it(corpus, clean, tmp_path):
    out, partial = tmp_path / "ds", tmp_path / "ds.partial"
    args = ["--text", str(corpus.root), "--out", str(out), "--vocab-size", str(VOCAB), "--workers", "2"]
    args += ["--max-bad-fraction", "0.05", "--shard-mb", str(UNIT / 2**20)]
    proc = WarmProcess(REPO / "tools" / "prepare_data.py", args, new_session=True)
    try:
        _wait_for_shards(partial, 3)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the command and its workers, at once
        proc.communicate()
    time.sleep(0.2)
    assert not out.exists() and not (partial / "meta.json").exists()
    kept = _recorded(partial)
    before = _stamps(kept)
    finished = len(_finished(partial))
    assert 3 <= finished < len(_finished(clean))

    again = tool_process("prepare_data", *args, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"reusing {finished} of {len(_finished(clean))} shards an earlier run finished" in again.stderr
    assert _stamps([out / "shards" / p.name for p in kept]) == before
    assert _all_files(out) == _all_files(clean) and not partial.exists()
