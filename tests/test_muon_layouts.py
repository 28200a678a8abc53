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


@pytest.mark.parametrize("name", ["llama-tp2-sp", "llama-dp2-tp2-zero3"])
def test_bf16_newton_schulz_layouts_stay_within_its_rounding(tiny_dataset, tmp_path, references, name):
    """torch's Newton-Schulz runs in bf16 (an ulp is 2^-8 of a value): a layout's fp32 sums in another order (about
    1e-7 apart) flip a few of its roundings, so the update moves by a bf16 ulp in some elements. Measured over 10
    steps of llama-tiny: losses within 7.3e-6 of one process, global gradient norms within 5.2e-4 (pp=2, whose sums
    run in the same order, 0 and 7e-8). fp32 Newton-Schulz (above) gives the usual 2e-4."""
    model, world, extra = LAYOUTS[name]
    bf16 = [o for o in _base(tiny_dataset, model) if o != "optim.muon_ns_dtype=fp32"]
    reference = references.history(bf16)
    for history in train_in_process(tmp_path, [*bf16, *extra], world=world):
        assert_same_curve(reference, history, rel=2e-3)


def test_a_muon_checkpoint_resumes_under_another_layout_with_the_uninterrupted_losses(
    tiny_dataset, tmp_path, references
):
    """Saved at tp=2 + SP (momentum in tp shards), resumed at dp=2 x ZeRO-3 (in dp shards cut across the matrices):
    the steps after the save are the uninterrupted one-process run's."""
    base = _base(tiny_dataset, "llama-tiny")
    reference = references.history(base)
    saving = [*base, f"checkpoint.every={SAVED_AT}", "parallel.tp=2", "parallel.sequence_parallel=true"]
    train_in_process(tmp_path / "saved", saving, world=2)
    saved = tmp_path / "saved" / "checkpoints" / f"step_{SAVED_AT:08d}"
    resuming = [*base, f"checkpoint.resume={saved}", "parallel.dp=2", "parallel.zero=3"]
    for rows in train_in_process(tmp_path / "resumed", resuming, world=2):
        assert [r["step"] for r in rows] == list(range(SAVED_AT + 1, STEPS + 1))
        assert_same_curve(reference[SAVED_AT:], rows)


def test_resuming_the_other_optimizers_state_is_refused_in_one_line_or_starts_afresh(tiny_dataset, tmp_path):
    from tests.helpers.processes import run_train

    adamw = [o for o in _base(tiny_dataset, "llama-tiny") if not o.startswith("optim.")]
    train_in_process(tmp_path / "adamw", [*adamw, f"checkpoint.every={SAVED_AT}"])
    saved = tmp_path / "adamw" / "checkpoints" / f"step_{SAVED_AT:08d}"
    muon = [*_base(tiny_dataset, "llama-tiny"), f"checkpoint.resume={saved}"]
    proc = run_train(tmp_path / "refused", muon)
    assert proc.returncode == 2, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "holds the state of optim.name=adamw, this run steps with optim.name=muon" in line
    assert "checkpoint.fresh_optimizer=true" in line
    (rows,) = train_in_process(tmp_path / "fresh", [*muon, "checkpoint.fresh_optimizer=true"])
    assert [r["step"] for r in rows] == list(range(SAVED_AT + 1, STEPS + 1))
