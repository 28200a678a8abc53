"""The whole 3D: dp x tp x pp layouts, with ZeRO, sequence parallelism and activation checkpointing, give the
one-process loss curve of the same seed, and a checkpoint saved under one 3D layout resumes under another.

gpt-tiny with 4 layers and vocab 515 (which no tp divides, so the padded vocabulary is exercised), 16 sequences
a step in micro-batches of 2. Every run validates at its last step, so the pipeline's forward-only path runs too.
"""

from __future__ import annotations

import pytest

from tests.helpers.layouts import assert_same_curve, four_layers, train_in_process

pytestmark = pytest.mark.multiprocess

STEPS = 6
SAVED_AT = 3  # the resumed runs take the next 3 steps (4 and 6 validate)


def _base(dataset, *extra: str) -> list[str]:
    return four_layers(dataset, STEPS, *extra)


@pytest.fixture
def reference(tiny_dataset, references) -> list[dict]:
    return references.history(_base(tiny_dataset))


@pytest.fixture
def short_reference(tiny_dataset, references) -> list[dict]:
    """4 steps: the learning-rate schedule depends on train.steps, so a shorter run has its own reference."""
    return references.history(_base(tiny_dataset, "train.steps=4"))


# The design card's command (`torchrun --nproc-per-node 8 train.py parallel.tp=2 parallel.pp=4`) and the issue's
# full composition: every parallelism at once.
CARD = ["parallel.tp=2", "parallel.pp=4"]
FULL_3D = [
    "parallel.dp=2",
    "parallel.tp=2",
    "parallel.pp=2",
    "parallel.vpp=2",
    "parallel.zero=1",
    "parallel.sequence_parallel=true",
    "train.activation_checkpointing=selective",
]


@pytest.mark.parametrize("extra", [CARD, FULL_3D], ids=["card-tp2-pp4", "dp2-tp2-pp2-vpp2-zero1-sp-selective"])
def test_3d_layouts_give_the_one_process_curve(tiny_dataset, tmp_path, short_reference, extra):
    histories = train_in_process(tmp_path, _base(tiny_dataset, "train.steps=4", *extra), world=8)
    assert len(histories) == 8
    for history in histories:  # every rank, whichever stage, knows the loss, the global norm and the val loss
        assert_same_curve(short_reference, history)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_pipeline_gives_the_one_process_curve(tiny_dataset, tmp_path, short_reference, zero):
    extra = ["train.steps=4", "parallel.pp=2", "parallel.dp=2", f"parallel.zero={zero}", "parallel.schedule=1f1b"]
    histories = train_in_process(tmp_path, _base(tiny_dataset, *extra), world=4)
    for history in histories:
        assert_same_curve(short_reference, history)


