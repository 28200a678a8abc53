"""The zero-bubble schedule under full recomputation recomputes each block once, in its I pass: its W pass is the
weight-gradient GEMMs of what I kept (parallel/wgrad.py), with no backward through the blocks to recompute for (torch's
split, one backward per parameter group, recomputed a block in each: 8 per micro-batch here). Counted as calls of the
blocks' forward on each pipeline rank of a real two-rank run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.layouts import make_config, tiny
from trident_dev.ranks import run_distributed

STEPS, MICRO, LAYERS = 2, 4, 4


def _count_block_forwards(rank: int, world: int, cfg, run_dir: Path) -> int:  # noqa: ANN001
    from torch._subclasses.fake_tensor import is_fake

    from train import run
    from trident.models import gpt

    calls = [0]
    forward = gpt.Block.forward

    def counting(self, x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        # The launch's memory estimate traces the blocks on fake tensors (trident/memory/trace.py): not the step's.
        calls[0] += not is_fake(x)
        return forward(self, x, *args, **kwargs)

    gpt.Block.forward = counting
    try:
        run(cfg, run_dir)
    finally:
        gpt.Block.forward = forward
    return calls[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_each_block_is_recomputed_once_per_backward_pass(tiny_dataset: Path, tmp_path: Path, schedule: str) -> None:
    """Per micro-batch and block: the forward, then one recomputation in B (1f1b) or in I (zb-h1), none in W."""
    overrides = tiny(
        tiny_dataset,
        f"train.steps={STEPS}",
        "train.eval_every=0",
        f"model.n_layers={LAYERS}",
        "train.micro_batch_size=2",  # 16 / 2 = 8 micro-batches
        "parallel.pp=2",
        f"parallel.schedule={schedule}",
        "train.activation_checkpointing=full",
    )
    counts = run_distributed(_count_block_forwards, 2, make_config(*overrides), tmp_path, timeout_s=300)
    micro = 16 // 2
    per_rank = STEPS * micro * (LAYERS // 2)
    assert counts == [per_rank * 2, per_rank * 2]
