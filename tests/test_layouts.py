"""Every data-parallel layout gives the one-process run's curve, and a checkpoint moves between them."""

from __future__ import annotations

import pytest

from tests.helpers.layouts import assert_same_curve, tiny, train_in_process

pytestmark = pytest.mark.multiprocess


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
        assert_same_curve(reference, history)


def test_a_dp2_checkpoint_resumes_at_dp1_and_dp4_with_the_uninterrupted_losses(tiny_dataset, tmp_path, reference):
    saved = tmp_path / "dp2"
    overrides = tiny(tiny_dataset, "train.steps=8", "checkpoint.every=4", "train.micro_batch_size=4")
    (history, _) = train_in_process(saved, overrides, world=2)
    assert_same_curve(reference, history)
    checkpoint = saved / "checkpoints" / "step_00000004"
    for dp in (1, 4):
        resumed = train_in_process(
            tmp_path / f"dp{dp}",
            tiny(tiny_dataset, "train.steps=8", "train.micro_batch_size=2", f"checkpoint.resume={checkpoint}"),
            world=dp,
        )
        for rows in resumed:
            assert_same_curve(history[4:], rows)


# Tensor parallelism: tp alone, with sequence parallelism, and combined with dp; vocab 515 is divided by no tp,
# so the padded columns of the vocab-parallel head are exercised too.
TP_LAYOUTS = [
    (2, 2, []),
    (2, 2, ["parallel.sequence_parallel=true"]),
    (4, 4, []),
    (4, 2, ["parallel.sequence_parallel=true"]),  # dp=2 x tp=2
]


@pytest.fixture(scope="module")
def reference_515(tiny_dataset, tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("one515")
    overrides = tiny(tiny_dataset, "train.steps=6", "train.micro_batch_size=4", "model.vocab_size=515")
    (history,) = train_in_process(run_dir, overrides)
    return history


@pytest.mark.parametrize("world,tp,extra", TP_LAYOUTS, ids=lambda v: str(v))
def test_tp_gives_the_one_process_curve(tiny_dataset, tmp_path, reference_515, world, tp, extra):
    overrides = tiny(tiny_dataset, "train.steps=6", "train.micro_batch_size=4", "model.vocab_size=515")
    histories = train_in_process(tmp_path, [*overrides, f"parallel.tp={tp}", *extra], world=world)
    for history in histories:
        assert_same_curve(reference_515, history)


def test_tp_checkpoints_resume_at_other_tp(tiny_dataset, tmp_path, reference_515):
    """tp=2 (with SP) -> tp=1 and tp=4; tp=1 and tp=4 -> tp=2: each gives the uninterrupted run's next losses."""
    base = tiny(tiny_dataset, "train.steps=6", "train.micro_batch_size=4", "model.vocab_size=515")
    saved = {}
    sources = [
        ("tp2", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("tp1", 1, []),
        ("tp4", 4, ["parallel.tp=4"]),
    ]
    for name, world, extra in sources:
        histories = train_in_process(tmp_path / name, [*base, "checkpoint.every=3", *extra], world=world)
        assert_same_curve(reference_515, histories[0])
        saved[name] = tmp_path / name / "checkpoints" / "step_00000003"
    for source, world, tp in [("tp2", 1, 1), ("tp2", 4, 4), ("tp1", 2, 2), ("tp4", 2, 2)]:
        resumed = train_in_process(
            tmp_path / f"{source}-to-tp{tp}",
            [*base, f"parallel.tp={tp}", f"checkpoint.resume={saved[source]}"],
            world=world,
        )
        for rows in resumed:
            assert_same_curve(reference_515[3:], rows)
