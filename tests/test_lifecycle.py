"""How a run starts, stops and ends: errors from every rank, the run directory's owner, divergence, signals,
the summary line. In-process (tests/helpers/layouts.py) where it can be; the launcher's own behaviour (torchrun's
signals, a second process fighting for the directory) with real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import REPO
from tests.helpers.layouts import assert_same_curve, make_config, tiny, train_in_process
from tests.helpers.processes import (
    child_env,
    output_lines,
    read_metrics,
    start_ranks,
    start_train,
    torchrun,
    train_command,
    wait_for_rows,
)
from train import run
from trident.checkpoint.files import checkpoint_name, list_checkpoints
from trident.config import Config
from trident.divergence import DivergencePolicy
from trident.errors import RunDirError
from trident.rundir import LOCK_FILE, RunDirLock, remove_partial_saves
from trident.signals import SAME_KEY_PRESS_S, Stopped, StopRequest
from trident_dev.ranks import run_distributed

# --- 1. Errors reach the user from every rank.


@pytest.mark.multiprocess
def test_under_torchrun_the_first_line_is_the_error_and_nothing_aborts(tiny_dataset, tmp_path):
    """The launcher kills the other ranks as soon as one exits: the first rank out must have printed already."""
    cmd = train_command(tmp_path / "run", tiny(tiny_dataset), launcher=torchrun(2))
    bad_layout = ["parallel.pp=2", "parallel.vpp=2"]  # gpt-tiny's 2 layers do not split over 4 virtual stages
    proc = subprocess.run([*cmd, *bad_layout], capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode != 0
    lines = output_lines(proc.stderr)
    error = (
        "error: model.n_layers=2 is not divisible by pp 2 x vpp 2 = 4; change the layer count or the pipeline layout"
    )
    assert lines[0] == error, proc.stderr
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr.split(error)[0]


@pytest.mark.multiprocess
def test_a_rank_that_loses_its_peer_says_so_in_one_line(tiny_dataset, tmp_path):
    """kill -9 of one rank (started by hand: no launcher to end the other): the survivor's collective fails, and
    it ends at once with one line and exit code 1, not a traceback or an abort in teardown."""
    run_dir = tmp_path / "run"
    overrides = tiny(tiny_dataset, "train.steps=2000", "train.eval_every=0", "logging.interval=1000")
    ranks = start_ranks(run_dir, overrides, 2)
    try:
        wait_for_rows(run_dir, 2, ranks[0])
        ranks[1].kill()
        _, err = ranks[0].communicate(timeout=30)
    finally:
        for proc in ranks:
            proc.kill()
    assert ranks[0].returncode == 1
    (line,) = output_lines(err)
    assert line.startswith("error: lost contact with another rank (") and line.endswith("says why it stopped"), line


def _bad_counts(rank: int, world: int, cfg: Config, run_dir: Path) -> str:
    try:
        run(cfg, run_dir)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "trained"


@pytest.mark.multiprocess
def test_counts_bounded_by_the_data_are_checked_against_it_before_any_collective(tiny_dataset, tmp_path):
    """train.eval_batches=100000000 used to evaluate for days: it is refused on every rank, at once."""
    cfg = make_config(*tiny(tiny_dataset, "train.eval_batches=100000000"))
    start = time.monotonic()
    outcomes = run_distributed(_bad_counts, 2, cfg, tmp_path, timeout_s=120)
    assert time.monotonic() - start < 30
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].startswith("DataError: train.eval_batches=100000000 needs 1,600,000,000 validation windows")
    assert "set train.eval_batches to at most" in outcomes[0]


# --- 2. A run owns its directory.


def test_lock_names_its_holder_and_is_free_once_released(tmp_path):
    first = RunDirLock(tmp_path)
    first.acquire()
    second = RunDirLock(tmp_path)
    with pytest.raises(RunDirError, match=rf"is in use by another run \(pid {os.getpid()} on .+, started 20"):
        second.acquire()
    first.release()
    second.acquire()
    second.release()


def test_partial_saves_are_removed_and_complete_checkpoints_kept(tmp_path):
    partial = [".step_00000004.tmp-3f2a", ".step_00000002.old-1b", ".step_00000001.trash-9c"]
    for name in [*partial, "step_00000002", ".step_notes"]:
        (tmp_path / name).mkdir()
    removed = remove_partial_saves(tmp_path)
    assert sorted(p.name for p in removed) == sorted(partial)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_notes", "step_00000002"]
    assert remove_partial_saves(tmp_path / "absent") == []


def _launch_id_of_two_children() -> str:
    """Print the launch id of two children of one launcher (as torchrun's local ranks are). The children import
    trident.launcher alone, which imports no torch: four interpreters that import torch cost 14 CPU-s."""
    child = "from trident.launcher import launch_id; print(launch_id())"
    return (
        "import os, subprocess, sys\n"
        "env = dict(os.environ, TORCHELASTIC_RUN_ID='test')\n"
        f"procs = [subprocess.Popen([sys.executable, '-c', {child!r}], env=env, stdout=subprocess.PIPE, text=True)"
        " for _ in range(2)]\n"
        "print(' '.join(p.communicate()[0].strip() for p in procs))\n"
    )


@pytest.mark.multiprocess
def test_default_run_dir_is_shared_by_one_launch_and_unique_per_launch():
    launchers = [
        subprocess.Popen([sys.executable, "-c", _launch_id_of_two_children()], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=60)[0].split() for p in launchers]
    for (a, b), launcher in zip(outputs, launchers, strict=True):
        assert a == b and a.endswith(f"-{launcher.pid}"), (a, b)  # every rank of one job: one directory
    assert outputs[0][0] != outputs[1][0]  # two jobs started in the same second: two directories


@pytest.mark.multiprocess
def test_a_second_run_in_the_directory_is_refused_until_the_first_is_gone(tiny_dataset, tmp_path):
    """Run A holds the directory; run B there is refused with A's name. SIGTERM ends A after its step with a
    checkpoint; B then owns the directory, removes the partial saves a killed run left, and resumes."""
    run_dir = tmp_path / "run"
    overrides = tiny(tiny_dataset, "train.steps=400", "train.eval_every=0", "logging.interval=1000")
    a = start_train(run_dir, overrides)
    try:
        wait_for_rows(run_dir, 2, a)
        with pytest.raises(RuntimeError) as refused:
            train_in_process(run_dir, overrides)
        assert f"RunDirError: run directory {run_dir} is in use by another run (pid {a.pid} on " in str(refused.value)
        a.send_signal(signal.SIGTERM)
        out, err = a.communicate(timeout=60)
    finally:
        a.kill()
    assert a.returncode == 128 + signal.SIGTERM, err
    stopped = [r["step"] for r in read_metrics(run_dir, partial=True)]
    k = stopped[-1]
    assert stopped == list(range(1, k + 1)) and k < 400  # one writer: no interleaved rows
    checkpoint = run_dir / "checkpoints" / checkpoint_name(k)
    stop = f"stopped by SIGTERM at step {k}; checkpoint {checkpoint}; rerun the same command to resume"
    assert output_lines(err) == [stop]
    assert list_checkpoints(run_dir / "checkpoints") == [checkpoint]

    leftovers = [run_dir / "checkpoints" / f".{checkpoint_name(k + 1)}.tmp-{i}" for i in range(2)]
    for path in leftovers:
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"half a save")
    (history,) = train_in_process(run_dir, [*overrides, f"train.steps={k + 2}"])
    assert [r["step"] for r in history] == [k + 1, k + 2]
    assert not any(path.exists() for path in leftovers)
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] != a.pid


# --- 3. Divergence stops the run with its reason; nothing non-finite is saved.


def test_divergence_policy_counts_in_a_row_and_stops_at_the_scale_floor():
    policy = DivergencePolicy(max_skipped_steps=3, max_nonfinite_losses=2)
    assert policy.verdict(5.0, True, 1024.0, 1.0) is None
    assert policy.verdict(5.0, True, 512.0, 1.0) is None
    assert policy.verdict(5.0, False, 256.0, 1.0) is None  # a good step resets the count
    assert policy.verdict(5.0, True, 256.0, 1.0) is None
    assert policy.verdict(5.0, True, 128.0, 1.0) is None
    assert "not finite 3 steps in a row" in policy.verdict(5.0, True, 64.0, 1.0)
    floor = DivergencePolicy(max_skipped_steps=100, max_nonfinite_losses=100)
    assert floor.verdict(5.0, True, 2.0, 1.0) is None
    assert "loss scale already at its floor 1" in floor.verdict(5.0, True, 1.0, 1.0)
    losses = DivergencePolicy(max_skipped_steps=100, max_nonfinite_losses=2)
    assert losses.verdict(float("nan"), True, None, None) is None
    assert "the loss was inf for 2 steps in a row" in losses.verdict(float("inf"), True, None, None)


def _diverge(rank: int, world: int, cfg: Config, run_dir: Path) -> str:
    with pytest.raises(Exception) as e:
        run(cfg, run_dir)
    return f"{type(e.value).__name__}: {e.value}"


@pytest.mark.multiprocess
def test_fp16_divergence_stops_every_rank_naming_step_scale_and_last_good_checkpoint(tiny_dataset, tmp_path):
    """lr=1000 in fp16: step 1 is fine, from step 2 the loss is nan (scale 65536, then halved on every skip)."""
    overrides = tiny(tiny_dataset, "train.precision=fp16", "optim.lr=1000", "optim.warmup_steps=0")
    cfg = make_config(*overrides, "train.steps=30", "checkpoint.every=1", "train.eval_every=0")
    errors = run_distributed(_diverge, 2, cfg, tmp_path, timeout_s=120)
    assert errors[0] == errors[1]
    good = tmp_path / "checkpoints" / checkpoint_name(1)
    assert errors[0] == (
        "DivergenceError: training diverged at step 4, loss scale 16384: the loss was nan for 3 steps in a row "
        f"(train.max_nonfinite_losses); the last good checkpoint is {good}: resume from it with a lower optim.lr "
        "(or a longer optim.warmup_steps, or train.precision=bf16)"
    )
    assert list_checkpoints(tmp_path / "checkpoints") == [good]  # due at every step, saved only when finite
    assert [r["loss"] for r in read_metrics(tmp_path, partial=True)][1:] == [None, None, None]


@pytest.mark.multiprocess
def test_nonfinite_losses_stop_any_precision_and_are_never_saved(tiny_dataset, tmp_path):
    cfg = make_config(*tiny(tiny_dataset, "model.init_std=1e30", "train.steps=30", "checkpoint.every=1"))
    (error,) = run_distributed(_diverge, 1, cfg, tmp_path, timeout_s=120)
    assert error.startswith("DivergenceError: training diverged at step 3: the loss was nan for 3 steps in a row")
    assert "no checkpoint was saved yet" in error
    assert list_checkpoints(tmp_path / "checkpoints") == []


# --- 4. Signals: every rank finishes its step, saves it, and says so.


def _signal_one_rank(rank: int, world: int, cfg: Config, run_dir: Path) -> tuple[int, str, int]:
    """Rank 1 alone gets SIGINT once rank 0 has logged two steps; every rank must stop after the same step."""
    if rank == 1:

        def interrupt() -> None:
            while len(read_metrics(run_dir, partial=True)) < 2:
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
    try:
        run(cfg, run_dir)
    except Stopped as e:
        return e.step, str(e.checkpoint), len(e.history)
    raise AssertionError("the run was not stopped")


@pytest.mark.multiprocess
def test_sigint_on_one_rank_stops_every_rank_after_the_same_step(tiny_dataset, tmp_path):
    cfg = make_config(*tiny(tiny_dataset, "train.steps=400", "train.eval_every=0"))
    outcomes = run_distributed(_signal_one_rank, 2, cfg, tmp_path, timeout_s=120)
    assert outcomes[0] == outcomes[1]
    step, checkpoint, ran = outcomes[0]
    assert 2 <= step < 400 and ran == step
    assert checkpoint == str(tmp_path / "checkpoints" / checkpoint_name(step))
    assert list_checkpoints(tmp_path / "checkpoints") == [Path(checkpoint)]


def _agree_alone(rank: int, world: int) -> tuple[list[int], list[str]]:
    stop = StopRequest(grace_s=1.0)
    verdicts = [stop.agreed(dist.group.WORLD, torch.device("cpu"))]
    stop.signum = signal.SIGTERM  # as the watcher thread sets it
    with torch.profiler.profile() as prof:
        verdicts.append(stop.agreed(dist.group.WORLD, torch.device("cpu")))
    return verdicts, [e.name for e in prof.events() if e.name.startswith("c10d::")]


@pytest.mark.multiprocess
def test_one_process_agrees_with_itself_on_a_stop_without_a_collective():
    """The per-step agreement is the process's own flag when it is alone (no all-reduce in every step)."""
    ((verdicts, collectives),) = run_distributed(_agree_alone, 1)
    assert verdicts == [0, signal.SIGTERM] and collectives == []


@pytest.mark.multiprocess
def test_sigterm_to_torchrun_saves_the_step_and_resuming_gives_the_uninterrupted_losses(tiny_dataset, tmp_path):
    """The launcher is signalled (as SLURM or Kubernetes do), not a worker. Rerunning the same command resumes
    from the step it stopped at, continues the same wandb run, and ends with the summary line."""
    steps = 20  # the signal comes after step 3: the resumed run takes the rest, validating at 10 and 20
    overrides = tiny(tiny_dataset, f"train.steps={steps}", "train.eval_every=10", "wandb.mode=offline")
    (reference,) = train_in_process(tmp_path / "reference", [*overrides, "wandb.mode=disabled"])

    run_dir = tmp_path / "run"
    cmd = train_command(run_dir, overrides, launcher=torchrun(2))
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        wait_for_rows(run_dir, 3, launcher)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    k = read_metrics(run_dir, partial=True)[-1]["step"]
    assert k < steps, "the run ended before the signal: make its steps longer"
    checkpoint = run_dir / "checkpoints" / checkpoint_name(k)
    stop = f"stopped by SIGTERM at step {k}; checkpoint {checkpoint}; rerun the same command to resume"
    # One line from the logging rank, before anything the launcher itself prints about its signal.
    assert [line for line in output_lines(err) if "stopped" in line or "rror" in line][0] == stop, err
    assert err.count("stopped by") == 1
    assert list_checkpoints(run_dir / "checkpoints") == [checkpoint]
    run_id = (run_dir / "wandb_run_id").read_text().strip()

    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=child_env())
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("resumed from") == 1 and f"resumed from {checkpoint} at step {k}" in resumed.stdout
    rows = read_metrics(run_dir, partial=True)
    assert_same_curve(reference, rows, rel=1e-6)
    final = run_dir / "checkpoints" / checkpoint_name(steps)
    summary = output_lines(resumed.stdout)[-1]
    assert summary.startswith(f"done: steps {k + 1}-{steps} in ") and " tok/s | loss " in summary, summary
    assert summary.endswith(f" | val {rows[-1]['val_loss']:.4f} | checkpoint {final}"), summary
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{run_id}") for name in offline), offline


