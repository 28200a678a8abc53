"""parallel/placement.py and the placements the GPT declares: pure, no process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from trident.config import ModelConfig
from trident.models.gpt import GPT, init_tensor, init_weights, initial_value
from trident.parallel.placement import Placement, placement_of, set_placement

CFG = ModelConfig(name="t", n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=100, vocab_multiple=64)


def test_the_docstring_example():
    """wte [600, 64] padded to 640 over tp 2: rank 1 holds rows [320, 640) of which [320, 600) are real."""
    ranks = [Placement((600, 64), split_dim=0, tp_rank=r, tp_size=2, padded=640) for r in range(2)]
    assert [p.local_shape for p in ranks] == [(320, 64), (320, 64)]
    assert [p.offsets for p in ranks] == [(0, 0), (320, 0)]
    assert [p.chunk_sizes for p in ranks] == [(320, 64), (280, 64)]
    full = torch.randn(600, 64)
    shards = [p.shard(full) for p in ranks]
    assert torch.equal(torch.cat(shards)[:600], full)
    assert torch.count_nonzero(shards[1][280:]) == 0
    assert torch.equal(ranks[1].real_part(shards[1]), full[320:])


def test_a_rank_may_hold_only_padding():
    """vocab 600 padded to 1024 over tp 8: ranks 5..7 hold no real row, and save nothing."""
    ranks = [Placement((600, 8), split_dim=0, tp_rank=r, tp_size=8, padded=1024) for r in range(8)]
    assert [p.real for p in ranks] == [128, 128, 128, 128, 88, 0, 0, 0]
    assert sum(p.chunk_sizes[0] for p in ranks) == 600


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(shape=(10, 4), split_dim=2),
        dict(shape=(10, 4), split_dim=0, tp_size=3),  # 10 rows do not split over 3
        dict(shape=(10, 4), split_dim=0, padded=8),  # padding smaller than the tensor
        dict(shape=(10, 4), split_dim=0, tp_rank=2, tp_size=2),
        dict(shape=(10, 4), padded=12),  # padding without a split dim
    ],
)
def test_inconsistent_placements_are_refused(kwargs):
    with pytest.raises(ValueError):
        Placement(**kwargs)


def test_every_gpt_parameter_has_a_placement_matching_its_tensor():
    model = GPT(CFG)
    for name, p in model.named_parameters():
        placement = placement_of(p)
        assert placement.local_shape == tuple(p.shape), name
    assert placement_of(model.wte.weight).shape == (CFG.vocab_size, CFG.d_model)
    assert placement_of(model.layers["0"].attn.qkv.weight).split_dim == 0
    assert placement_of(model.layers["0"].attn.proj.weight).split_dim == 1
    assert placement_of(model.layers["0"].attn.proj.bias).replicated_over_tp
    with pytest.raises(ValueError):
        set_placement(model.wpe.weight, Placement((3, 3)))


@pytest.mark.parametrize("tp", [2, 4])
def test_init_gives_each_tp_rank_exactly_its_slice_of_the_one_process_tensor(tp):
    """For every parameter, the tp ranks' initial tensors, put back together, are the one-process tensor."""
    cfg = dataclasses.replace(CFG, vocab_multiple=64 * tp)
    model = GPT(CFG)
    init_weights(model, CFG, seed=5)
    for name, p in model.named_parameters():
        one = placement_of(p)
        if one.split_dim is None:
            ranks = [initial_value(name, dataclasses.replace(one, tp_rank=r, tp_size=tp), cfg, 5) for r in range(tp)]
            assert all(torch.equal(r, p.detach()) for r in ranks), name
            continue
        padded = one.padded and -(-one.padded // (64 * tp)) * 64 * tp
        parts = []
        for r in range(tp):
            placement = dataclasses.replace(one, tp_rank=r, tp_size=tp, padded=padded)
            parts.append(placement.real_part(initial_value(name, placement, cfg, 5)))
        whole = torch.cat(parts, dim=one.split_dim)
        assert torch.equal(whole, one.real_part(p.detach())), name
        assert torch.equal(whole, init_tensor(name, one.shape, CFG, 5)), name


def test_a_contiguous_block_of_qkv_rows_holds_whole_heads():
    """Rows [r*k, (r+1)*k) of the fused qkv weight, run on their own, give exactly heads [r*h/tp, (r+1)*h/tp)
    of the one-process attention: what a column-parallel split of qkv relies on."""
    model = GPT(CFG)
    init_weights(model, CFG, seed=0)
    attn = model.layers["0"].attn
    x = torch.randn(2, CFG.seq_len, CFG.d_model)
    with torch.no_grad():
        full = attn.core(*attn.project(x))  # [b, t, h*d]
        tp, d = 2, CFG.head_size
        rows = 3 * CFG.d_model // tp
        for r in range(tp):
            w, b = attn.qkv.weight[r * rows : (r + 1) * rows], attn.qkv.bias[r * rows : (r + 1) * rows]
            qkv = F.linear(x, w, b)
            q, k, v = rearrange(qkv, "b t (h three d) -> three b h t d", three=3, h=CFG.n_heads // tp)
            local = rearrange(F.scaled_dot_product_attention(q, k, v, is_causal=True), "b h t d -> b t (h d)")
            heads = CFG.n_heads // tp
            assert torch.allclose(local, full[..., r * heads * d : (r + 1) * heads * d], atol=1e-6)
