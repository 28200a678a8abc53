"""``checkpoint.async``: checkpoints staged in host memory and written in the background while training goes on.

A background save must write what a foreground one writes, resume under another layout with the unbroken curve,
stay atomic when the process is killed mid-write, and be waited for by a SIGTERM stop. The slow writes below are
real writes held back by a hook on DCP's file writer (trident/checkpoint/dcp.py's ``_Writer``): the hook delays
the write of one step, then the real writer runs, so the kill and the signal land inside a background write
deterministically."""

from __future__ import annotations

import json
import os
import re
import runpy
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.layouts import assert_same_curve, four_layers, make_config, train_in_process
from tests.helpers.processes import read_metrics, start_train
from train import run
from trident.checkpoint import dcp, integrity
from trident.checkpoint.files import checkpoint_name, list_checkpoints
from trident.config import Config, compose_config
from trident.errors import CheckpointError, ConfigError, DiskFullError, DivergenceError
from trident.signals import Stopped
from trident_dev.ranks import run_distributed


def test_checkpoint_async_is_the_key_users_type():
    assert compose_config(REPO / "conf", ["checkpoint.async=true"]).checkpoint.async_ is True
    assert compose_config(REPO / "conf", []).checkpoint.async_ is False
    # The Python field's name is not a second spelling of the key.
    with pytest.raises(ConfigError, match=r"^unknown config key checkpoint\.async_; the key is checkpoint\.async$"):
        compose_config(REPO / "conf", ["checkpoint.async_=true"])
    with pytest.raises(Exception, match=r"checkpoint\.async=maybe"):
        compose_config(REPO / "conf", ["checkpoint.async=maybe"])


