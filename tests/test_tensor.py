"""Tensor parallelism on real gloo groups: every parallel layer, the vocab-parallel loss and the whole GPT
against their unsharded twins, and dropout on the GPT. Each rank also computes the one-process result itself
(same seeds), so it can compare its own shard with the matching slice."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trident.config import ModelConfig
from trident.models.checkpointing import MODULES, SELECTIVE_MODULES, apply_activation_checkpointing
from trident.models.gpt import GPT, check_tp_split, init_weights, lm_loss_sum, padded_vocab_size
from trident.parallel.grad_sums import all_reduce_flat
from trident.parallel.placement import placement_of
from trident.parallel.random import model_parallel_rng
from trident.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_split_error,
    vocab_parallel_cross_entropy,
)
from trident_dev.ranks import run_distributed

# vocab 101 splits over no tp: with vocab_multiple 8 the last rank's block ends in padding rows.
CFG = ModelConfig(name="t", n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=101, vocab_multiple=8)
LAYOUTS = [(2, False), (2, True), (4, False), (4, True)]
IDS = ["tp2", "tp2-sp", "tp4", "tp4-sp"]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert torch.allclose(a, b, rtol=rtol, atol=atol), f"{what}: max diff {(a - b).abs().max().item()}"


def _seq_shard(x: torch.Tensor, rank: int, world: int, sp: bool) -> torch.Tensor:
    """What a rank holds of a [b, t, ...] activation outside the tp regions."""
    return x.chunk(world, dim=1)[rank] if sp else x


def _run_layer(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad


def _check_layers(rank: int, world: int, sp: bool) -> None:
    group = dist.group.WORLD
    b, t, d, f = 2, 8, 8, 16
    x, w_col, b_col = _randn(b, t, d, seed=1), _randn(f, d, seed=2), _randn(f, seed=3)
    h, w_row, b_row = _randn(b, t, f, seed=4), _randn(d, f, seed=5), _randn(d, seed=6)
    dy_col, dy_row = _randn(b, t, f, seed=7), _randn(b, t, d, seed=8)

    # Column: Y = X W^T + b; this rank computes its block of Y's columns.
    for gather_output in (False, True):
        col = ColumnParallelLinear(d, f, group, gather_output=gather_output, sequence_parallel=sp)
        with torch.no_grad():
            col.weight.copy_(placement_of(col.weight).shard(w_col))
            col.bias.copy_(placement_of(col.bias).shard(b_col))
        x_full = x.clone().requires_grad_()
        w_full, bias_full = w_col.clone().requires_grad_(), b_col.clone().requires_grad_()
        y_full = F.linear(x_full, w_full, bias_full)
        y_full.backward(dy_col)
        mine = slice(None) if gather_output else slice(rank * f // world, (rank + 1) * f // world)
        y, dx = _run_layer(col, _seq_shard(x, rank, world, sp), dy_col[..., mine])
        _close(y, y_full.detach()[..., mine], f"column output (gather_output={gather_output})")
        _close(dx, _seq_shard(x_full.grad, rank, world, sp), "column input gradient")
        _close(col.weight.grad, placement_of(col.weight).shard(w_full.grad), "column weight gradient")
        _close(col.bias.grad, placement_of(col.bias).shard(bias_full.grad), "column bias gradient")

    # Row: Y = X W^T + b; this rank multiplies its block of X's columns, the partial sums are reduced.
    for input_is_parallel in (True, False) if not sp else (True,):
        row = RowParallelLinear(f, d, group, input_is_parallel=input_is_parallel, sequence_parallel=sp)
        with torch.no_grad():
            row.weight.copy_(placement_of(row.weight).shard(w_row))
            row.bias.copy_(b_row)
        h_full = h.clone().requires_grad_()
        w_full, bias_full = w_row.clone().requires_grad_(), b_row.clone().requires_grad_()
        y_full = F.linear(h_full, w_full, bias_full)
        y_full.backward(dy_row)
        mine = slice(rank * f // world, (rank + 1) * f // world) if input_is_parallel else slice(None)
        y, dh = _run_layer(row, h[..., mine], _seq_shard(dy_row, rank, world, sp))
        _close(y, _seq_shard(y_full.detach(), rank, world, sp), f"row output (input_is_parallel={input_is_parallel})")
        _close(dh, h_full.grad[..., mine], "row input gradient")
        _close(row.weight.grad, placement_of(row.weight).shard(w_full.grad), "row weight gradient")
        if sp:  # each rank's bias saw only its own tokens
            all_reduce_flat([row.bias.grad], group)
        _close(row.bias.grad, bias_full.grad, "row bias gradient")

    # Vocab-parallel embedding with padding, and its tied head.
    vocab = 101
    padded = padded_vocab_size(vocab, 8, world)
    table = _randn(vocab, d, seed=9)
    ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(10))
    ids[0, :4] = torch.tensor([0, vocab - 1, padded // world - 1, padded // world])  # block edges
    emb = VocabParallelEmbedding(vocab, d, group, padded, sequence_parallel=sp)
    with torch.no_grad():
        emb.weight.copy_(placement_of(emb.weight).shard(table))
    table_full = table.clone().requires_grad_()
    (F.embedding(ids, table_full) * _randn(b, t, d, seed=11)).sum().backward()
    out = emb(ids)
    (out * _seq_shard(_randn(b, t, d, seed=11), rank, world, sp)).sum().backward()
    _close(out.detach(), _seq_shard(F.embedding(ids, table), rank, world, sp), "embedding output")
    _close(emb.weight.grad, placement_of(emb.weight).shard(table_full.grad), "embedding gradient")
    block = placement_of(emb.weight).shard(table)  # this rank's vocab rows, padding rows zero
    _close(emb.logits(_seq_shard(x, rank, world, sp)).detach(), x @ block.T, "tied logits of this vocab block")


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,sp", LAYOUTS, ids=IDS)
def test_each_layer_matches_its_unsharded_twin(tp, sp):
    run_distributed(_check_layers, tp, sp)


def _check_cross_entropy(rank: int, world: int) -> None:
    group = dist.group.WORLD
    # vocab 600 with multiple 128: at tp=4 the last rank's block is all padding.
    for vocab, multiple in ((100, 8), (600, 128)):
        padded = padded_vocab_size(vocab, multiple, world)
        full = 3 * _randn(2, 8, vocab, seed=vocab)
        targets = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(1))
        targets[0, :2] = torch.tensor([0, vocab - 1])
        full_leaf = full.clone().requires_grad_()
        expected = F.cross_entropy(full_leaf.flatten(0, 1), targets.flatten(), reduction="sum")
        expected.backward()
        # Padding columns hold large logits: if any leaked into the softmax, the loss would be off by nats.
        with_padding = torch.cat([full, torch.full((2, 8, padded - vocab), 30.0)], dim=-1)
        shard = with_padding.chunk(world, dim=-1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, targets, group, vocab)
        assert loss.dtype == torch.float32
        _close(loss.detach(), expected.detach(), f"loss, vocab {vocab}")
        loss.backward()
        grad = torch.cat([full_leaf.grad, torch.zeros(2, 8, padded - vocab)], dim=-1).chunk(world, dim=-1)[rank]
        _close(shard.grad, grad, f"logit gradient, vocab {vocab}")
        block = padded // world
        assert torch.count_nonzero(shard.grad[..., max(0, vocab - rank * block) :]) == 0, "padding got a gradient"


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_is_the_full_one_and_ignores_padding(tp):
    run_distributed(_check_cross_entropy, tp)


def _batch(step: int, cfg: ModelConfig = CFG) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _summed_over_tp(model: GPT) -> list[torch.nn.Parameter]:
    """The parameters whose placement asks for their gradient to be summed over tp (sequence parallelism)."""
    return [p for p in model.parameters() if "tp" in placement_of(p).grad_sums]


def _replicated(model: GPT) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if placement_of(p).split_dim is None]


def _check_gpt(rank: int, world: int, sp: bool) -> dict[str, list[torch.Tensor]]:
    """Three AdamW steps at tp=world against the same steps of the one-process model."""
    group = dist.group.WORLD
    one, tp = GPT(CFG), GPT(CFG, group, sequence_parallel=sp)
    init_weights(one, CFG, seed=0)
    init_weights(tp, CFG, seed=0)
    names = dict(one.named_parameters())
    for name, p in tp.named_parameters():
        assert torch.equal(p.detach(), placement_of(p).shard(placement_of(names[name]).real_part(names[name]))), name
    assert _summed_over_tp(tp) == (_replicated(tp) if sp else [])
    opt_one, opt_tp = torch.optim.AdamW(one.parameters(), lr=1e-2), torch.optim.AdamW(tp.parameters(), lr=1e-2)
    grads = []
    for step in range(3):
        x, y = _batch(step)
        loss_one, loss_tp = lm_loss_sum(one(x), y), tp.loss_sum(tp(x), y)
        _close(loss_tp.detach(), loss_one.detach(), f"loss at step {step}")
        loss_one.backward()
        loss_tp.backward()
        all_reduce_flat([p.grad for p in _summed_over_tp(tp)], group)
        for name, p in tp.named_parameters():
            full = names[name]
            expected = placement_of(p).shard(placement_of(full).real_part(full.grad))
            # Up to reduction order, which three AdamW steps amplify a little.
            _close(p.grad, expected, f"{name}.grad at step {step}", rtol=1e-4, atol=1e-5)
        grads.append([p.grad.clone() for p in _replicated(tp)])
        opt_one.step()
        opt_tp.step()
        opt_one.zero_grad()
        opt_tp.zero_grad()
    return {"grads": [g for step in grads for g in step], "params": [p.detach() for p in _replicated(tp)]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,sp", LAYOUTS, ids=IDS)
def test_gpt_matches_the_one_process_model_and_keeps_replicas_identical(tp, sp):
    """Loss and every gradient equal the one-process model's (each rank's its placement's slice), over three
    optimizer steps; the parameters every tp rank holds whole get bit-identical gradients and stay
    bit-identical (under SP once their partial gradients are summed over tp)."""
    ranks = run_distributed(_check_gpt, tp, sp)
    for other in ranks[1:]:
        for key in ("grads", "params"):
            assert all(torch.equal(a, b) for a, b in zip(ranks[0][key], other[key], strict=True)), key


# Every policy, selective's modules all recomputed, and every second block.
RECOMPUTATIONS = [
    ("none", SELECTIVE_MODULES, 1),
    ("full", SELECTIVE_MODULES, 1),
    ("selective", SELECTIVE_MODULES, 1),
    ("selective", MODULES, 1),
    ("attention", SELECTIVE_MODULES, 1),
    ("selective", SELECTIVE_MODULES, 2),
]


def _check_dropout(rank: int, world: int, sp: bool) -> list[torch.Tensor]:
    cfg = dataclasses.replace(CFG, dropout=0.1)
    x, y = _batch(0)
    results = {}
    for policy, modules, every in RECOMPUTATIONS:
        model = GPT(cfg, dist.group.WORLD, sequence_parallel=sp, rng=model_parallel_rng(5))
        init_weights(model, cfg, seed=0)
        apply_activation_checkpointing(model, policy, modules=modules, every=every)
        with model.rng.context(step=0, sample_ids=range(len(x))):
            loss = model.loss_sum(model(x), y)
        loss.backward()  # recomputes outside the micro-batch's context: checkpoint_contexts puts it back
        all_reduce_flat([p.grad for p in _summed_over_tp(model)], dist.group.WORLD)
        results[policy, modules, every] = (loss.detach(), [p.grad for p in model.parameters()])
    results["none"] = results["none", SELECTIVE_MODULES, 1]
    for policy in RECOMPUTATIONS[1:]:
        assert torch.equal(results[policy][0], results["none"][0]), policy
        for a, b in zip(results[policy][1], results["none"][1], strict=True):
            assert torch.allclose(a, b, atol=1e-7), policy
    one = GPT(cfg, rng=model_parallel_rng(5))  # the one-process model drops exactly the same elements
    init_weights(one, cfg, seed=0)
    with one.rng.context(step=0, sample_ids=range(len(x))):
        _close(one.loss_sum(one(x), y), results["none"][0], "loss with dropout")
    no_dropout = GPT(CFG, dist.group.WORLD, sequence_parallel=sp)
    init_weights(no_dropout, CFG, seed=0)
    assert not torch.allclose(no_dropout.loss_sum(no_dropout(x), y), results["none"][0]), "dropout did nothing"
    return [g for g, p in zip(results["none"][1], model.parameters(), strict=True) if placement_of(p).split_dim is None]


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_dropout_is_redrawn_exactly_under_recomputation_and_keeps_replicas_identical(sp):
    ranks = run_distributed(_check_dropout, 2, sp)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0], ranks[1], strict=True))


def test_split_errors_name_the_nearest_valid_values():
    assert tp_split_error("model.n_heads", 8, 4) is None
    assert tp_split_error("model.n_heads", 6, 4) == (
        "model.n_heads=6 is not divisible by parallel.tp=4; use model.n_heads=4 or 8, or parallel.tp=3 or 6"
    )
    assert tp_split_error("model.n_heads", 2, 4) == (
        "model.n_heads=2 is not divisible by parallel.tp=4; use model.n_heads=4, or parallel.tp=2"
    )
    with pytest.raises(ValueError, match="model.d_ff=100 is not divisible by parallel.tp=8"):
        check_tp_split(dataclasses.replace(CFG, n_heads=8, d_ff=100), 8)
    with pytest.raises(ValueError, match="model.seq_len=16 is not divisible by parallel.tp=3"):
        check_tp_split(dataclasses.replace(CFG, n_heads=3, d_model=30, d_ff=30), 3, sequence_parallel=True)
