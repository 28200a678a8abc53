"""The planner's op list (trident/plan/ops.py) against the matmuls torch counts when the real model runs: for each
model family, tp layout and recomputation policy, the matmul FLOPs of one micro-batch's forward and backward
through a whole one-chunk model, recomputation included, equal torch.utils.flop_counter's count of the same step run
on fake tensors (tp over torch's fake process group, as the memory trace runs it: trident/memory/trace.py).

The planner prices each matmul by its shape, so a matmul its list lacks, or has twice, would be a step time off by
that matmul's time; this holds the list to the model's code. Attention's own products are not compared: on a CPU
SDPA runs its fused kernel, which the counter does not know.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.layouts import make_config
from tests.test_memory import MOE
from trident.config import ModelConfig
from trident.layout import Layout
from trident.memory.activations import BALANCED, recompute_flops, routed_rows
from trident.memory.trace import _fake_groups, _ShapesOnly, traced_routing
from trident.models.checkpointing import apply_activation_checkpointing, parse_label
from trident.models.gpt import GPT
from trident.models.moe import MoE, set_loss_multiplier
from trident.parallel.random import RNGTracker
from trident.parallel.wgrad import WeightGradStore, defer_weight_grads, weight_pass
from trident.plan.cost import flops_matmul
from trident.plan.ops import Shape, chunk_ops

GPT_TINY = make_config("model=gpt-tiny").model
LLAMA_TINY = make_config("model=llama-tiny").model
MODELS = {
    "gpt-tiny": GPT_TINY,
    "llama-tiny": LLAMA_TINY,
    "llama-head-dim-qk-norm": dataclasses.replace(LLAMA_TINY, head_dim=24, qk_norm=True),
    "gpt-untied-no-bias": dataclasses.replace(GPT_TINY, tie_embeddings=False, bias=False),
    "llama-odd-vocab": dataclasses.replace(LLAMA_TINY, vocab_size=515),  # padded to 576: the head's rows at tp 1
    # A dense layer, then a sparse one with a shared expert; the experts as one matmul each (the counter does not
    # know the grouped product).
    "moe-shared": dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, grouped_mm=False)),
}
MATMULS = ("aten.mm", "aten.addmm", "aten.bmm")


def _planned(m: ModelConfig, batch: int, tp: int, sp: bool, policy: str, deferred: bool = False) -> float:
    sparse = sum(m.moe.is_sparse(i) for i in range(m.n_layers))
    shape = Shape(batch, m.seq_len, tp, sp, "fp32")
    ops = chunk_ops(m, shape, m.n_layers, True, True, policy, sparse=(sparse, sparse), deferred=deferred)
    return sum(flops_matmul(*o.shape[:3]) * o.count for o in ops if o.kind == "matmul")


def _counted(m: ModelConfig, batch: int, tp: int, sp: bool, policy: str, deferred: bool = False) -> float:
    """Matmul FLOPs torch counts in one micro-batch's forward and backward; a sparse layer routed as the planner
    prices it, balanced (trident/memory/activations.py ``routed_rows``). ``deferred``: the backward as a zero-bubble
    I then W of its linear layers' deferred weight GEMMs (parallel/wgrad.py)."""
    layout = Layout(tp=tp, sequence_parallel=sp, micro_batch_size=batch, device="cpu")
    rows = routed_rows(m, layout, BALANCED) if m.moe.enabled else None
    with _fake_groups(tp, 1, 1) as (tp_group, _, _), FakeTensorMode():
        model = GPT(m, tp_group, sp, RNGTracker(0))
        for module in model.modules():
            if isinstance(module, MoE):
                module.traced = traced_routing(m, layout, rows.sent, rows.received)
        set_loss_multiplier(model, 1.0)
        name, modules, every = parse_label(policy)
        apply_activation_checkpointing(model, name, modules=modules, every=every)
        store = WeightGradStore()
        if deferred:
            defer_weight_grads(model, store)
        tokens = torch.zeros(batch, m.seq_len, dtype=torch.long)
        counter = FlopCounterMode(display=False)
        with _ShapesOnly(), counter:
            loss = model.loss_sum(model(tokens), tokens)
            store.deferring = deferred
            loss.backward()
            store.deferring = False
            weight_pass(store.take())
    counts = counter.get_flop_counts()["Global"]
    return sum(v for op, v in counts.items() if str(op).startswith(MATMULS))


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-sp"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_planned_matmuls_are_the_ones_the_model_runs(name: str, tp: int, sp: bool, policy: str) -> None:
    m = MODELS[name]
    assert _planned(m, 2, tp, sp, policy) == _counted(m, 2, tp, sp, policy)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_estimators_recomputed_flops_are_the_matmuls_the_backward_reruns(name: str, tp: int) -> None:
    """The estimator's FLOPs recomputed under ``full`` (trident/memory/activations.py ``recompute_flops``, which
    tools/estimate_memory.py prints) less its attention term (4 b s s h / tp a layer, ``flops_per_token``'s
    convention): the matmuls torch counts in the recomputing backward beyond a plain one."""
    m = MODELS[name]
    layout = Layout(tp=tp, micro_batch_size=2, device="cpu")
    attention = m.n_layers * 4.0 * 2 * m.seq_len * m.seq_len * m.d_model / tp
    rerun = _counted(m, 2, tp, False, "full") - _counted(m, 2, tp, False, "none")
    assert recompute_flops(m, layout, 0, "full") - attention == rerun


@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-shared"])
def test_the_deferred_weight_passes_run_the_planned_matmuls(name: str, policy: str) -> None:
    """Past stage 0 of zb-h1 and zb-v the linear layers defer their weight GEMMs to W (parallel/wgrad.py): I + W
    run the planner's matmuls for such a chunk, under full recomputation each dense layer's output projection once
    more (its saved tensors are packed after its GEMM), which the estimator's recomputed FLOPs count too."""
    m = MODELS[name]
    assert _planned(m, 2, 1, False, policy, deferred=True) == _counted(m, 2, 1, False, policy, deferred=True)
    if policy == "full" and not m.moe.enabled:
        layout = Layout(pp=2, schedule="zb-h1", micro_batch_size=2, device="cpu")
        attention = m.n_layers * 4.0 * 2 * m.seq_len * m.seq_len * m.d_model
        rerun = _counted(m, 2, 1, False, "full", deferred=True) - _counted(m, 2, 1, False, "none")
        assert 2 * recompute_flops(m, layout, 1, "full") - attention == rerun  # stage 1: half the layers
