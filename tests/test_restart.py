"""A worker whose torchrun agent is gone stops instead of training on, orphaned.

Restarts in place (``torchrun --max-restarts``: a rank that dies is restarted, and the run resumes from its newest
checkpoint by itself with the losses of a run never interrupted) are tested across two nodes, which is the same
agent and resume on each node: tests/test_multinode.py's
``test_a_rank_killed_on_one_node_under_max_restarts_resumes_on_both_with_the_unbroken_losses``.

Real torchrun, real processes, killed with real signals (docs/nodes.md's "Several nodes" commands).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.helpers.layouts import tiny
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

pytestmark = pytest.mark.multiprocess

# 2 ranks, 8 micro-batches a rank a step.
LAYOUT = ["train.micro_batch_size=1", "train.eval_every=0", "logging.interval=1000", "checkpoint.every=4"]


def test_a_worker_whose_launcher_dies_stops_with_a_line_and_a_checkpoint(tiny_dataset, tmp_path):
    """The agent SIGKILLed, its workers left alive: each sees its parent change, says so, and stops cleanly after
    its step with a checkpoint (exit 143), within a few seconds, instead of training on, orphaned."""
    overrides = tiny(tiny_dataset, "train.steps=100000", *LAYOUT)
    run_dir = tmp_path / "run"
    cmd = train_command(run_dir, overrides, launcher=torchrun(2))
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        wait_for_rows(run_dir, 3, launcher)
        workers = worker_pids(launcher.pid)
        assert sorted(workers) == [0, 1]
        launcher.kill()
        killed = time.monotonic()
        while any(is_alive(pid) for pid in workers.values()) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        took = time.monotonic() - killed
        out, err = launcher.communicate(timeout=30)  # the pipes close when the orphans have gone
    finally:
        launcher.kill()
        for pid in workers.values():
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert took < 2 * 0.5 + 25, took  # the watch's interval, and train.stop_grace_s at most
    gone = [line for line in output_lines(err) if line.startswith("error: rank")]
    # Each rank that saw it first says so (one that the agreed stop ended before its next look stays silent).
    said = [
        f"error: rank {r}'s launcher (torchrun agent, pid {launcher.pid}) is gone: stopping, since nothing would "
        "restart or end this rank; start the job again to resume from its last checkpoint"
        for r in (0, 1)
    ]
    assert gone and len(set(gone)) == len(gone) and set(gone) <= set(said), err
    (stopped,) = [line for line in output_lines(err) if line.startswith("stopped by")]
    step = read_metrics(run_dir, partial=True)[-1]["step"]
    assert stopped.startswith(f"stopped by SIGTERM at step {step}; checkpoint {run_dir / 'checkpoints'}"), stopped
