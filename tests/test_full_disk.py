"""A save on a filesystem without room for it (trident/checkpoint/room.py): one line naming the filesystem and the
bytes needed against those free, exit code 4, no partial directory, the last complete checkpoint kept and resumed
from with the losses of a run that had room. The filesystems are real: tmpfs mounts of a few MiB (which needs
root, as CI's machine has; elsewhere the tests are skipped with the reason)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.layouts import tiny
from tests.helpers.processes import child_env, read_metrics, torchrun, train_command

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs: room for one gpt-tiny checkpoint (1.8 MiB), not two. Remounted larger by the test to free
    space."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _resize(where: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)


def _train(run_dir: Path, overrides: list[str], world: int = 1) -> subprocess.CompletedProcess:
    launcher = torchrun(world) if world > 1 else None
    cmd = train_command(run_dir, overrides, launcher)
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=300)


def _errors(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


def test_a_save_without_room_stops_with_the_bytes_and_the_kept_checkpoint_resumes(
    tiny_dataset: Path, tmp_path: Path, small_disk: Path
) -> None:
    """Two ranks (dp=2) save every 2 steps on the 3 MiB disk: step 2 fits, step 4 does not. The run stops with exit
    code 4 and the line; once the disk is larger, the same command resumes from step 2 with the unbroken losses."""
    overrides = tiny(tiny_dataset, "train.steps=6", "checkpoint.every=2", "train.eval_every=0", "parallel.dp=2")
    unbroken = _train(tmp_path / "unbroken", overrides, world=2)
    assert unbroken.returncode == 0, unbroken.stderr[-2000:]
    expected = read_metrics(tmp_path / "unbroken")

    on_disk = [*overrides, f"checkpoint.dir={small_disk / 'ck'}"]
    full = _train(tmp_path / "run", on_disk, world=2)
    assert full.returncode != 0
    (line, *others) = _errors(full)
    assert not [o for o in others if o != line], others  # one line, said once per node
    ck, disk, kept = (re.escape(str(p)) for p in (small_disk / "ck", small_disk, small_disk / "ck" / "step_00000002"))
    assert re.fullmatch(
        rf"error: the disk is full: a checkpoint in {ck} needs about [\d.]+ MiB \([\d,]+ bytes\), and the "
        rf"filesystem at {disk} had [\d.]+ (MiB|KiB) \([\d,]+ bytes\) free of 3\.00 MiB "
        rf"\(the size of step_00000002\); step_00000004 was not started; the last complete checkpoint, {kept}, is "
        r"kept: free space, lower checkpoint.keep_last or point checkpoint.dir at a larger disk, then rerun to resume",
        line,
    ), line
    assert "exitcode  : 4" in full.stderr, full.stderr[-2000:]  # the ranks' code in torchrun's report
    assert sorted(p.name for p in (small_disk / "ck").iterdir() if not p.name.startswith(".trident")) == [
        "step_00000002"
    ]

    _resize(small_disk, "8m")  # the operator frees space
    resumed = _train(tmp_path / "run", on_disk, world=2)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows][-4:] == [3, 4, 5, 6]
    assert [r["loss"] for r in rows][-4:] == pytest.approx([r["loss"] for r in expected][2:], rel=1e-12)


def test_a_first_save_that_cannot_fit_leaves_no_partial_directory_and_exits_4(
    tiny_dataset: Path, tmp_path: Path, small_disk: Path
) -> None:
    """On a 1 MiB disk the first save fails while DCP writes (no checkpoint to size it by beforehand), in the
    foreground, in the background and on two ranks (their shares of the data summed after the failure every rank
    met; the rank whose write failed is named when the other's fitted): the partial directory is gone, the exit
    code is 4."""
    _resize(small_disk, "1m")
    overrides = tiny(tiny_dataset, "train.steps=2", "checkpoint.every=2", "train.eval_every=0")
    for i, (extra, world) in enumerate([([], 1), (["checkpoint.async=true"], 1), (["parallel.dp=2"], 2)]):
        ck = small_disk / f"ck{i}"
        done = _train(tmp_path / f"run{i}", [*overrides, *extra, f"checkpoint.dir={ck}"], world)
        assert done.returncode == (4 if world == 1 else 1), done.stderr[-2000:]  # torchrun's own: 1
        assert world == 1 or "exitcode  : 4" in done.stderr, done.stderr[-2000:]
        (line, *others) = _errors(done)
        assert not [o for o in others if o != line], others
        assert re.fullmatch(
            rf"error: (rank \d: )?the disk is full: a checkpoint in {re.escape(str(ck))} needs about "
            r"[\d.]+ MiB \([\d,]+ bytes\), "
            r"and the "
            rf"filesystem at {re.escape(str(small_disk))} had [\d.]+ (MiB|KiB) \([\d,]+ bytes\) free of 1\.00 MiB; no "
            r"checkpoint was "
            r"written: free space, lower checkpoint.keep_last or point checkpoint.dir at a larger disk, then rerun to "
            r"resume",
            line,
        ), line
        assert [p.name for p in ck.iterdir() if not p.name.startswith(".trident")] == []
