"""Non-finite steps in every precision: a step whose loss or global gradient norm is not finite is skipped on every
rank (GradStep: the global norm is the verdict every rank shares), leaving every parameter, master weight, AdamW
moment and step counter and every router bias bitwise as they were; its metrics row says so, training goes on, and
``train.max_skipped_steps`` such steps in a row stop the run with its reason (trident/divergence.py).

The NaN is injected by a test-only wrapper around the trainer's loss, on data-parallel rank 0's first micro-batch
of the chosen steps: one bad micro-batch of the global batch, as a corrupt sample or an overflowing op would give."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers.layouts import four_layers, make_config
from train import run
from trident.errors import DivergenceError
from trident.loop import Trainer
from trident.models.moe import balancing_state
from trident_dev.ranks import run_distributed


def _state(trainer: Trainer) -> list[torch.Tensor]:
    """Every tensor of this rank's model state but the gradients: parameters, masters, AdamW's moments and step
    counters (the optimizer's own list), and the loss-free balancing biases."""
    states = trainer.grad_step.model_state_tensors()
    chunks = trainer.model_chunks
    held = [*states["params"], *states["optimizer"], *(p for c in chunks for p in c.parameters())]
    return [t.detach().clone() for t in [*held, *balancing_state(chunks).values()]]


def _poisoned_rank(rank: int, world: int, cfg, run_dir: Path, steps: set[int]) -> dict:
    """A run whose loss is NaN on dp rank 0's first micro-batch of each of ``steps``; per poisoned step, whether it
    was skipped and whether the state after it is the state before it, bit for bit."""
    real = Trainer.train_step
    checks: dict[int, tuple[bool, bool]] = {}

    def train_step(self: Trainer, step: int, micro_batches: list) -> object:
        if step not in steps:
            return real(self, step, micro_batches)
        before, loss_fn, first = _state(self), self.loss_fn, micro_batches[0].targets
        poison = self.groups.dp_rank == 0
        self.loss_fn = lambda out, y: loss_fn(out, y) * (math.nan if poison and y is first else 1.0)
        try:
            result = real(self, step, micro_batches)
        finally:
            self.loss_fn = loss_fn
        after = _state(self)
        same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        checks[step] = (result.skipped, same)
        return result

    Trainer.train_step = train_step
    try:
        history, stopped = run(cfg, run_dir), None
    except DivergenceError as e:
        history, stopped = None, str(e)
    finally:
        Trainer.train_step = real
    return {"history": history, "stopped": stopped, "checks": checks}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("precision", "layout", "world"),
    [
        ("fp32", ["parallel.tp=2", "parallel.pp=2"], 4),
        ("bf16", ["parallel.dp=2"], 2),
        # Muon's momentum untouched by a skipped overflow step (DeepSpeed #8432: an fp16 overflow poisoned it)
        ("fp16", ["parallel.dp=2", "parallel.zero=1", "optim.name=muon"], 2),
    ],
    ids=["fp32-tp2-pp2", "bf16-dp2", "fp16-muon-dp2-zero1"],
)
def test_a_nan_micro_batch_skips_its_step_bitwise_and_training_goes_on(
    tiny_dataset: Path, tmp_path: Path, precision: str, layout: list[str], world: int
) -> None:
    overrides = four_layers(tiny_dataset, 5, "train.eval_every=0", f"train.precision={precision}", *layout)
    results = run_distributed(_poisoned_rank, world, make_config(*overrides), tmp_path, {2}, timeout_s=300)
    for r in results:
        assert r["stopped"] is None and r["checks"] == {2: (True, True)}, r["checks"]
        rows = r["history"]
        assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
        assert rows[2]["skipped"] is True and not math.isfinite(rows[2]["loss"]), rows[2]
        assert all(not row.get("skipped") and math.isfinite(row["loss"]) for i, row in enumerate(rows) if i != 2)
        assert rows[3]["loss"] < rows[1]["loss"] + 1.0  # it trains on from the state before the bad step


@pytest.mark.multiprocess
def test_the_bound_on_skipped_steps_stops_the_run_with_its_reason(tiny_dataset: Path, tmp_path: Path) -> None:
    """moe-tiny (its loss-free balancing biases move only after a step that was applied) at bf16, dp=2: steps 2 and 3
    poisoned with train.max_skipped_steps=2: both skipped bit for bit, then the run stops saying why."""
    overrides = [
        *four_layers(tiny_dataset, 6, "train.eval_every=0", "train.precision=bf16", "parallel.dp=2"),
        "model=moe-tiny",
        "model.moe.bias_update_rate=0.01",
        "train.max_skipped_steps=2",
    ]
    results = run_distributed(_poisoned_rank, 2, make_config(*overrides), tmp_path, {2, 3}, timeout_s=300)
    for r in results:
        assert r["checks"] == {2: (True, True), 3: (True, True)}, r["checks"]
        assert r["stopped"] is not None
        assert "the gradients were not finite 2 steps in a row, all skipped (train.max_skipped_steps)" in r["stopped"]
