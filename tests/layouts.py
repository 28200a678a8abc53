"""Train in-process under any layout: a typed config from the same Hydra YAML the command line uses, run on
the harness's ranks, and each rank's per-step history back. Most training tests go through here instead of a
``torchrun train.py`` subprocess."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO
from train import run
from trident.config import Config, compose_config
from trident.curves import REL, curve_mismatches
from trident.ranks import run_distributed


def make_config(*overrides: str) -> Config:
    return compose_config(REPO / "conf", overrides)


def tiny(dataset: Path, *extra: str) -> list[str]:
    """gpt-tiny on the test dataset: 16 sequences a step, validation every 4 steps."""
    return [
        "model=gpt-tiny",
        f"data.dataset_dir={dataset}",
        "wandb.mode=disabled",
        "train.global_batch_size=16",
        "train.eval_every=4",
        "train.eval_batches=1",
        "optim.warmup_steps=2",
        "logging.peak_tflops=1",  # MFU against a fixed peak: no matmul probe of a machine the tests keep busy
        *extra,
    ]


def four_layers(dataset: Path, steps: int, *extra: str) -> list[str]:
    """``tiny`` with 4 layers (room for pp x vpp), vocab 515 (which no tp divides: the padded vocabulary is
    exercised) and micro-batches of 2, for ``steps`` steps."""
    return tiny(
        dataset, f"train.steps={steps}", "train.micro_batch_size=2", "model.n_layers=4", "model.vocab_size=515", *extra
    )


def _train(rank: int, world: int, cfg: Config, run_dir: Path) -> list[dict]:
    return run(cfg, run_dir)


def train_in_process(run_dir: Path, overrides: list[str], world: int = 1) -> list[list[dict]]:
    """Every rank's history of a run of ``world`` ranks."""
    return run_distributed(_train, world, make_config(*overrides), run_dir, timeout_s=300)


def assert_same_curve(expected: list[dict], got: list[dict], rel: float = REL) -> None:
    """Same steps, and the same loss, global gradient norm and validation loss at each (trident/curves.py)."""
    mismatches = curve_mismatches(expected, got, rel)
    assert not mismatches, "; ".join(mismatches[:5])
