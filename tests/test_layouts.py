"""Every data-parallel layout gives the one-process run's curve, and a checkpoint moves between them."""

from __future__ import annotations

import pytest

from tests.layouts import assert_same_curve, tiny, train_in_process

REL = 2e-4  # fp32, up to the order of floating-point reductions


@pytest.fixture(scope="module")
def reference(tiny_dataset, tmp_path_factory) -> list[dict]:
    """The one-process run: 8 steps, one micro-batch of 16 per step."""
    run_dir = tmp_path_factory.mktemp("one")
    (history,) = train_in_process(run_dir, tiny(tiny_dataset, "train.steps=8", "train.micro_batch_size=16"))
    return history


@pytest.mark.parametrize("dp,mbs", [(2, 8), (2, 2), (4, 4), (4, 1)], ids=lambda v: str(v))
def test_dp_gives_the_one_process_curve_and_norm(tiny_dataset, tmp_path, reference, dp, mbs):
    histories = train_in_process(
        tmp_path, tiny(tiny_dataset, "train.steps=8", f"train.micro_batch_size={mbs}"), world=dp
    )
    assert len(histories) == dp
    for history in histories:  # every rank knows the loss and the global norm, not just the logging rank
        assert_same_curve(reference, history, REL)


def test_a_dp2_checkpoint_resumes_at_dp1_and_dp4_with_the_uninterrupted_losses(tiny_dataset, tmp_path, reference):
    saved = tmp_path / "dp2"
    overrides = tiny(tiny_dataset, "train.steps=8", "checkpoint.every=4", "train.micro_batch_size=4")
    (history, _) = train_in_process(saved, overrides, world=2)
    assert_same_curve(reference, history, REL)
    checkpoint = saved / "checkpoints" / "step_00000004"
    for dp in (1, 4):
        resumed = train_in_process(
            tmp_path / f"dp{dp}",
            tiny(tiny_dataset, "train.steps=8", "train.micro_batch_size=2", f"checkpoint.resume={checkpoint}"),
            world=dp,
        )
        for rows in resumed:
            assert_same_curve(history[4:], rows, REL)