# (signals sent one after the other, train.stop_grace_s, why the step in flight is abandoned)
ABANDON = [
    ([signal.SIGINT, signal.SIGINT], 25, " on a second Ctrl-C"),
    ([signal.SIGTERM], 0.5, ": it did not finish within train.stop_grace_s=0.5s"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("signals,grace,why", ABANDON, ids=["second-ctrl-c", "grace-expired"])
def test_a_stop_that_cannot_wait_ends_at_once_naming_the_last_checkpoint(tiny_dataset, tmp_path, signals, grace, why):
    """The first SIGINT asks for a clean stop after the step in flight; a second, a moment later, ends now. A step
    that does not finish within train.stop_grace_s after the signal (a rank stopped answering, or, here, a slow
    step) is abandoned the same way. Either way: one line, no traceback, 128 + the first signal."""
    run_dir = tmp_path / "run"
    # A model slow enough on a CPU (seconds a step) that the step in flight outlasts the wait.
    slow = [
        "model.d_model=512",
        "model.n_layers=6",
        "model.seq_len=256",
        "train.micro_batch_size=16",
        "train.eval_every=0",
    ]
    overrides = tiny(tiny_dataset, *slow, "train.steps=100", f"train.stop_grace_s={grace}")
    proc = start_train(run_dir, overrides)
    try:
        wait_for_rows(run_dir, 1, proc)
        for i, signum in enumerate(signals):
            if i:
                time.sleep(SAME_KEY_PRESS_S + 0.2)  # a second key press, not one delivered twice
            proc.send_signal(signum)
        start = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - start < grace + 2.5
    finally:
        proc.kill()
    assert proc.returncode == 128 + signals[0]
    k = read_metrics(run_dir, partial=True)[-1]["step"]
    assert output_lines(err) == [
        f"stopped by {signals[0].name} at step {k} (step {k + 1} abandoned{why}); no checkpoint yet; "
        "rerun the same command to resume"
    ]


# --- 6. Run output stays out of git.


@pytest.mark.multiprocess
def test_gitignore_covers_run_output():
    paths = ["runs/a/metrics.jsonl", "outputs/2025-01-01/12-00-00-123/metrics.jsonl"]
    proc = subprocess.run(["git", "check-ignore", *paths], cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.split() == paths
