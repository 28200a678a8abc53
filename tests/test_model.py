"""The GPT against its own definition: shapes, name-seeded init, vocab padding, FLOPs, recomputation."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from trident.config import ModelConfig
from trident.memory.measure import held_by_forward
from trident.models.checkpointing import MODULES, SELECTIVE_MODULES, _Replayable, apply_activation_checkpointing
from trident.models.gpt import GPT, count_params, flops_per_token, init_weights, lm_loss_sum, padded_vocab_size
from trident.parallel.placement import placement_of
from trident.parallel.tensor import ColumnParallelLinear, RowParallelLinear

TINY = ModelConfig(name="t", n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=100, vocab_multiple=64)


def build(cfg: ModelConfig = TINY, seed: int = 0) -> GPT:
    model = GPT(cfg)
    init_weights(model, cfg, seed)
    return model


def batch(cfg: ModelConfig = TINY, b: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_logits_shape_and_initial_loss_near_uniform():
    x, y = batch()
    logits = build()(x)
    assert logits.shape == (3, TINY.seq_len, TINY.vocab_size)
    mean_loss = lm_loss_sum(logits, y).item() / y.numel()
    assert abs(mean_loss - math.log(TINY.vocab_size)) < 0.1


def test_a_tp_group_of_one_is_the_plain_model():
    """What train.py builds at tp=1 (a real group of one, even with sequence_parallel asked for) is the plain
    model bit for bit: the parallel layers take their torch path, with no collective."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plain, grouped = build(), GPT(TINY, dist.group.WORLD, sequence_parallel=True)
        init_weights(grouped, TINY, seed=0)
        assert not grouped.sequence_parallel and not any(placement_of(p).grad_sums for p in grouped.parameters())
        x, y = batch()
        loss_plain, loss_grouped = lm_loss_sum(plain(x), y), grouped.loss_sum(grouped(x), y)
        assert torch.equal(loss_plain, loss_grouped)
        loss_plain.backward()
        loss_grouped.backward()
        for (name, a), b in zip(plain.named_parameters(), grouped.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), name
    finally:
        dist.destroy_process_group()


def test_padded_vocab_size():
    assert padded_vocab_size(100, 64) == 128
    assert padded_vocab_size(128, 64) == 128
    assert padded_vocab_size(50257, 128, tp=2) == 50432
    assert build().wte.weight.shape[0] == 128


def test_same_seed_same_weights_other_seed_different():
    a, b, c = build(seed=3), build(seed=3), build(seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name


def test_pipeline_stages_have_the_full_models_names_weights_and_outputs():
    """Stages of layers 0..1 (+ embedding) and 2..3 (+ head): the full model's parameters under the same names,
    the last stage's tied LM head a copy of wte from the start, and chained they compute the full model."""
    cfg = dataclasses.replace(TINY, n_layers=4)
    full = build(cfg)
    first = GPT(cfg, layers=range(0, 2), first=True, last=False)
    last = GPT(cfg, layers=range(2, 4), first=False, last=True)
    full_params = dict(full.named_parameters())
    for stage in (first, last):
        init_weights(stage, cfg, seed=0)
        for name, p in stage.named_parameters():
            if name == "lm_head.weight":
                assert placement_of(p).tied_to == "wte.weight"
                assert torch.equal(p, full_params["wte.weight"])
            else:
                assert torch.equal(p, full_params[name]), name
    names = {n for s in (first, last) for n, _ in s.named_parameters()} - {"lm_head.weight"}
    assert names == set(full_params)
    # Each copy of the tied embedding asks for the sum over the embedding group; nothing else asks for a sum.
    for stage, copy in ((first, first.wte.weight), (last, last.lm_head.weight)):
        marked = [p for p in stage.parameters() if placement_of(p).grad_sums]
        assert len(marked) == 1 and marked[0] is copy and placement_of(copy).grad_sums == ("embedding",)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    torch.testing.assert_close(last(first(idx)), full(idx), rtol=0, atol=0)


def test_residual_projections_get_scaled_init():
    cfg = dataclasses.replace(TINY, d_model=256, n_layers=8)
    model = build(cfg)
    std_proj = model.layers["0"].attn.proj.weight.std().item()
    std_qkv = model.layers["0"].attn.qkv.weight.std().item()
    assert std_qkv == pytest.approx(0.02, rel=0.05)
    assert std_proj == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


@pytest.mark.parametrize("multiple,tp", [(1, 1), (64, 1), (64, 2), (128, 4)])
def test_vocab_padding_never_changes_loss_or_real_gradients(multiple, tp):
    ref_cfg = dataclasses.replace(TINY, vocab_multiple=1)
    ref = build(ref_cfg)
    padded = build(dataclasses.replace(TINY, vocab_multiple=multiple * tp))
    x, y = batch()
    loss_ref = lm_loss_sum(ref(x), y)
    loss_pad = lm_loss_sum(padded(x), y)
    assert torch.equal(loss_ref, loss_pad)
    loss_ref.backward()
    loss_pad.backward()
    v = TINY.vocab_size
    assert torch.allclose(ref.wte.weight.grad, padded.wte.weight.grad[:v])
    assert torch.count_nonzero(padded.wte.weight.grad[v:]) == 0
    assert torch.count_nonzero(padded.wte.weight[v:]) == 0


def test_count_params_matches_module():
    model = build()
    pad_rows = model.padded_vocab - TINY.vocab_size
    n = sum(p.numel() for p in model.parameters()) - pad_rows * TINY.d_model
    assert count_params(TINY) == n


def test_flops_per_token_is_6n_plus_attention():
    model = build()
    linears = (ColumnParallelLinear, RowParallelLinear)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, linears))
    matmul += TINY.vocab_size * TINY.d_model  # the tied LM head
    attention = 12 * TINY.n_layers * TINY.d_model * TINY.seq_len
    assert flops_per_token(TINY) == 6 * matmul + attention


