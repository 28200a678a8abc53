"""Short training runs launched as a user launches them, for the bench subcommands that compare layouts
(``tools/bench.py layouts`` and ``matrix``).

A layout is written as overrides of train.py, with short forms for the common ones::

    "dp=2 tp=2 sp ac=selective"  ->  parallel.dp=2 parallel.tp=2 parallel.sequence_parallel=true
                                     train.activation_checkpointing=selective

``dp tp pp vpp schedule zero`` are ``parallel.*``; ``sp`` is sequence parallelism; ``ac=`` activation
checkpointing; ``precision=``, ``mbs=`` (micro-batch size) and ``compile`` are ``train.*``; anything with a dot
passes through unchanged; ``1`` alone is the one-process run. The world size is dp x tp x pp (dp 1 when left out).
Each layout is checked by train.py's own ``validate`` before anything starts, so a refused layout costs nothing
and reports the validator's line; the rest run as ``torchrun --standalone train.py`` (plain ``python train.py``
for one process) in a run directory of their own, and come back as their metrics.jsonl rows, the memory.json
report if the run wrote one, and the error line if it failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trident.config import Config, validate
from trident.errors import ConfigError
from trident_dev.process_tree import run_tree
from trident_dev.tool_config import default_world, load_config

SHORT = {
    "dp": "parallel.dp",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "vpp": "parallel.vpp",
    "schedule": "parallel.schedule",
    "zero": "parallel.zero",
    "ac": "train.activation_checkpointing",
    "precision": "train.precision",
    "mbs": "train.micro_batch_size",
}
FLAGS = {"sp": "parallel.sequence_parallel=true", "compile": "train.compile=true"}


def expand(layout: str) -> list[str]:
    """A layout's train.py overrides."""
    out = []
    for word in layout.split():
        key, eq, value = word.partition("=")
        if word == "1":
            continue
        if word in FLAGS:
            out.append(FLAGS[word])
        elif eq and key in SHORT:
            out.append(f"{SHORT[key]}={value}")
        elif eq and "." in key:
            out.append(word)
        else:
            raise ValueError(f"layout {layout!r}: cannot read {word!r}; use {', '.join([*SHORT, *FLAGS])} or key=value")
    return out


@dataclass
class Trial:
    layout: str
    overrides: list[str]
    world: int = 1
    config: Config | None = None  # None if its overrides do not compose (refused)
    refused: str | None = None  # the validator's line, when the layout was not run
    error: str | None = None  # the run's last error line, when it failed
    rows: list[dict] = field(default_factory=list)  # metrics.jsonl
    memory: dict | None = None  # memory.json
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.refused is None and self.error is None


def checked_trial(repo: Path, layout: str, base: list[str]) -> Trial:
    """The trial of ``layout`` on top of ``base`` overrides, checked by the validator (not run)."""
    overrides = [*base, *expand(layout)]
    trial = Trial(layout, overrides)
    try:
        trial.config = load_config(repo / "conf", overrides)  # an unknown key or a wrong type: a ConfigError too
        trial.world = default_world(trial.config)
        validate(trial.config, trial.world)
    except ConfigError as e:
        trial.refused = str(e)
    return trial


def run_trial(repo: Path, trial: Trial, run_dir: Path, timeout_s: float) -> Trial:
    """Launch ``trial`` (already planned and not refused) and read back what it left in ``run_dir``."""
    launcher = [sys.executable]
    if trial.world > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={trial.world}"]
    cmd = [*launcher, str(repo / "train.py"), f"hydra.run.dir={run_dir}", *trial.overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    start = time.monotonic()
    try:
        proc = run_tree(cmd, timeout_s, env=env, cwd=repo)  # no rank outlives its run, however the run ends
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "stopped by"))]
            tail = proc.stderr.strip().splitlines()
            trial.error = lines[0] if lines else (tail[-1] if tail else f"exit code {proc.returncode}")
    except subprocess.TimeoutExpired:
        trial.error = f"did not finish within {timeout_s:g} s"
    trial.wall_s = time.monotonic() - start
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        trial.rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
    memory = run_dir / "memory.json"
    if memory.is_file():
        try:
            trial.memory = json.loads(memory.read_text())
        except ValueError:
            trial.memory = None
    return trial
