"""The command line itself: train.py as a user runs it (one process, or ranks started by hand), its console,
its files, its one-line errors. Training math under every layout is tested in-process (tests/test_layouts.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.dist import free_port
from tests.layouts import assert_same_curve, tiny

KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mb"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    return env


def train(run_dir: Path, *overrides: str, nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    launcher = [sys.executable, str(REPO / "train.py")]
    if nproc > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
        ]
        launcher.append(str(REPO / "train.py"))
    cmd = [*launcher, f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=run_dir.parent)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _generate(checkpoint: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tools" / "generate.py"), str(checkpoint), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())


def test_default_corpus_run_logs_every_key_and_learns(tmp_path):
    """The issue's acceptance command, on the embedded corpus, with wandb in its default offline mode."""
    run_dir = tmp_path / "run"
    proc = train(run_dir, "model=gpt-tiny", "train.steps=40", f"data.cache_dir={tmp_path / 'cache'}")
    metrics = rows(run_dir)
    assert [r["step"] for r in metrics] == list(range(1, 41))
    for r in metrics:
        assert KEYS <= set(r), set(KEYS) - set(r)
        assert all(math.isfinite(r[k]) for k in KEYS)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_mem_mb"] > 0
    first = sum(r["loss"] for r in metrics[:5]) / 5
    last = sum(r["loss"] for r in metrics[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert "step 40/40" in proc.stdout and "eta" in proc.stdout
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb offline run missing"
    assert (run_dir / "checkpoints" / "step_00000040" / "meta.json").is_file()

    sample = _generate(run_dir / "checkpoints", "--tokens", "20")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("def ") and len(sample.stdout) > 10


def test_torchrun_resume_gives_the_same_next_losses(tiny_dataset, tmp_path):
    """Under torchrun at 2 ranks, rerunning the same command resumes: one line says from where."""
    full = tmp_path / "full"
    train(full, *tiny(tiny_dataset, "train.steps=8", "checkpoint.every=4", "train.micro_batch_size=4"), nproc=2)

    # Same layout: a copy of the run that "crashed" after step 4's checkpoint.
    same = tmp_path / "same"
    shutil.copytree(full, same)
    shutil.rmtree(same / "checkpoints" / "step_00000008")
    proc = train(same, *tiny(tiny_dataset, "train.steps=8", "checkpoint.every=4", "train.micro_batch_size=4"), nproc=2)
    assert proc.stdout.count("resumed from") == 1
    assert f"resumed from {same / 'checkpoints' / 'step_00000004'} at step 4" in proc.stdout
    assert_same_curve(rows(full), rows(same), rel=1e-6)
    assert list(same.glob("metrics.jsonl.*.bak")), "superseded rows must be kept in a backup"

    # A resume that would silently train on another sample stream is refused.
    results = _launch_ranks(
        tmp_path / "seed", tiny(tiny_dataset, "train.steps=8", "train.seed=7", f"checkpoint.dir={full / 'checkpoints'}")
    )
    assert [code for code, _ in results] == [2, 2], results
    assert "train.seed" in results[0][1]


def _launch_ranks(run_dir: Path, overrides: list[str], world: int = 2, timeout: float = 90) -> list[tuple[int, str]]:
    """Start every rank by hand (no torchrun to kill the others): each must exit on its own."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = _env()
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        cmd = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
            results.append((p.returncode, err))
    finally:
        for p in procs:
            p.kill()
    return results


# (overrides, what the error line says, whether every rank prints it). An error that every rank reaches
# alike (a config rule, or an outcome the ranks exchanged) is printed once per node; an error a rank meets
# on its own (reading data) is printed by that rank, so it survives the launcher killing the others.
BAD = [
    (["parallel.dp=3"], "world size 2 != dp 3", False),
    (["train.global_batch_size=10"], "train.global_batch_size=10", False),
    (["model.n_heads=5"], "model.n_heads=5", False),
    (["parallel.tp=2"], "parallel.tp=2", False),
    (["train.precision=fp8"], "train.precision='fp8'", False),
    (["optim.min_lr=1"], "optim.min_lr=1", False),
    (["data.dataset_dir=/nonexistent/data"], "/nonexistent/data", True),
    (["data.dataset_dir=null", "data.text=[/nonexistent/text]"], "/nonexistent/text", True),
    (["model.seq_len=60000"], "training windows", True),
    (["checkpoint.resume=/nonexistent/ckpt"], "checkpoint.resume='/nonexistent/ckpt'", False),
    (["checkpoint.dir=/proc/trident-ckpt"], "cannot write to checkpoint.dir /proc/trident-ckpt", False),
    (
        ["data.dataset_dir=null", f"data.text=[{REPO / 'README.md'}]", "data.cache_dir=/proc/trident-cache"],
        "cannot write the dataset cache data.cache_dir=/proc/trident-cache",
        True,
    ),
    # Hydra's own errors, before any of trident's code runs, end the same way.
    (["model=gpt-huge"], "Could not find 'model/gpt-huge'; Available options in 'model': gpt-1.3b, gpt-medium", False),
    (["train.steps=abc"], "train.steps=abc; Value 'abc' of type 'str' could not be converted to Integer", False),
]


@pytest.mark.parametrize("overrides,message,every_rank", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_input_fails_fast_on_every_rank(tiny_dataset, tmp_path, overrides, message, every_rank):
    start = time.monotonic()
    results = _launch_ranks(tmp_path / "run", tiny(tiny_dataset, "train.steps=2", *overrides))
    assert time.monotonic() - start < 60
    assert [code for code, _ in results] == [2, 2], results
    lines = [line for line in results[0][1].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    # Both ranks are local rank 0..1 of one node: rank 1 speaks only for an error of its own.
    assert [line for line in results[1][1].splitlines() if line.strip()] == (lines if every_rank else [])


@pytest.mark.parametrize("override", ["parallel.foo=1", "+parallel.foo=1", "+foo=1"])
def test_unknown_key_is_rejected_before_training(tmp_path, override):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={tmp_path}", override],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "foo" in lines[0], lines


def test_unwritable_run_dir_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "hydra.run.dir=/proc/trident-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: cannot create the run directory: [Errno 2] No such file or directory: '/proc/trident-run'; "
        "set hydra.run.dir to a writable directory"
    ]


def test_generate_from_a_model_whose_vocab_is_padded(tiny_dataset, tmp_path):
    """vocab 600 runs with a 640-row embedding; the checkpoint holds the 600 real rows, as every preset's
    50257 does. Sampling from it must load them into a padded table again."""
    run_dir = tmp_path / "run"
    train(run_dir, *tiny(tiny_dataset, "train.steps=2", "model.vocab_size=600", "train.eval_every=0"))
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    greedy = [_generate(checkpoint, "--tokens", "8", "--temperature", "0") for _ in range(2)]
    assert greedy[0].returncode == 0, greedy[0].stderr
    assert greedy[0].stdout == greedy[1].stdout and greedy[0].stdout.startswith("def ")

    (checkpoint / "model.pt").write_bytes(b"not a checkpoint")
    broken = _generate(checkpoint)
    assert broken.returncode == 2
    assert len(broken.stderr.splitlines()) == 1
    assert broken.stderr.startswith(f"error: cannot read checkpoint file {checkpoint / 'model.pt'}")
