"""The data-parallel gradient reducer against a one-process full-batch reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from trident.config import ModelConfig
from trident.models.gpt import GPT, init_weights, lm_loss_sum
from trident.parallel.reducer import GradReducer
from trident_dev.ranks import run_distributed

CFG = ModelConfig(name="t", n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=100)


def _micro_batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g) for _ in range(n)]


def _accumulate(model: GPT, reducer: GradReducer, batches: list[torch.Tensor], meddle) -> None:
    for i, t in enumerate(batches):
        reducer.set_sync(i == len(batches) - 1)
        lm_loss_sum(model(t[:, :-1]), t[:, 1:]).backward()
        meddle(model)


@pytest.mark.parametrize(
    "meddle",
    [
        lambda m: None,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1).zero_grad(set_to_none=True),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1).zero_grad(set_to_none=False),
        lambda m: m.zero_grad(),
    ],
    ids=["untouched", "zero_grad-set_to_none", "zero_grad-in-place", "module-zero_grad"],
)
def test_nothing_done_to_grad_between_micro_batches_drops_accumulated_gradients(meddle):
    """A stray zero_grad (either kind) after any micro-batch leaves the step's gradient exactly as it was."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = []
        for touch in (lambda m: None, meddle):
            model = GPT(CFG)
            init_weights(model, CFG, seed=0)
            reducer = GradReducer(list(model.parameters()), dist.group.WORLD, bucket_mb=0.01)
            assert len(reducer.buckets) > 1
            _accumulate(model, reducer, _micro_batches(3), touch)
            reducer.finish()
            assert all(p.grad is None for p in model.parameters())  # the buffer is the only copy
            results.append(reducer.buffer.clone())
            reducer.remove_hooks()
        assert results[0].abs().sum() > 0
        assert torch.equal(results[0], results[1])
    finally:
        dist.destroy_process_group()


def test_16_bit_gradients_accumulate_in_fp32():
    """bf16 parameters: each micro-batch's bf16 gradient is added into the fp32 buffer, not summed in bf16."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = GPT(CFG)
        init_weights(model, CFG, seed=0)
        model.to(torch.bfloat16)
        reducer = GradReducer(list(model.parameters()), dist.group.WORLD)
        assert reducer.buffer.dtype == torch.float32
        batches = _micro_batches(4)
        expected = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
        twin = GPT(CFG).to(torch.bfloat16)
        twin.load_state_dict(model.state_dict())
        for t in batches:
            lm_loss_sum(twin(t[:, :-1]), t[:, 1:]).backward()
            for n, p in twin.named_parameters():
                expected[n] += p.grad.float()
                p.grad = None
        _accumulate(model, reducer, batches, lambda m: None)
        reducer.finish()
        for n, p in model.named_parameters():
            assert torch.equal(reducer.grad(p), expected[n]), n
        # fp32 accumulation keeps what a bf16 running sum would have rounded away.
        bf16_sum = {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in model.named_parameters()}
        for t in batches:
            lm_loss_sum(twin(t[:, :-1]), t[:, 1:]).backward()
            for n, p in twin.named_parameters():
                bf16_sum[n] += p.grad
                p.grad = None
        assert any(not torch.equal(bf16_sum[n].float(), expected[n]) for n in expected)
        assert all(p.grad is None for p in model.parameters())  # the fp32 buffer is the only copy
    finally:
        dist.destroy_process_group()


def _reference_grads(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model = GPT(CFG)
    init_weights(model, CFG, seed=0)
    x, y = tokens[:, :-1], tokens[:, 1:]
    (lm_loss_sum(model(x), y) / y.numel()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _dp_matches_full_batch(rank: int, world: int, micro: int, bucket_mb: float) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1))
    expected = _reference_grads(tokens)

    model = GPT(CFG)
    init_weights(model, CFG, seed=0)
    reducer = GradReducer(list(model.parameters()), dist.group.WORLD, bucket_mb=bucket_mb)
    mine = tokens.chunk(world)[rank].split(micro)
    n_tokens = tokens.shape[0] * CFG.seq_len
    for i, chunk in enumerate(mine):
        last = i == len(mine) - 1
        reducer.set_sync(last)
        lm_loss_sum(model(chunk[:, :-1]), chunk[:, 1:]).div(n_tokens).backward()
        if last:
            # Every bucket was launched from the backward hooks, before finish() is called.
            assert sum(reducer._next.values()) == len(reducer.buckets)
        else:
            # No communication yet: the gradient is this rank's local partial sum, which differs across ranks.
            both = [torch.empty_like(reducer.buffer) for _ in range(world)]
            dist.all_gather(both, reducer.buffer)
            assert not torch.allclose(both[0], both[1])
    reducer.finish()
    for name, p in model.named_parameters():
        torch.testing.assert_close(reducer.grad(p), expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("micro,bucket_mb", [(4, 25.0), (1, 0.005)])
def test_dp2_gradients_equal_full_batch_gradients(micro, bucket_mb):
    run_distributed(_dp_matches_full_batch, 2, micro, bucket_mb)


def _unused_parameter_does_not_hang(rank: int, world: int) -> None:
    model = GPT(CFG)
    extra = torch.nn.Parameter(torch.zeros(7))  # never used in forward
    reducer = GradReducer([extra, *model.parameters()], dist.group.WORLD, bucket_mb=0.001)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    reducer.set_sync(True)
    lm_loss_sum(model(x), x).backward()
    reducer.finish()
    assert torch.count_nonzero(reducer.grad(extra)) == 0
    # The buffer is identical on both ranks after the reduction.
    other = reducer.buffer.clone()
    dist.broadcast(other, src=0)
    assert torch.equal(other, reducer.buffer)


@pytest.mark.multiprocess
def test_unused_parameter_is_reduced_at_finish():
    run_distributed(_unused_parameter_does_not_hang, 2)
