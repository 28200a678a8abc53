"""Train in-process under any layout: a typed config from the same Hydra YAML the command line uses, run on
the harness's ranks, and each rank's per-step history back. Most training tests go through here instead of a
``torchrun train.py`` subprocess. The one-process runs the layouts are compared with are ``References``: each
trained once per session, whichever modules ask for it (the ``references`` fixture, tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import REPO
from train import run
from trident.config import Config, compose_config
from trident_dev.curves import REL, curve_mismatches
from trident_dev.ranks import run_distributed


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


def train_rank(rank: int, world: int, cfg: Config, run_dir: Path) -> list[dict]:
    """One rank of a run (for ``run_distributed``): its history."""
    return run(cfg, run_dir)


def train_in_process(run_dir: Path, overrides: list[str], world: int = 1) -> list[list[dict]]:
    """Every rank's history of a run of ``world`` ranks."""
    return run_distributed(train_rank, world, make_config(*overrides), run_dir, timeout_s=300)


class References:
    """One-process runs, each trained once: a module comparing layouts with one process, and another comparing
    others with the same one, share the run. A run is known by its resolved config, so two override lists that
    say the same (in another order, or a key given twice) are one run. Callers must not write into a reference's
    directory (a checkpoint of it is read, and resumed into another directory)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[str, tuple[Path, list[dict]]] = {}

    def _run(self, overrides: list[str]) -> tuple[Path, list[dict]]:
        cfg = make_config(*overrides)
        key = repr(cfg)
        if key not in self._runs:
            run_dir = self.root / f"one-{len(self._runs)}"
            (history,) = run_distributed(train_rank, 1, cfg, run_dir, timeout_s=300)
            self._runs[key] = (run_dir, history)
        return self._runs[key]

    def history(self, overrides: list[str]) -> list[dict]:
        """The one-process run's history (a copy: the caller may slice or change it)."""
        return [dict(row) for row in self._run(overrides)[1]]

    def run_dir(self, overrides: list[str]) -> Path:
        """The one-process run's directory (its checkpoints, its metrics file), after training it if need be."""
        return self._run(overrides)[0]


def assert_same_curve(expected: list[dict], got: list[dict], rel: float = REL) -> None:
    """Same steps, and the same loss, global gradient norm and validation loss at each (trident_dev/curves.py)."""
    mismatches = curve_mismatches(expected, got, rel)
    assert not mismatches, "; ".join(mismatches[:5])
