"""The LM head fused with the cross-entropy, chunk by chunk (parallel/tensor.py ``_LinearCrossEntropy``): the loss
and the gradients of the head's input and weight are those of the whole logits' loss (tied and untied heads, a
padded vocab, fp32 to 1e-6 and bf16 to its rounding, tp = 1 and tp = 2 with and without sequence parallelism),
and what the loss keeps for backward is its gradients, never a [tokens, vocab] tensor."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trident.config import ModelConfig
from trident.memory.measure import held_by_forward
from trident.models.gpt import GPT, init_weights, lm_loss_sum
from trident_dev.ranks import run_distributed

# vocab 300 padded to 320 (and at tp = 2 to 384: rank 1's block of 192 holds 108 real rows); 2 x 24 tokens in
# chunks of 7, the last one short.
CFG = ModelConfig(n_layers=1, d_model=32, n_heads=2, seq_len=24, vocab_size=300, vocab_multiple=64, loss_chunk_tokens=7)
TOL = {torch.float32: 1e-6, torch.bfloat16: 2**-7}  # bf16: a few roundings of a unit in the last place


def _grads(model: GPT, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(chunked: dict, whole: dict, dtype: torch.dtype, what: str) -> None:
    assert chunked.keys() == whole.keys(), what
    for name, g in whole.items():
        err = (chunked[name] - g).abs().max().item() / max(g.abs().max().item(), 1e-12)
        assert err <= TOL[dtype], f"{what}: {name} off by {err:.2e} of its largest"


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, CFG.vocab_size, (2, 2, CFG.seq_len), generator=g)
    y[0, :2] = torch.tensor([0, CFG.vocab_size - 1])  # the first and the last real row
    return x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_chunked_loss_and_its_gradients_are_the_whole_logits(tied: bool, dtype: torch.dtype) -> None:
    """Every parameter's gradient (the head's weight, and through the head's input every layer's) and the loss
    equal the unchunked loss of the same weights: ``lm_loss_sum`` of the logits."""
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    model = GPT(cfg)
    init_weights(model, cfg, 0)
    model.to(dtype)
    x, y = _batch()
    chunked = model(x, targets=y)
    reference = lm_loss_sum(model(x), y)
    assert chunked.dtype == torch.float32
    assert abs(chunked.item() - reference.item()) <= TOL[dtype] * reference.item()
    _check(_grads(model, chunked), _grads(model, reference), dtype, f"tied={tied}")
    # The weight's padding rows get no gradient.
    head = model.wte if tied else model.lm_head
    chunked = model(x, targets=y)
    chunked.backward()
    assert head.weight.shape[0] == 320 and torch.count_nonzero(head.weight.grad[300:]) == 0


def test_chunk_sizes_agree_and_zero_is_the_whole_logits() -> None:
    """One chunk, chunks that divide the tokens or not, and 0 (the logits, then ``loss_sum``): one loss, one
    gradient; evaluation (no gradient) computes the same loss."""
    x, y = _batch()
    results = []
    for chunk in (0, 1, 7, 16, 48, 1000):
        cfg = dataclasses.replace(CFG, loss_chunk_tokens=chunk)
        model = GPT(cfg)
        init_weights(model, cfg, 0)
        loss = model(x, targets=y)
        with torch.no_grad():
            assert torch.allclose(model(x, targets=y), loss, rtol=1e-6)
        results.append((loss.item(), _grads(model, loss)))
    for loss, grads in results[1:]:
        assert abs(loss - results[0][0]) <= 1e-6 * results[0][0]
        _check(grads, results[0][1], torch.float32, "chunk sizes")


def test_the_loss_keeps_its_gradients_not_the_logits() -> None:
    """What a forward of the loss leaves alive for backward: the whole-logits loss keeps its fp32 log-probabilities,
    [tokens, vocab]; the chunked one nothing the size of a chunk's logits or more: its largest saved tensor is
    the weight's gradient [padded vocab, d] (here a tenth of the logits' bytes) and the total held falls by about
    the logits' bytes, which a vocabulary ten times larger would multiply."""
    x, y = _batch()
    held = {}
    for chunk in (0, 8):
        cfg = dataclasses.replace(CFG, loss_chunk_tokens=chunk, seq_len=24)
        model = GPT(cfg)
        init_weights(model, cfg, 0)
        _, held[chunk] = held_by_forward(lambda m=model: m(x, targets=y), [*model.parameters(), x, y])
    logits = 2 * 24 * 300 * 4  # fp32
    assert held[0] - held[8] >= logits - 320 * 32 * 4
    # The saved tensors of the fused loss's node: its two gradients, each smaller than a chunk's logits x d / 8.
    model = GPT(dataclasses.replace(CFG, loss_chunk_tokens=8))
    loss = model(x, targets=y)
    saved = [t for t in loss.grad_fn.saved_tensors if t is not None]
    assert sorted(t.shape for t in saved) == [torch.Size([48, 32]), torch.Size([320, 32])]
    assert all(t.numel() < 48 * 300 for t in saved)


def _tp(rank: int, world: int, tied: bool, sp: bool, dtype: torch.dtype) -> dict:
    """Rank ``rank``'s tp = 2 model: the chunked loss and its gradients, against the unchunked vocab-parallel loss of
    the same weights; the loss and gradients (whole, summed over the ranks' tp slices) to compare with one process."""
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    group = dist.group.WORLD
    model = GPT(cfg, group, sequence_parallel=sp)
    init_weights(model, cfg, 0)
    model.to(dtype)
    x, y = _batch()
    chunked = model(x, targets=y)
    grads = _grads(model, chunked)
    reference = model.loss_sum(model(x), y)
    _check(grads, _grads(model, reference), dtype, f"tp rank {rank}")
    assert abs(chunked.item() - reference.item()) <= TOL[dtype] * reference.item()
    return {"loss": chunked.item(), "head": grads["wte.weight" if tied else "lm_head.weight"]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tp2_chunked_loss_is_the_vocab_parallel_loss(tied: bool, sp: bool) -> None:
    """At tp = 2 (rank 1's block part padding) every rank's loss and gradients equal the unchunked vocab-parallel
    loss's, in fp32 and bf16, and the head's weight blocks stacked are one process's gradient (untied; its padding 0
    either way)."""
    for dtype in (torch.float32, torch.bfloat16):
        ranks = run_distributed(_tp, 2, tied, sp, dtype)
        cfg = dataclasses.replace(CFG, tie_embeddings=tied)
        one = GPT(cfg)
        init_weights(one, cfg, 0)
        one.to(dtype)
        x, y = _batch()
        expected = F.cross_entropy(one(x).flatten(0, 1).float(), y.flatten(), reduction="sum")
        whole = _grads(one, expected)["wte.weight" if tied else "lm_head.weight"]
        stacked = torch.cat([r["head"] for r in ranks])
        assert torch.count_nonzero(stacked[300:]) == 0
        if not tied:  # a tied weight's gradient also has the embedding's, outside the loss (checked per rank above)
            _check({"head": stacked[:300]}, {"head": whole[:300]}, dtype, "tp=2 head weight")
        for r in ranks:
            assert abs(r["loss"] - expected.item()) <= TOL[dtype] * expected.item()
