"""The command line itself: train.py as a user runs it (one process, or ranks started by hand), its console,
its files, its one-line errors. Training math under every layout is tested in-process (tests/test_layouts.py)."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.layouts import tiny, train_in_process
from tests.helpers.processes import (
    child_env,
    read_metrics,
    run_train,
    start_ranks,
    tool_process,
    torchrun,
    train_command,
)

pytestmark = pytest.mark.multiprocess

KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mb"}


def train(run_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = run_train(run_dir, list(overrides), cwd=run_dir.parent, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(proc.args)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def _generate(checkpoint: Path, *args: str) -> subprocess.CompletedProcess:
    return tool_process("generate", str(checkpoint), *args, env=child_env())


def test_default_corpus_run_logs_every_key_and_learns(tmp_path):
    """The issue's acceptance command, on the embedded corpus, with wandb in its default offline mode."""
    run_dir = tmp_path / "run"
    proc = train(run_dir, "model=gpt-tiny", "train.steps=40", f"data.cache_dir={tmp_path / 'cache'}")
    metrics = read_metrics(run_dir)
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


def test_a_resume_that_would_train_on_other_samples_is_refused(tiny_dataset, tmp_path):
    full = tmp_path / "full"
    train_in_process(full, tiny(tiny_dataset, "train.steps=2", "train.eval_every=0"))
    changed = tiny(tiny_dataset, "train.steps=4", "train.seed=7", f"checkpoint.dir={full / 'checkpoints'}")
    with pytest.raises(RuntimeError, match="CheckpointError: the checkpoint was trained with train.seed"):
        train_in_process(tmp_path / "seed", changed)


def _launch_ranks(run_dir: Path, overrides: list[str], world: int = 2, timeout: float = 90) -> list[tuple[int, str]]:
    """Start every rank by hand (no torchrun to kill the others): each must exit on its own."""
    procs = start_ranks(run_dir, overrides, world)
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


# (overrides, what the error line says). Every rank that knows the reason prints it: whichever rank exits first,
# the launcher kills the rest, so a line left to another rank could be lost.
BAD = [
    (["parallel.dp=4"], "world size 2 != dp 4 x tp 1 x pp 1 = 4; set parallel.dp=2 or launch 4 processes"),
    (["train.global_batch_size=10"], "train.global_batch_size=10"),
    (["model.n_heads=5"], "model.n_heads=5"),
    (["parallel.pp=2", "parallel.vpp=2"], "model.n_layers=2 is not divisible by pp 2 x vpp 2 = 4"),
    (["parallel.tp=2", "model.d_ff=101"], "model.d_ff=101 is not divisible by parallel.tp=2; use model.d_ff=100"),
    (["train.precision=fp8"], "train.precision='fp8'"),
    (["optim.min_lr=1"], "optim.min_lr=1"),
    (["data.dataset_dir=/nonexistent/data"], "/nonexistent/data"),
    (["data.dataset_dir=null", "data.text=[/nonexistent/text]"], "/nonexistent/text"),
    (["model.seq_len=60000"], "training windows"),
    (["checkpoint.resume=/nonexistent/ckpt"], "checkpoint.resume='/nonexistent/ckpt'"),
    (["checkpoint.dir=/proc/trident-ckpt"], "cannot write to checkpoint.dir /proc/trident-ckpt"),
    (
        ["data.dataset_dir=null", f"data.text=[{REPO / 'README.md'}]", "data.cache_dir=/proc/trident-cache"],
        "cannot write the dataset cache data.cache_dir=/proc/trident-cache",
    ),
    # Hydra's own errors, before any of trident's code runs, end the same way.
    (["model=gpt-huge"], "Could not find 'model/gpt-huge'; Available options in 'model': gpt-1.3b, gpt-medium"),
    (["train.steps=abc"], "train.steps=abc; Value 'abc' of type 'str' could not be converted to Integer"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_fails_fast_on_every_rank(tiny_dataset, tmp_path, overrides, message):
    start = time.monotonic()
    results = _launch_ranks(tmp_path / "run", tiny(tiny_dataset, "train.steps=2", *overrides))
    assert time.monotonic() - start < 60
    assert [code for code, _ in results] == [2, 2], results
    lines = [line for line in results[0][1].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert [line for line in results[1][1].splitlines() if line.strip()] == lines


@pytest.mark.parametrize("override", ["parallel.foo=1", "+parallel.foo=1", "+foo=1"])
def test_unknown_key_is_rejected_before_training(tmp_path, override):
    proc = run_train(tmp_path, [override], timeout=60)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "foo" in lines[0], lines


@pytest.mark.parametrize("override", ["parallel.tpp=2", "+parallel.tpp=2", "paralel.tp=2", "+paralel.tp=2"])
def test_a_mistyped_key_is_told_the_nearest_key(tmp_path, override):
    # Hydra's advice for a key it does not know is to append it with +, which is refused in turn; neither names
    # the key meant. Typed with or without +, the line names the nearest keys of the schema.
    proc = run_train(tmp_path, [override], timeout=60)
    assert proc.returncode == 2
    typed = override.lstrip("+").split("=")[0]
    near = "parallel.tp or parallel.pp" if typed == "parallel.tpp" else "parallel.tp"
    assert proc.stderr.strip().splitlines() == [
        f"error: unknown config key {typed}; did you mean {near}? (the valid keys are in trident/config/schema.py)"
    ]


def test_a_shard_with_one_flipped_byte_is_refused_before_training(tiny_dataset, tmp_path):
    # Each shard's record holds its sha256; a small corpus is checked in full before step 1.
    copy = shutil.copytree(tiny_dataset, tmp_path / "tiny")
    shard = copy / "shards" / "00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    proc = run_train(tmp_path / "run", tiny(copy, "train.steps=2"), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: dataset file {shard} is damaged (sha256 "), lines
    assert "rebuild it: python tools/prepare_data.py" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("train.steps=0", "error: train.steps=0 must be >= 1"),  # trident's check
        (
            "parallel.tpp=2",
            "error: unknown config key parallel.tpp; did you mean parallel.tp or parallel.pp?",
        ),  # Hydra's
    ],
)
def test_under_torchrun_a_config_error_is_said_once_per_node_and_named_by_the_agents_summary(
    tiny_dataset, tmp_path, override, line
):
    # Every rank meets the same config error: the node's first rank to meet it says it (the others printed it too,
    # the line twice on 2 ranks), and each rank leaves it in the agent's error file (TORCHELASTIC_ERROR_FILE), so
    # torchrun's summary names the cause, where it said only "To enable traceback see ...".
    cmd = train_command(tmp_path / "run", tiny(tiny_dataset, override), launcher=torchrun(2))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=120)
    assert proc.returncode != 0
    said = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(said) <= 1 and all(x.startswith(line) for x in said), proc.stderr
    root_cause = proc.stderr.split("Root Cause")[1]
    assert f"traceback : {line}" in root_cause, proc.stderr
    assert "To enable traceback see" not in proc.stderr


def test_unwritable_run_dir_is_one_line(tmp_path):
    proc = run_train(Path("/proc/trident-run"), [], cwd=tmp_path, timeout=60)
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

    (checkpoint / "__0_0.distcp").write_bytes(b"not a checkpoint")
    broken = _generate(checkpoint)
    assert broken.returncode == 2
    assert len(broken.stderr.splitlines()) == 1
    assert broken.stderr.startswith(f"error: checkpoint {checkpoint} is damaged: __0_0.distcp is 16 bytes, its record")