# ZeRO-3 under every pipeline schedule, in both gather modes (parallel/zero/stage3.py): the tied embedding
# and its copy on the two ends, interleaved chunks, zb-h1's and zb-v's split backward, recomputation and tensor
# parallelism.
ZERO3 = ["train.steps=4", "parallel.zero=3", "parallel.pp=2"]
ZERO3_LAYOUTS = {
    # pp2 under 1f1b in micro_batch mode (the defaults) is a saving run of the zero3 checkpoint test below.
    "pp2-1f1b-step-attention": (
        4,
        ["parallel.schedule=1f1b", "parallel.zero3_gather=step", "train.activation_checkpointing=attention"],
    ),
    "pp2-vpp2-micro_batch-prefetch0-full-every2": (
        4,
        [
            "parallel.vpp=2",
            "parallel.zero3_prefetch=0",
            "train.activation_checkpointing=full",
            "train.recompute_every=2",
        ],
    ),
    "pp2-vpp2-step-prefetch2": (4, ["parallel.vpp=2", "parallel.zero3_gather=step", "parallel.zero3_prefetch=2"]),
    "pp2-zbh1-micro_batch-full": (4, ["parallel.schedule=zb-h1", "train.activation_checkpointing=full"]),
    "pp2-zbh1-step-selective": (
        4,
        ["parallel.schedule=zb-h1", "parallel.zero3_gather=step", "train.activation_checkpointing=selective"],
    ),
    "tp2-pp2-dp2-micro_batch-sp": (8, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    # zb-v: both ends of the tied embedding in two chunks of one rank, each summed in its own bucket's shard
    "pp2-zbv-dp2-micro_batch": (4, ["parallel.vpp=2", "parallel.schedule=zb-v"]),
}


@pytest.mark.parametrize("name", list(ZERO3_LAYOUTS))
def test_zero3_with_pipeline_gives_the_one_process_curve(tiny_dataset, tmp_path, short_reference, name):
    world, extra = ZERO3_LAYOUTS[name]
    histories = train_in_process(tmp_path, _base(tiny_dataset, *ZERO3, *extra), world=world)
    for history in histories:
        assert_same_curve(short_reference, history)


A = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"]
B = ["parallel.dp=2", "parallel.tp=1", "parallel.pp=4", "parallel.zero=1"]


def _saved_and_resumed_both_ways(
    dataset, tmp_path, reference, layouts: dict[str, list[str]], resumed_into: dict[str, list[str]], world: int
) -> None:
    """Train each of the two ``layouts`` (checked against one process, every rank) with a checkpoint at SAVED_AT,
    then resume each one's checkpoint under ``resumed_into[name]``: every rank's next steps are the uninterrupted
    run's."""
    saved = {}
    for name, layout in layouts.items():
        histories = train_in_process(tmp_path / name, _base(dataset, f"checkpoint.every={SAVED_AT}", *layout), world)
        assert len(histories) == world
        for history in histories:
            assert_same_curve(reference, history)
        saved[name] = (tmp_path / name / "checkpoints" / f"step_{SAVED_AT:08d}", histories[0])
    for source, target in resumed_into.items():
        checkpoint, uninterrupted = saved[source]
        resumed = train_in_process(
            tmp_path / f"{source}-resumed", _base(dataset, f"checkpoint.resume={checkpoint}", *target), world
        )
        for rows in resumed:
            assert [r["step"] for r in rows] == list(range(SAVED_AT + 1, STEPS + 1))
            assert_same_curve(uninterrupted[SAVED_AT:], rows)


def test_a_checkpoint_moves_between_3d_layouts_with_the_uninterrupted_losses(tiny_dataset, tmp_path, reference):
    """Save at tp=2 pp=2 dp=2, resume at tp=1 pp=4 dp=2 zero=1, and the reverse: the next 3 losses (and norms and
    validation losses) are the uninterrupted run's. Both saving runs are themselves checked against one process."""
    _saved_and_resumed_both_ways(tiny_dataset, tmp_path, reference, {"A": A, "B": B}, {"A": B, "B": A}, 8)


ZERO3_PP = ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3"]
ZERO1_TP = ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1"]


def test_a_zero3_pipeline_checkpoint_moves_to_zero1_tp_and_back_with_the_uninterrupted_losses(
    tiny_dataset, tmp_path, reference
):
    """Save at zero=3 pp=2 dp=2, resume at zero=1 tp=2 dp=2 (no pipeline), and the reverse into zero=3 pp=2 in step
    mode: the next 3 losses, norms and validation losses are the uninterrupted run's (masters and moments are
    logical boxes, whatever the buckets and chunks that held them)."""
    layouts = {"zero3-pp": ZERO3_PP, "zero1-tp": ZERO1_TP}
    resumed_into = {"zero3-pp": ZERO1_TP, "zero1-tp": [*ZERO3_PP, "parallel.zero3_gather=step"]}
    _saved_and_resumed_both_ways(tiny_dataset, tmp_path, reference, layouts, resumed_into, 4)


@pytest.mark.parametrize(
    "world,extra",
    [
        (4, ["train.precision=bf16", "parallel.dp=2", "parallel.zero=1"]),
        (2, ["train.precision=fp16"]),
        (4, ["train.precision=fp16", "parallel.dp=2", "parallel.vpp=2"]),  # each chunk reduced after its last B
    ],
    ids=["pp2-dp2-zero1-bf16", "pp2-fp16", "pp2-dp2-vpp2-fp16"],
)
def test_pipeline_trains_in_16_bit_close_to_the_fp32_curve(tiny_dataset, tmp_path, short_reference, world, extra):
    """16-bit activations cross the stages (the p2p buffers take the parameters' dtype); 4 steps stay within 1% of
    the fp32 one-process losses, and no step is skipped (fp16: no overflow at the starting loss scale)."""
    histories = train_in_process(tmp_path, _base(tiny_dataset, "train.steps=4", "parallel.pp=2", *extra), world=world)
    for history in histories:
        for ours, ref in zip(history, short_reference, strict=True):
            assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-2), (ours["step"], ours["loss"], ref["loss"])
            assert not ours.get("skipped")