def test_gpt2_small_shape_has_124m_parameters():
    cfg = ModelConfig(n_layers=12, d_model=768, n_heads=12, seq_len=1024, vocab_size=50257)
    assert count_params(cfg) == 124_439_808  # GPT-2 small, as published


@pytest.mark.parametrize(
    "policy,modules,every",
    [
        ("full", SELECTIVE_MODULES, 1),
        ("selective", SELECTIVE_MODULES, 1),
        ("selective", MODULES, 1),
        ("selective", ("attn_core",), 2),
        ("attention", SELECTIVE_MODULES, 1),
        ("full", SELECTIVE_MODULES, 2),
    ],
    ids=["full", "selective", "selective-all-modules", "selective-attn_core-every2", "attention", "full-every2"],
)
def test_activation_checkpointing_keeps_math_and_names(policy, modules, every):
    x, y = batch()
    ref, ckpt = build(), build()
    apply_activation_checkpointing(ckpt, policy, modules=modules, every=every)
    assert list(ref.state_dict()) == list(ckpt.state_dict())
    loss_ref, loss_ckpt = lm_loss_sum(ref(x), y), lm_loss_sum(ckpt(x), y)
    assert torch.equal(loss_ref, loss_ckpt)
    loss_ref.backward()
    loss_ckpt.backward()
    for (name, a), b in zip(ref.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-7), name


@pytest.mark.parametrize("kind", [dict, list], ids=["by-index-torch-2.13", "popped-list-torch-2.11"])
def test_a_selective_replay_puts_back_the_kept_outputs_whichever_way_torch_stores_them(kind):
    """A zero-bubble split backward replays a block twice: each replay starts from the outputs the forward kept,
    however this torch's selective-checkpoint cache holds them (torch 2.11, on the GPU machines, pops a list)."""

    class Mode(contextlib.nullcontext):
        storage = {"mm": kind({0: "out0", 1: "out1"}) if kind is dict else ["out0", "out1"]}

    mode = Mode()
    replay = _Replayable(mode)
    with replay:
        consumed = mode.storage["mm"]
        consumed.clear() if kind is list else consumed.update({0: None, 1: None})  # as the backward uses them
    with replay:
        again = mode.storage["mm"]
    assert (list(again.values()) if kind is dict else again) == ["out0", "out1"]


def test_recomputation_keeps_less_than_none():
    """Each policy must actually drop kept activations, not only keep the math: op-level selective keeps less
    than the attention core's recomputation, every second block between none and all (storages alive after the
    forward, as tests/test_memory.py measures them to the byte)."""
    cfg = dataclasses.replace(TINY, seq_len=64)
    x, _ = batch(cfg, b=4)

    def held(policy: str, every: int = 1) -> int:
        model = build(cfg)
        apply_activation_checkpointing(model, policy, every=every)
        return held_by_forward(lambda: model(x).sum(), [*model.parameters(), x])[1]

    assert held("full") < held("selective") < held("attention") < held("none")
    assert held("full") < held("full", every=2) < held("none")


def test_sequence_longer_than_context_is_rejected():
    x = torch.zeros(1, TINY.seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="seq_len"):
        build()(x)
