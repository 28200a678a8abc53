"""trident_dev/process_tree.py: ``tools/plan.py --measure`` (trident_dev/plan/measure.py, through
trident_dev/bench/runs.py) leaves none of the processes it started running, whether a run ends, runs past its
time, or the tool is sent SIGTERM.

Each test marks its launches with a variable of its own in the environment, which every process they start inherits
(torchrun's agent, and the workers it starts in sessions of their own), and looks for it in /proc afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.plan_profiles import hand_built_cpu
from trident.config import compose_config
from trident.plan import planner
from trident_dev.plan import measure
from trident_dev.process_tree import marked

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds processes through /proc"),
]

BASE = ["model=gpt-tiny", "train.global_batch_size=4", "logging.peak_tflops=1"]
TEST_MARK = "TRIDENT_TEST_LAUNCH"


def _gone(mark: str, within_s: float = 5.0) -> list[int]:
    """The marked processes still alive after ``within_s`` (an ended process may take a moment to be reaped)."""
    deadline = time.monotonic() + within_s
    while (left := marked(mark, TEST_MARK)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _best(world: int) -> list[planner.Prediction]:
    result = planner.plan(compose_config(REPO / "conf", BASE), world, hand_built_cpu())
    return [p for p in result.ranked if p.layout.tp == 1 and p.layout.pp == 1][:1]  # dp2: two workers


def test_a_measured_run_past_its_time_leaves_no_rank_running(tiny_dataset, tmp_path, monkeypatch) -> None:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(TEST_MARK, mark)
    base = [*BASE, f"data.dataset_dir={tiny_dataset}"]
    # Steps that no machine runs within the 12 s (400 took 10.3 s on an idle 2-core one).
    runs = tmp_path / "runs"
    (m,) = measure.measure(_best(2), base, 2, REPO, runs, steps=100_000, warmup=1, timeout_s=12, log=print)
    assert m.trial.error == "did not finish within 12 s"
    # Gone when the call returns: not left to stop by themselves (an orphaned worker notices its agent's death and
    # stops after its step and a checkpoint, which for a large layout takes minutes).
    assert marked(mark, TEST_MARK) == []


SCRIPT = """
import sys
from pathlib import Path
from tests.test_process_tree import BASE, _best
from tests.helpers import REPO
from trident_dev.plan import measure

base = [*BASE, "data.dataset_dir=" + sys.argv[1]]
runs = Path(sys.argv[2])
measure.measure(_best(2), base, 2, REPO, runs, steps=400, warmup=1, log=lambda line: print(line, flush=True))
"""


def test_sigterm_to_the_tool_ends_the_run_it_measures_and_every_rank_of_it(tiny_dataset, tmp_path) -> None:
    mark = uuid.uuid4().hex
    script = tmp_path / "measure.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, **{TEST_MARK: mark}, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tools")]))
    tool = subprocess.Popen(
        [sys.executable, str(script), str(tiny_dataset), str(tmp_path / "runs")],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # The tool, torchrun's agent and its two workers: wait until all are up, then stop the tool.
        deadline = time.monotonic() + 120
        while len(marked(mark, TEST_MARK)) < 4 and tool.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(marked(mark, TEST_MARK)) >= 4, tool.poll()
        time.sleep(2)  # into the run's steps
        tool.send_signal(signal.SIGTERM)
        output, _ = tool.communicate(timeout=60)
    finally:
        if tool.poll() is None:
            tool.kill()
    assert tool.returncode == 128 + signal.SIGTERM, output[-2000:]
    assert _gone(mark) == []
