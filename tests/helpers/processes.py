"""The command line as a user starts it: ``python train.py``, ``torchrun`` and the tools as processes of their own,
their environment, their output, the metrics file a live run writes, and a launcher's worker processes. Only the
tests of the launcher's and the command line's own behaviour start processes; training math runs in-process
(tests/helpers/layouts.py). ``python train.py`` and the tools run as warm processes (tests/helpers/warm.py: forks
of a server that imported them once), which is what the tests of their behaviour need; ``torchrun`` and its workers
are real interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.helpers import REPO
from tests.helpers.warm import WarmProcess, run
from trident_dev.ranks import free_port


def child_env(**extra: str) -> dict[str, str]:
    """The test process's environment for a child: one thread, unbuffered output, Hydra's and wandb's one-liners."""
    out = dict(os.environ)
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0", WANDB_SILENT="true", **extra)
    return out


def torchrun(nproc: int, *args: str, standalone: bool = True) -> list[str]:
    """``torchrun [--standalone] --nproc-per-node=nproc args``, as a command line of this interpreter."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if standalone else [])]
    return [*cmd, f"--nproc-per-node={nproc}", *args]


def train_command(run_dir: Path, overrides: list[str], launcher: list[str] | None = None) -> list[str]:
    """``python train.py hydra.run.dir=run_dir overrides``, or under ``launcher`` (``torchrun(...)``)."""
    return [*(launcher or [sys.executable]), str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *overrides]


def start_train(
    run_dir: Path,
    overrides: list[str],
    env: dict[str, str] | None = None,
    before: tuple[Callable[..., Any], tuple[Any, ...]] | None = None,
) -> WarmProcess:
    """``python train.py`` in the background (warm), its output captured; ``before``: a function (importable by
    name) and its arguments, called in the process first (to hold back a write, say)."""
    args = [f"hydra.run.dir={run_dir}", *overrides]
    return WarmProcess(REPO / "train.py", args, env or child_env(), before=before)


def run_train(
    run_dir: Path,
    overrides: list[str],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``python train.py hydra.run.dir=run_dir overrides`` to its end (warm), its output captured."""
    return run(REPO / "train.py", [f"hydra.run.dir={run_dir}", *overrides], env or child_env(), cwd, timeout)


def start_ranks(
    run_dir: Path, overrides: list[str], world: int, env: dict[str, str] | None = None
) -> list[WarmProcess]:
    """``world`` ranks of ``python train.py`` started by hand (warm), with the environment torchrun would give
    them (on top of ``env``, else ``child_env()``) but no launcher to end the others when one exits; their output
    captured."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        rank_env = dict(env or child_env())
        rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(start_train(run_dir, overrides, rank_env))
    return procs


def tool_process(
    name: str,
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """``python tools/<name>.py args`` to its end, its output captured: warm, or ``fresh``, a new interpreter (for
    what only one shows: that the script finds the package by itself)."""
    script = REPO / "tools" / f"{name}.py"
    if not fresh:
        return run(script, args, env, cwd, timeout)
    cmd = [sys.executable, str(script), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path, partial: bool = False) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``. ``partial``: of a run that may still be writing it, or was killed, so
    a missing file is no rows and a line not finished is left out; otherwise every line must be a whole row."""
    path = run_dir / "metrics.jsonl"
    if partial and not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if not partial or line.endswith("}")]


def wait_for_rows(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the run ``proc`` writes into ``run_dir`` has logged ``n`` steps; fails if it ends first."""
    deadline = time.monotonic() + timeout
    while len(read_metrics(run_dir, partial=True)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {n} steps after {timeout} s"
        time.sleep(0.02)


def output_lines(text: str) -> list[str]:
    """The non-blank lines of a process's output."""
    return [line for line in text.splitlines() if line.strip()]


def worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes (from their environment, as torchrun set it)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != launcher:
                    continue
            with open(f"/proc/{pid}/environ") as f:
                environ = dict(kv.split("=", 1) for kv in f.read().split("\0") if "=" in kv)
            found[int(environ["RANK"])] = int(pid)
        except (OSError, KeyError, ValueError, IndexError):
            continue  # a process that ended while being read
    return found


def is_alive(pid: int) -> bool:
    """Whether the process runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
