"""A Llama-family block (llama-tiny: RMSNorm, SwiGLU, RoPE, 4 query heads sharing 2 key/value heads, no biases, an
untied head) under every layout gives the one-process curve of the same seed, and its checkpoints reshard.

4 layers, vocabulary 515 (no tp divides it), 16 sequences a step in micro-batches of 2. tp=4 is above the 2 kv heads:
each rank holds both and computes the one its query heads read (their gradients summed over tp); tp=2 splits them.
"""

from __future__ import annotations

import pytest

from tests.helpers.layouts import assert_same_curve, four_layers, train_in_process

pytestmark = pytest.mark.multiprocess

STEPS = 6
SAVED_AT = 3


def _base(dataset, *extra: str) -> list[str]:
    return four_layers(dataset, STEPS, "model=llama-tiny", *extra)


@pytest.fixture
def reference(tiny_dataset, references) -> list[dict]:
    return references.history(_base(tiny_dataset))


LAYOUTS = {
    "dp2": (2, ["parallel.dp=2"]),
    "tp2-kv-split": (2, ["parallel.tp=2"]),
    # tp=4 alone (kv heads replicated) is a saving run of the reshard test below.
    "tp4-kv-replicated-sp": (4, ["parallel.tp=4", "parallel.sequence_parallel=true"]),
    "tp2-sp-full-recompute": (
        2,
        ["parallel.tp=2", "parallel.sequence_parallel=true", "train.activation_checkpointing=full"],
    ),
    "pp2-1f1b": (2, ["parallel.pp=2"]),
    "pp2-vpp2-interleaved": (2, ["parallel.pp=2", "parallel.vpp=2"]),
    "pp2-zb-h1": (2, ["parallel.pp=2", "parallel.schedule=zb-h1"]),
    "dp2-zero1": (2, ["parallel.dp=2", "parallel.zero=1"]),
    "dp2-zero2-offload": (
        2,
        ["parallel.dp=2", "parallel.zero=2", "parallel.offload.optimizer=cpu", "parallel.offload.ratio=0.5"],
    ),
    "dp2-tp2-zero3": (4, ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"]),
    "dp2-tp4-zero3-kv-replicated": (8, ["parallel.dp=2", "parallel.tp=4", "parallel.zero=3"]),
    "3d-dp2-tp2-pp2-zero1-sp-selective": (
        8,
        [
            "parallel.dp=2",
            "parallel.tp=2",
            "parallel.pp=2",
            "parallel.zero=1",
            "parallel.sequence_parallel=true",
            "train.activation_checkpointing=selective",
        ],
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_layouts_give_the_one_process_curve(tiny_dataset, tmp_path, reference, name):
    world, extra = LAYOUTS[name]
    histories = train_in_process(tmp_path, _base(tiny_dataset, *extra), world=world)
    for history in histories:
        assert_same_curve(reference, history)


@pytest.mark.parametrize(
    "world,extra",
    [
        (2, ["model.n_kv_heads=1", "parallel.tp=2"]),  # multi-query: the one kv head replicated
        (2, ["model.n_kv_heads=4", "parallel.pp=2"]),  # multi-head (fused qkv) with rope, untied over stages
        (2, ["model.tie_embeddings=true", "model.bias=true", "parallel.pp=2"]),  # tied head over stages, biases
    ],
    ids=["mqa-tp2", "mha-rope-pp2", "tied-bias-pp2"],
)
def test_llama_variants_give_the_one_process_curve(tiny_dataset, tmp_path, references, world, extra):
    one = references.history(_base(tiny_dataset, "train.steps=3", *[e for e in extra if "model." in e]))
    for history in train_in_process(tmp_path / "many", _base(tiny_dataset, "train.steps=3", *extra), world=world):
        assert_same_curve(one, history)


A = ["parallel.tp=4"]  # kv heads replicated
B = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1"]  # kv heads split, over two stages


def test_llama_checkpoints_reshard_with_the_uninterrupted_losses(tiny_dataset, tmp_path, reference):
    """Save at tp=4 (kv replicated), resume at dp2 x tp2 x pp2 (kv split) and the reverse: the next losses, norms
    and validation losses are the uninterrupted run's. Both saving runs give the one-process curve on every rank."""
    saved = {}
    for name, world, layout in (("A", 4, A), ("B", 8, B)):
        histories = train_in_process(
            tmp_path / name, _base(tiny_dataset, f"checkpoint.every={SAVED_AT}", *layout), world
        )
        assert len(histories) == world
        for history in histories:
            assert_same_curve(reference, history)
        saved[name] = tmp_path / name / "checkpoints" / f"step_{SAVED_AT:08d}"
    for source, world, target in (("A", 8, B), ("B", 4, A)):
        resumed = train_in_process(
            tmp_path / f"{source}-resumed", _base(tiny_dataset, f"checkpoint.resume={saved[source]}", *target), world
        )
        for rows in resumed:
            assert [r["step"] for r in rows] == list(range(SAVED_AT + 1, STEPS + 1))
            assert_same_curve(reference[SAVED_AT:], rows)
