"""trident/memory/trace.py: a model chunk traced on fake tensors keeps, per micro-batch, what today's formula
(trident/memory/activations.py) counts on the configurations the formula was checked on, for every recomputation
policy and tp layout; and it counts what the formula does not know (qk_norm, a head width of its own)
as a real forward keeps it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tests.test_memory import LLAMA, MOE, SHAPES, _held
from trident.config import ModelConfig
from trident.layout import Layout
from trident.memory.activations import POLICIES, activation_bytes, recompute_bytes, routed_rows
from trident.memory.estimate import estimate
from trident.memory.trace import _trace, _trace_layers, chunk_bytes, traceable
from trident_dev.ranks import run_distributed


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("cfg,tp", [(SHAPES[1], 2), (LLAMA, 4)], ids=["gpt-odd-tp2", "llama-tp4"])
def test_tp_chunks_traced_over_a_fake_group_are_the_formula(cfg: ModelConfig, tp: int, sp: bool) -> None:
    """tp > 1 traced over torch's fake process group, with and without sequence parallelism (the vocab-parallel
    loss, replicated kv heads at tp=4): the formula's bytes, which tests/test_memory.py measured on real gloo
    ranks."""
    layout = Layout(tp=tp, sequence_parallel=sp, micro_batch_size=2, device="cpu")
    assert traceable(cfg, layout)
    for policy in POLICIES:
        assert activation_bytes(cfg, layout, 0, policy) == activation_bytes(cfg, layout, 0, policy, traced=False)


def test_a_layer_is_traced_once_per_kind_and_reused() -> None:
    """A 12-layer chunk is traced with one layer, then two: the same bytes as the formula's twelve; a layout of the
    same activations' shape (another dp, ZeRO stage) traces nothing again."""
    cfg = dataclasses.replace(LLAMA, name="llama-12", n_layers=12)
    layout = Layout(micro_batch_size=2, device="cpu")
    before = _trace.cache_info().misses
    assert chunk_bytes(cfg, layout, 0, "none") == activation_bytes(cfg, layout, 0, "none", traced=False)
    assert _trace.cache_info().misses - before == 2
    estimate(cfg, layout)
    traced = _trace.cache_info().misses
    estimate(cfg, dataclasses.replace(layout, dp=4, zero=3))
    assert _trace.cache_info().misses == traced


QK_NORM = [
    dataclasses.replace(LLAMA, name="qwen3-like", head_dim=32, qk_norm=True),
    dataclasses.replace(LLAMA, name="olmoe-like", head_dim=24, qk_norm=True, qk_norm_scope="projection"),
]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("cfg", QK_NORM, ids=[c.name for c in QK_NORM])
def test_qk_norm_and_a_head_width_of_its_own_are_counted_as_a_forward_keeps_them(
    cfg: ModelConfig, precision: str
) -> None:
    """model.head_dim (heads wider than d_model / n_heads) and model.qk_norm (per head, or over the projection):
    the estimate of one micro-batch equals what a real forward keeps, under every recomputation, with no
    estimator code for either."""
    (stage,) = estimate(cfg, Layout(micro_batch_size=2, precision=precision, device="cpu")).stages
    assert stage.activations == {p: _held(cfg, p, batch=2, precision=precision) for p in POLICIES}


def test_the_trace_keeps_out_of_what_it_cannot_run() -> None:
    """A GPU layout and context parallelism keep the formula for now (trident/memory/trace.py says why); a pipeline's
    chunks (tests/test_memory_pipeline.py) and a mixture-of-experts model (tests/test_moe_memory.py) are traced, and
    so is tp or ep in a process with groups of its own."""
    assert traceable(LLAMA, Layout(device="cpu"))
    assert traceable(LLAMA, Layout(pp=2, vpp=2, device="cpu"))
    assert traceable(MOE, Layout(dp=2, ep=2, tp=2, device="cpu"))
    assert not traceable(LLAMA, Layout(device="cuda"))
    assert not traceable(LLAMA, Layout(cp=2, device="cpu"))


