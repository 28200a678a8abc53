"""A dead or stuck rank ends every rank with an error, never a silent hang, and the run resumes.

Real processes, since what is tested is the processes themselves: ``torchrun`` (whose agent sees a worker die)
for a killed rank, ranks started by hand for a frozen one (torchrun's agent cannot see a rank that is alive but
stopped; only the other ranks' collectives and the heartbeats can).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.helpers.layouts import assert_same_curve, tiny, train_in_process
from tests.helpers.processes import (
    child_env,
    is_alive,
    output_lines,
    read_metrics,
    torchrun,
    train_command,
    wait_for_rows,
    worker_pids,
)
from trident.checkpoint.files import checkpoint_name

pytestmark = pytest.mark.multiprocess

# dp=2 x tp=2, a checkpoint every 2 steps, steps slow enough (4 micro-batches a rank) to signal one mid-run.
STEPS = 12
LAYOUT = ["parallel.tp=2", "train.micro_batch_size=2", "train.eval_every=0", "logging.interval=1000"]
# The whole 3D for the killed rank: dp=2 x tp=2 x pp=2 on 8 ranks, one layer per stage.
LAYOUT_3D = [*LAYOUT, "parallel.pp=2"]


def test_a_killed_rank_ends_every_rank_and_the_run_resumes_with_the_uninterrupted_losses(tiny_dataset, tmp_path):
    overrides = tiny(tiny_dataset, f"train.steps={STEPS}", *LAYOUT_3D, "checkpoint.every=2", "parallel.timeout_s=30")
    run_dir = tmp_path / "run"
    cmd = train_command(run_dir, overrides, launcher=torchrun(8))
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        wait_for_rows(run_dir, 3, launcher)
        workers = worker_pids(launcher.pid)
        assert sorted(workers) == list(range(8))
        os.kill(workers[5], signal.SIGKILL)  # dp 0, pp 1, tp 1: a last-stage rank holding a tied copy
        killed = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        launcher.kill()
    assert launcher.returncode != 0 and took < 30, (launcher.returncode, took)
    assert not any(is_alive(pid) for pid in workers.values())
    # torchrun's agent names the dead rank; the survivors, SIGTERMed by it as their collectives fail, say a peer
    # is gone (or, if their collective failed first, name it too) and leave their step unsaved.
    root_cause = err.split("Root Cause")[1]
    assert "rank      : 5 (local_rank: 5)" in root_cause and "Signal 9 (SIGKILL)" in root_cause, err
    k = read_metrics(run_dir, partial=True)[-1]["step"]
    assert k < STEPS, "the run ended before the kill: make its steps longer"
    survivors = [line for line in output_lines(err) if line.startswith(("stopped by", "error:"))]
    assert survivors and all("another rank is gone" in s or "lost contact with rank 5" in s for s in survivors), err

    # The run resumes from its last checkpoint (step k or the one before) with the losses of a run never
    # interrupted; here in one process, which is cheaper to start (a checkpoint resumes under any layout).
    one_process = tiny(tiny_dataset, f"train.steps={STEPS}", "train.micro_batch_size=16", "train.eval_every=0")
    (reference,) = train_in_process(tmp_path / "reference", one_process)
    (resumed,) = train_in_process(run_dir, [*one_process, "checkpoint.every=2"])
    saved = k - k % 2
    assert (run_dir / "checkpoints" / checkpoint_name(saved)).is_dir()
    assert_same_curve(reference[saved:], resumed)


def test_a_frozen_rank_is_named_and_every_other_rank_exits_within_the_collective_timeout(tiny_dataset, tmp_path):
    """SIGSTOP of rank 3 (a hung node, a process stuck in the kernel): nothing dies, so torchrun sees nothing and
    only the collective timeout (parallel.timeout_s) ends the others; they name the rank that stopped beating."""
    timeout_s = 6
    overrides = tiny(tiny_dataset, "train.steps=100000", *LAYOUT, f"parallel.timeout_s={timeout_s}")
    run_dir = tmp_path / "run"
    cmd = train_command(run_dir, overrides, launcher=torchrun(4))
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        wait_for_rows(run_dir, 2, launcher)
        workers = worker_pids(launcher.pid)
        os.kill(workers[3], signal.SIGSTOP)
        stopped = time.monotonic()
        while any(is_alive(workers[r]) for r in range(3)) and time.monotonic() - stopped < timeout_s + 30:
            time.sleep(0.05)
        took = time.monotonic() - stopped
        # torchrun would SIGKILL the frozen worker 30 s after the others ended (it ignores --shutdown-timeout
        # on that path); do it now.
        os.kill(workers[3], signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert not any(is_alive(workers[r]) for r in range(3)) and took < timeout_s + 15, took
    assert launcher.returncode != 0
    # Each survivor names rank 3 once its own collective timed out; one that torchrun's SIGTERM (sent when the
    # first survivor exited) reached while it still waited leaves the stop line instead.
    survivors = [line for line in output_lines(err) if line.startswith(("stopped by", "error:"))]
    named = [s for s in survivors if s.startswith("error: lost contact with rank 3 (silent for 3 s: dead or stuck) (")]
    assert named and all(s in named or "another rank is gone" in s for s in survivors), err
