"""optim.name=muon under every layout gives the one-process Muon curve of the same seed (parallel/zero/muon.py:
each logical matrix put together on its owner, orthogonalised whole, its result scattered back), and a Muon
checkpoint resumes under another layout with the uninterrupted losses.

llama-tiny (4 query heads sharing 2 key/value heads: kv split at tp=2, replicated at tp=4), gpt-tiny (the fused
qkv: three matrices) and moe-tiny (each expert's matrices apart, split over ep)."""

from __future__ import annotations

import pytest

from tests.helpers.layouts import assert_same_curve, four_layers, train_in_process

pytestmark = pytest.mark.multiprocess

STEPS = 5
SAVED_AT = 3
MUON = ["optim.name=muon", "optim.muon_lr=0.02", "optim.muon_ns_dtype=fp32"]


def _base(dataset, model: str, *extra: str) -> list[str]:
    return four_layers(dataset, STEPS, f"model={model}", *MUON, *extra)


LAYOUTS = {
    "llama-tp2-sp": ("llama-tiny", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "llama-tp4-kv-replicated": ("llama-tiny", 4, ["parallel.tp=4"]),
    "llama-pp2-1f1b": ("llama-tiny", 2, ["parallel.pp=2"]),
    "llama-pp2-vpp2-interleaved": ("llama-tiny", 2, ["parallel.pp=2", "parallel.vpp=2"]),
    "llama-dp2-zero1": ("llama-tiny", 2, ["parallel.dp=2", "parallel.zero=1"]),
    "llama-dp2-zero2-offload": (
        "llama-tiny",
        2,
        ["parallel.dp=2", "parallel.zero=2", "parallel.offload.optimizer=cpu", "parallel.offload.ratio=0.5"],
    ),
    "llama-dp2-tp2-zero3": ("llama-tiny", 4, ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"]),
    "llama-cp2": ("llama-tiny", 2, ["parallel.cp=2"]),
    "gpt-dp2-tp2-pp2-zero1": (
        "gpt-tiny",
        8,
        ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1", "parallel.sequence_parallel=true"],
    ),
    "moe-ep2": ("moe-tiny", 2, ["parallel.dp=2", "parallel.ep=2"]),
    "moe-ep2-zero3": ("moe-tiny", 2, ["parallel.dp=2", "parallel.ep=2", "parallel.zero=3"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_layouts_give_the_one_process_curve(tiny_dataset, tmp_path, references, name):
    model, world, extra = LAYOUTS[name]
    reference = references.history(_base(tiny_dataset, model))
    for history in train_in_process(tmp_path, _base(tiny_dataset, model, *extra), world=world):
        assert_same_curve(reference, history)