@pytest.mark.parametrize(
    "cfg,layout",
    [
        (LLAMA, Layout(micro_batch_size=2, precision="bf16", device="cpu")),
        (MOE, Layout(tp=2, sequence_parallel=True, micro_batch_size=2, device="cpu")),
    ],
    ids=["llama-bf16", "moe-shared-tp2-sp"],
)
def test_the_recomputed_layer_is_traced_as_the_formula_counts_it(cfg: ModelConfig, layout: Layout) -> None:
    """The transient of backward's recomputation (a layer's bytes without recomputation less what it keeps under
    the policy, the larger of a dense and a sparse layer's) traced: the formula's, for each policy and routing."""
    policies = [*POLICIES[1:], "selective[mlp]"]
    for routing in ("worst", "balanced"):
        traced = {p: recompute_bytes(cfg, layout, p, routing) for p in policies}
        assert traced == {p: recompute_bytes(cfg, layout, p, routing, traced=False) for p in policies}
        assert all(v > 0 for v in traced.values())


def _traced_beside_real_groups(rank: int, world: int, cfg: ModelConfig, layout: Layout, expected: int) -> None:
    sub = dist.new_group([0, 1])
    before = (dist.get_rank(), dist.get_world_size(), dist.get_rank(sub), sub.group_name)
    traces = _trace.cache_info().misses
    assert activation_bytes(cfg, layout, 0, "selective") == expected
    assert _trace.cache_info().misses > traces  # traced here, beside the real groups
    assert (dist.get_rank(), dist.get_world_size(), dist.get_rank(sub), sub.group_name) == before
    later = dist.new_group([0, 1])  # made after the trace: its name is the real world's next
    for group in (None, sub, later):
        t = torch.full((1,), float(rank + 1))
        dist.all_reduce(t, group=group)
        assert t.item() == 3
    # torch's C++ registry of groups by name (functional collectives resolve a group through it) kept the real ones.
    assert funcol.all_reduce(torch.ones(1), "sum", sub).item() == 2


@pytest.mark.multiprocess
def test_a_process_with_groups_of_its_own_traces_tp_and_ep_and_keeps_its_groups() -> None:
    """A training run's launch estimate (train.py, on a rank whose groups exist) traces a tp 2 x ep 2 sparse layout
    over fake groups of a world of the trace's own, the same bytes as a process with no group traces, and its own
    groups, made before the trace or after, work on as before."""
    layout = Layout(dp=2, tp=2, ep=2, micro_batch_size=2, device="cpu")
    expected = activation_bytes(MOE, layout, 0, "selective")
    run_distributed(_traced_beside_real_groups, 2, MOE, layout, expected)


AFFINE = [
    (LLAMA, Layout(tp=2, sequence_parallel=True, precision="bf16", document_mask=True, device="cpu")),
    (dataclasses.replace(SHAPES[1], dropout=0.1), Layout(device="cpu")),
    (LLAMA, Layout(cp=2, cp_comm="ring", document_mask=True, device="cpu")),
    (LLAMA, Layout(cp=2, cp_comm="ulysses", precision="bf16", device="cpu")),
    (dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, capacity_factor=1.0)), Layout(dp=2, ep=2, device="cpu")),
]


@pytest.mark.parametrize("b", [4, 7])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
@pytest.mark.parametrize("case", range(len(AFFINE)), ids=["tp2-sp-docs", "gpt-dropout", "cp2-ring-docs",
                                                           "cp2-ulysses", "moe-ep2-capacity"])  # fmt: skip
def test_a_chunk_traced_at_b_sequences_is_the_two_and_three_sequence_traces_extrapolated(
    case: int, policy: str, b: int
) -> None:
    """What the planner's micro-batch sizes trace: two and three sequences, extrapolated (trace._trace_layers),
    equal to the chunk traced at b, for tp with sequence parallelism and packed documents, dropout, cp's exchanges and a
    sparse layer under the worst routing with a capacity."""
    cfg, layout = AFFINE[case]
    layout = dataclasses.replace(layout, micro_batch_size=b)
    rows = routed_rows(cfg, layout) if cfg.moe.enabled else None
    key = None if rows is None else (rows.sent, rows.received)
    layers = range(cfg.n_layers)
    extrapolated = _trace_layers(cfg, layout, layers, policy, key, True, True)
    assert extrapolated == _trace_layers(cfg, layout, layers, policy, key, True, True, direct=True)
