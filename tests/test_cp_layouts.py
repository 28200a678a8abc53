"""Context parallelism in the stack: each cp layout gives the one-process run's curve (loss, gradient norm,
validation loss), with each K/V exchange, packed documents with a grouped-query Llama block, tensor parallelism
with sequence parallelism and pipeline parallelism, ZeRO-3, fp16's loss scale; a checkpoint saved in the background
resumes at other cp; and ``metrics.jsonl`` records the balance. (Elsewhere under cp: dropout in test_dropout.py,
ZeRO with offload in test_zero.py, mixtures in test_mixture.py, ``init_from`` Hugging Face in test_init_from.py.)"""

from __future__ import annotations

import json

import pytest

from tests.helpers.layouts import assert_same_curve, four_layers, tiny, train_in_process
from tests.helpers.processes import read_metrics

pytestmark = pytest.mark.multiprocess


def _steps(dataset, *extra: str) -> list[str]:
    """6 steps of gpt-tiny (seq_len 64: chunks of 16 at cp=2), micro-batches of 8."""
    return tiny(dataset, "train.steps=6", "train.micro_batch_size=8", *extra)


@pytest.mark.parametrize("comm", ["ring", "allgather", "ulysses"])
def test_cp2_gives_the_one_process_curve_with_each_exchange(tiny_dataset, tmp_path, references, comm):
    reference = references.history(_steps(tiny_dataset))
    histories = train_in_process(tmp_path, _steps(tiny_dataset, "parallel.cp=2", f"parallel.cp_comm={comm}"), world=2)
    for history in histories:  # both cp ranks know the step's loss and norm
        assert_same_curve(reference, history)
    rows = read_metrics(tmp_path)
    assert [row["cp_balance"] for row in rows] == [1.0] * 6  # causal windows: the head-tail split is exact


def test_cp2_with_packed_documents_and_grouped_query_attention(tiny_dataset, tmp_path, references):
    """Llama (RoPE positions restarting per document, 2 kv heads for 4 query heads): positions and document ids
    are computed on the whole window before the split, which deals each window's tokens to the ranks by the
    document-aware balance (every sample its own indices)."""
    base = _steps(tiny_dataset, "model=llama-tiny", "data.document_mask=true")
    reference = references.history(base)
    histories = train_in_process(tmp_path, [*base, "parallel.cp=2"], world=2)
    for history in histories:
        assert_same_curve(reference, history)
    balances = [row["cp_balance"] for row in read_metrics(tmp_path)]
    assert all(1.0 <= b <= 1.05 for b in balances), balances


@pytest.mark.parametrize(
    "extra",
    [
        ("parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"),
        ("parallel.cp=2", "parallel.pp=2", "parallel.cp_comm=allgather"),
        (
            "parallel.cp=2",
            "parallel.pp=2",
            "parallel.vpp=2",
            "train.activation_checkpointing=selective",
            "train.recompute_modules=[attn_core]",
        ),
        ("parallel.cp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zb-v", "parallel.cp_comm=ulysses"),
    ],
    ids=["cp2-tp2-sp", "cp2-pp2", "cp2-pp2-interleaved-selective", "cp2-pp2-zb-v-ulysses"],
)
def test_cp_composes_with_tensor_and_pipeline_parallelism(tiny_dataset, tmp_path, references, extra):
    base = four_layers(tiny_dataset, 6)
    reference = references.history(base)
    for history in train_in_process(tmp_path, [*base, *extra], world=4):
        assert_same_curve(reference, history)


@pytest.mark.parametrize(
    "world,extra",
    [
        (4, ("parallel.cp=4",)),
        (4, ("parallel.cp=2", "parallel.dp=2", "parallel.zero=3", "train.micro_batch_size=4")),
    ],
    ids=["cp4", "cp2-dp2-zero3"],
)
def test_cp4_and_cp_with_data_parallel_zero3(tiny_dataset, tmp_path, references, world, extra):
    reference = references.history(_steps(tiny_dataset))
    for history in train_in_process(tmp_path, _steps(tiny_dataset, *extra), world=world):
        assert_same_curve(reference, history)
    # ZeRO shards over dp x cp: the estimator's model states of the largest shard (memory.json, beside the
    # measured) are the most any rank holds.
    report = json.loads((tmp_path / "memory.json").read_text())
    (stage,) = report["estimate"]["stages"]
    for kind in ("params", "grads", "optimizer"):
        assert report["max"][kind] == stage["model_states"][kind], kind


def test_a_cp2_checkpoint_resumes_at_cp1_and_cp4_with_the_uninterrupted_losses(tiny_dataset, tmp_path, references):
    """Saved in the background (checkpoint.async): what both cp ranks hold, written while the next steps run."""
    reference = references.history(_steps(tiny_dataset))
    saved = tmp_path / "cp2"
    overrides = _steps(tiny_dataset, "parallel.cp=2", "checkpoint.every=3", "checkpoint.async=true")
    histories = train_in_process(saved, overrides, world=2)
    assert_same_curve(reference, histories[0])
    checkpoint = saved / "checkpoints" / "step_00000003"
    for cp in (1, 4):
        resumed = train_in_process(
            tmp_path / f"cp{cp}", _steps(tiny_dataset, f"parallel.cp={cp}", f"checkpoint.resume={checkpoint}"), world=cp
        )
        for rows in resumed:
            assert_same_curve(histories[0][3:], rows)


def test_cp2_in_fp16_gives_the_one_process_fp16_curve(tiny_dataset, tmp_path, references):
    """fp16 with its dynamic loss scale: the same scale each step as one process (no step skipped), the losses and
    norms within 16-bit rounding of its own (attention's sums run in another order)."""
    base = _steps(tiny_dataset, "train.precision=fp16")
    reference = references.history(base)
    for history in train_in_process(tmp_path, [*base, "parallel.cp=2"], world=2):
        assert [r["loss_scale"] for r in history] == [r["loss_scale"] for r in reference]
        assert not any(r.get("skipped") for r in history)
        assert_same_curve(reference, history, rel=2e-3)