def _data_files(path: Path) -> dict[str, bytes]:
    """The tensor data and DCP's index of a checkpoint, by file name."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.suffix == ".distcp" or p.name == ".metadata"}


@pytest.mark.multiprocess
def test_async_saves_equal_sync_ones_and_resume_under_another_layout(tiny_dataset, tmp_path):
    """dp=2 saves at steps 2, 4, 6 in the background and in the foreground: the same curve and the same bytes.
    The background step-4 checkpoint then resumes under tp=2 (saving in the background too) with the losses
    of the run that never stopped."""
    base = four_layers(tiny_dataset, 6, "train.eval_every=0", "checkpoint.every=2")
    background = train_in_process(tmp_path / "async", [*base, "checkpoint.async=true", "parallel.dp=2"], world=2)
    foreground = train_in_process(tmp_path / "sync", [*base, "parallel.dp=2"], world=2)
    assert_same_curve(foreground[0], background[0], rel=1e-12)
    for step in (2, 4, 6):
        saved = tmp_path / "async" / "checkpoints" / checkpoint_name(step)
        expected = tmp_path / "sync" / "checkpoints" / checkpoint_name(step)
        assert _data_files(saved) == _data_files(expected), step
        assert (saved / "trainer.json").read_text() == (expected / "trainer.json").read_text()
        # The background writer's files are recorded with their checksums, as the foreground's (integrity.py).
        records = [json.loads((p / "meta.json").read_text())[integrity.RECORD] for p in (saved, expected)]
        assert {n: records[0][n] for n in _data_files(saved)} == {n: records[1][n] for n in _data_files(saved)}
        assert set(records[0]) == {p.name for p in saved.iterdir()} - {"meta.json"}
        assert integrity.damage(saved, records[0]) is None
    resumed = tmp_path / "async" / "checkpoints" / checkpoint_name(4)
    again = [*base, "checkpoint.async=true", "parallel.tp=2", f"checkpoint.resume={resumed}"]
    (continued, _) = train_in_process(tmp_path / "tp2", again, world=2)
    assert [r["step"] for r in continued] == [5, 6]
    assert_same_curve(background[0][4:], continued, rel=1e-6)
    assert [p.name for p in list_checkpoints(tmp_path / "tp2" / "checkpoints")] == [checkpoint_name(6)]


# --- a write held back: the hook on DCP's writer


def _hold_write_of(step: int, seconds: float, then: str = "") -> tuple[object, object]:
    """Make the background write of ``step``'s checkpoint start ``seconds`` late (``then="SIGTERM"``: after
    signalling this process); return what undoes it."""
    real = dcp._Writer.write_data

    def held(self: dcp._Writer, plan: object, planner: object) -> object:
        if f".{checkpoint_name(step)}.tmp-" in str(self.path):
            (Path(self.path).parent.parent / "writing").write_text(str(step))  # in the run directory
            if then:
                os.kill(os.getpid(), getattr(signal, then))
            time.sleep(seconds)
        return real(self, plan, planner)

    dcp._Writer.write_data = held
    return real, held


def _stopped_during_write(rank: int, world: int, cfg: Config, run_dir: Path) -> tuple[int, str, int]:
    real, _ = _hold_write_of(4, 2.0, then="SIGTERM" if rank == 0 else "")
    try:
        run(cfg, run_dir)
    except Stopped as e:
        return e.step, str(e.checkpoint), e.exit_code
    finally:
        dcp._Writer.write_data = real
    raise AssertionError("the run was not stopped")


@pytest.mark.multiprocess
def test_sigterm_during_a_background_write_waits_for_it_and_saves_the_step(tiny_dataset, tmp_path):
    """Rank 0 is signalled as its step-4 write starts, which then takes 2 s. Training goes on meanwhile; the
    stop, after the same later step on both ranks, waits for step 4, saves its own step and exits 143."""
    cfg = make_config(
        *four_layers(tiny_dataset, 50, "train.eval_every=0", "checkpoint.every=2", "checkpoint.async=true")
    )
    outcomes = run_distributed(_stopped_during_write, 2, cfg, tmp_path, timeout_s=120)
    assert outcomes[0] == outcomes[1]
    step, checkpoint, code = outcomes[0]
    root = tmp_path / "checkpoints"
    assert code == 143 and 5 <= step < 50
    assert checkpoint == str(root / checkpoint_name(step))
    saved = [checkpoint_name(s) for s in range(2, step + 1, 2)] + ([checkpoint_name(step)] if step % 2 else [])
    assert [p.name for p in list_checkpoints(root)] == saved
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == saved  # nothing in flight
    assert json.loads((root / checkpoint_name(4) / "trainer.json").read_text())["step"] == 4


@pytest.mark.multiprocess
def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint(tiny_dataset, tmp_path):
    """``python train.py`` with step 4's write held back: training goes on past step 4 while it is written, and
    SIGKILL then leaves step 2 complete, nothing named step_4, and a resume from step 2 with the same losses."""
    run_dir = tmp_path / "run"
    overrides = four_layers(tiny_dataset, 8, "train.eval_every=0", "checkpoint.every=2", "checkpoint.async=true")
    proc = start_train(run_dir, overrides, before=(_hold_write_of, (4, 600.0)))
    root = run_dir / "checkpoints"
    try:
        deadline = time.monotonic() + 120
        # Step 6's save waits for step 4's write: training reached step 6 while step 4 was being written.
        while not ((run_dir / "writing").exists() and len(read_metrics(run_dir, partial=True)) >= 6):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run did not reach step 6"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert [p.name for p in list_checkpoints(root)] == [checkpoint_name(2)]
    assert sorted(p.name for p in root.glob("step_*")) == [checkpoint_name(2)]
    assert list(root.glob(f".{checkpoint_name(4)}.tmp-*")), "the write in flight was not where it should be"
    killed = read_metrics(run_dir, partial=True)

    (resumed,) = train_in_process(run_dir, overrides)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6, 7, 8]
    assert_same_curve(killed[2:6], resumed[:4], rel=1e-6)


def _write_fails_on_rank_1(rank: int, world: int, cfg: Config, run_dir: Path) -> str:
    real = dcp._Writer.write_data

    def failing(self: dcp._Writer, plan: object, planner: object) -> object:
        if rank == 1 and f".{checkpoint_name(2)}.tmp-" in str(self.path):
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    dcp._Writer.write_data = failing
    try:
        run(cfg, run_dir)
    except (CheckpointError, DiskFullError) as e:
        return str(e)
    finally:
        dcp._Writer.write_data = real
    raise AssertionError("the failed write was lost")


@pytest.mark.multiprocess
def test_a_failed_background_write_is_one_error_on_every_rank(tiny_dataset, tmp_path):
    """Rank 1's write of step 2 fails in the background: both ranks raise it, as one line naming the rank, when
    they next wait for it (at step 4's save), and nothing of step 2 is left."""
    overrides = four_layers(tiny_dataset, 6, "train.eval_every=0", "checkpoint.every=2", "checkpoint.async=true")
    errors = run_distributed(_write_fails_on_rank_1, 2, make_config(*overrides), tmp_path, timeout_s=120)
    assert errors[0] == errors[1]
    # ENOSPC with room to spare (as a quota would give): said as a full disk, naming the rank whose write failed.
    assert errors[0].startswith("rank 1: the disk is full: a checkpoint in "), errors[0]
    assert "but refused the write as full (a quota or its inodes?); no checkpoint was written" in errors[0], errors[0]
    root = tmp_path / "checkpoints"
    assert list_checkpoints(root) == [] and not list(root.glob(".step_*"))


@pytest.mark.multiprocess
def test_bench_checkpoint_tables_no_save_sync_and_async():
    """``tools/bench.py checkpoint`` on gpt-tiny: its three rows and finite figures (never how fast)."""
    tool = runpy.run_path(str(REPO / "tools" / "bench.py"))
    argv = ["checkpoint", "--model", "gpt-tiny", "--world", "2", "--every", "2", "--rounds", "1", "--seq-len", "16"]
    module, args = tool["parse"]([*argv, "--micro-batch", "1", "--micro-batches", "1"])
    (table,) = module.run(args)
    assert table.column("variant") == ["no save", "sync", "async"]
    assert all(float(c.rstrip("x")) > 0 for c in table.column("s/step") + table.column("vs no save"))
    assert [c == "-" for c in table.column("stall s/save")] == [True, False, False]
    # The host staging measured against the estimator's figure for it (tools/estimate_memory.py prints it).
    measured, predicted = (float(x) for x in re.findall(r"([\d.]+) MiB", table.notes[0]))
    assert predicted == pytest.approx(measured, rel=0.02)


def _diverges_during_write(rank: int, world: int, cfg: Config, run_dir: Path) -> str:
    real, _ = _hold_write_of(1, 1.5)
    try:
        run(cfg, run_dir)
    except DivergenceError as e:
        return str(e)
    finally:
        dcp._Writer.write_data = real
    raise AssertionError("the run did not diverge")


@pytest.mark.multiprocess
def test_divergence_during_a_background_write_names_it_once_complete(tiny_dataset, tmp_path):
    """lr=1000 in fp16 diverges at step 4 while step 1's write (held 1.5 s) is in flight: the stop waits for it and
    names it as the last good checkpoint."""
    overrides = four_layers(tiny_dataset, 30, "train.precision=fp16", "optim.lr=1000", "optim.warmup_steps=0")
    cfg = make_config(*overrides, "checkpoint.every=1", "train.eval_every=0", "checkpoint.async=true")
    errors = run_distributed(_diverges_during_write, 2, cfg, tmp_path, timeout_s=120)
    assert errors[0] == errors[1]
    good = tmp_path / "checkpoints" / checkpoint_name(1)
    assert errors[0].startswith("training diverged at step 4") and f"the last good checkpoint is {good}:" in errors[0]
    assert list_checkpoints(tmp_path / "checkpoints") == [good]


def _write_through_the_writer_process(rank: int, world: int, root: str) -> dict:
    """Two ranks write one sharded tensor (each its half) through their writer processes (each a process of its
    own, reading the staged halves from shared memory), then the same in the foreground; and a write whose data file
    is taken by a directory, which fails in the writer process (the rank made the directory itself) and must come
    back to the rank."""
    import torch
    import torch.distributed as dist

    from trident.checkpoint.background import HostStage, WriterProcess
    from trident.checkpoint.dcp import Sharded, read_metadata, read_sharded, write_sharded

    group = dist.new_group(backend="gloo")
    half = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    state = {"w": Sharded((4, 3), [((2 * rank, 0), half)])}
    staged = HostStage().copy(state)
    process = WriterProcess()
    write_sharded(staged, Path(root) / "background", group, process)
    write_sharded(state, Path(root) / "foreground", group)
    out = {"shared": staged["w"].boxes[0][1].is_shared(), "pid": process._proc.pid, "me": os.getpid()}
    back = {"w": Sharded((4, 3), [((2 * rank, 0), torch.zeros(2, 3))])}
    read_sharded(back, Path(root) / "background", read_metadata(Path(root) / "background"))
    out["read"] = bool(torch.equal(back["w"].boxes[0][1], half))
    (Path(root) / "blocked" / f"__{rank}_0.distcp").mkdir(parents=True)
    try:
        write_sharded(staged, Path(root) / "blocked", group, process)
    except CheckpointError as e:
        out["error"] = str(e)
    return out


@pytest.mark.multiprocess
def test_the_writer_process_writes_what_the_foreground_writes_and_its_errors_come_back(tmp_path):
    results = run_distributed(_write_through_the_writer_process, 2, str(tmp_path))
    for r in results:
        assert r["shared"] and r["read"], r
        assert r["pid"] != r["me"], "the files are written by a process of the rank's own"
        assert "cannot write checkpoint data in" in r["error"] and "IsADirectoryError" in r["error"], r["error"]
    assert _data_files(tmp_path / "background") == _data_files(tmp_path / "foreground")
