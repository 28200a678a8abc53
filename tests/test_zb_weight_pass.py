"""The zero-bubble W pass does only what the weight gradients need: the input pass (I) and the weight pass (W) of a
chunk together cost the FLOPs of one whole backward, and give its gradients, both ways W is made: the linear layers'
deferred GEMMs (parallel/wgrad.py, every eager chunk) and torch's split for compiled chunks
(parallel/pipeline/executor.py ``backward_weight``; one backward over all the parameter groups at once redid the
input-gradient path between them: 1.5 backwards' FLOPs)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input
from torch.utils.flop_counter import FlopCounterMode

from trident.config import ModelConfig
from trident.models.checkpointing import apply_activation_checkpointing
from trident.models.gpt import GPT, init_weights
from trident.parallel.pipeline.executor import backward_weight
from trident.parallel.wgrad import WeightGradStore, defer_weight_grads, weight_pass

CFG = ModelConfig(name="t", n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=100)


def _chunk_pass(model: GPT, x: torch.Tensor) -> torch.Tensor:
    """A middle stage: activations in, the blocks, a scalar out."""
    h = x
    for block in model.layers.values():
        h = block(h)
    return (h * h).sum()


def _grads(model: GPT) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_input_and_weight_passes_cost_one_backward_and_give_its_gradients():
    torch.manual_seed(0)
    model = GPT(CFG)
    init_weights(model, CFG, seed=0)
    x = torch.randn(2, CFG.seq_len, CFG.d_model)

    xa = x.clone().requires_grad_(True)
    out = _chunk_pass(model, xa)
    with FlopCounterMode(display=False) as full:
        out.backward()
    expected, expected_dx = _grads(model), xa.grad

    flops = {}
    for together in (False, True):
        xb = x.clone().requires_grad_(True)
        out = _chunk_pass(model, xb)
        with FlopCounterMode(display=False) as i_pass:
            (dx,), kept = stage_backward_input([out], None, [xb], model.parameters())
        with FlopCounterMode(display=False) as w_pass:
            backward_weight(kept, together=together)
        flops[together] = i_pass.get_total_flops() + w_pass.get_total_flops()
        torch.testing.assert_close(dx, expected_dx, rtol=0, atol=0)
        got = _grads(model)
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)
    assert flops[False] == full.get_total_flops()
    assert flops[True] == 1.5 * full.get_total_flops()  # the single backward redoes the input-gradient path


def _deferred_pass(model: GPT, x: torch.Tensor, store: WeightGradStore, autocast: bool = False, count_i: bool = True):
    """I then W of the deferred path: the gradients and dx, the FLOPs of each pass (I's: None unless ``count_i``),
    and each weight's hook calls."""
    calls: dict[str, int] = {}
    handles = [
        p.register_post_accumulate_grad_hook(
            lambda p, n=n: calls.__setitem__(n, calls.get(n, 0) + (p.grad is not None))
        )
        for n, p in model.named_parameters()
    ]
    xb = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = _chunk_pass(model, xb)
    store.deferring = True
    with FlopCounterMode(display=False) if count_i else contextlib.nullcontext() as i_pass:
        out.backward()
    store.deferring = False
    kept = store.take()
    n_kept = len(kept)
    after_i = {n: p.grad is not None for n, p in model.named_parameters()}
    with FlopCounterMode(display=False) as w_pass:
        weight_pass(kept)
    for h in handles:
        h.remove()
    flops = (i_pass.get_total_flops() if count_i else None, w_pass.get_total_flops())
    return _grads(model), xb.grad, flops, after_i, calls, n_kept


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_deferred_weight_gemms_give_one_backwards_gradients_at_its_flops(policy):
    """Every linear weight waits for W (no gradient after I), W is only their GEMMs, I + W cost one backward's FLOPs,
    every weight's hook runs once with a gradient (the reducer's ignores autograd's empty call in I), and the
    gradients equal one backward's to the bit. Under recomputation the saved weight comes back detached: W still
    accumulates into the parameter."""
    torch.manual_seed(0)
    model = GPT(CFG)
    init_weights(model, CFG, seed=0)
    apply_activation_checkpointing(model, policy)
    x = torch.randn(2, CFG.seq_len, CFG.d_model)
    xa = x.clone().requires_grad_(True)
    out = _chunk_pass(model, xa)
    with FlopCounterMode(display=False) if policy != "selective" else contextlib.nullcontext() as full:
        out.backward()
    expected, expected_dx = _grads(model), xa.grad

    store = WeightGradStore()
    linears = defer_weight_grads(model, store)
    assert linears == 4 * CFG.n_layers  # qkv, proj, fc, proj per block
    # The flop counter adds a view to a recomputation, which selective recomputation's replay cache does not hold.
    selective = policy == "selective"
    got, dx, (i_flops, w_flops), after_i, calls, kept = _deferred_pass(model, x, store, count_i=not selective)
    assert kept == linears
    deferred = {n for n, had in after_i.items() if not had and n in expected}
    assert deferred == {n for n in expected if n.endswith(".weight") and ("attn." in n or "mlp." in n)}
    assert calls == dict.fromkeys(expected, 1)
    layer_gemm = 2 * 2 * CFG.seq_len  # 2 FLOPs per multiply-add, 2 x seq_len token rows
    d, f = CFG.d_model, 4 * CFG.d_model
    assert w_flops == CFG.n_layers * layer_gemm * (3 * d * d + d * d + 2 * d * f)
    if not selective:
        # Under full recomputation torch stops the replay at a block's last saved tensor: before a built-in op's
        # kernel (its inputs are saved first), after an autograd.Function's (saved once it returns), so the deferred
        # path also reruns each block's last GEMM (the MLP's output projection).
        extra = CFG.n_layers * layer_gemm * f * d if policy == "full" else 0
        assert i_flops + w_flops == full.get_total_flops() + extra
    torch.testing.assert_close(dx, expected_dx, rtol=0, atol=0)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_deferred_weight_gemms_under_bf16_autocast_match_autocasts_backward():
    """Under autocast the deferred layer computes in bf16 as F.linear does there, and W casts each weight's gradient
    to the parameter's dtype (fp32): the same gradients as autograd's, within bf16 rounding of their sums."""
    torch.manual_seed(0)
    model = GPT(CFG)
    init_weights(model, CFG, seed=0)
    x = torch.randn(2, CFG.seq_len, CFG.d_model)
    xa = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _chunk_pass(model, xa)
    out.backward()
    expected = _grads(model)
    defer_weight_grads(model, store := WeightGradStore())
    got, dx, *_ = _deferred_pass(model, x, store, autocast=True)
    assert dx.dtype == torch.float32
    for name in expected:
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], expected[name], rtol=2e-2, atol=2e-3, msg=name)


def test_a_weight_used_twice_gets_the_sum_of_its_uses_once():
    lin = torch.nn.Linear(8, 8, bias=False)
    from trident.parallel.wgrad import deferred_linear

    x = torch.randn(3, 8, requires_grad=True)
    (lin(lin(x)) ** 2).sum().backward()
    expected = lin.weight.grad.clone()
    lin.weight.grad = None
    calls = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad is not None))
    store = WeightGradStore()
    store.deferring = True
    (deferred_linear(deferred_linear(x, lin.weight, None, store), lin.weight, None, store) ** 2).sum().backward()
    store.deferring = False
    weight_pass(store.take())
    assert calls == [False, True]  # autograd calls the hook with nothing in I, then once with the sum in W
    torch.testing.assert_close(lin.weight.grad, expected, rtol=1e-6, atol=1e-7)


def test_the_weight_pass_accumulates_each_gradient_before_the_next_gemm(monkeypatch):
    """W's peak is about one weight's gradient, not a chunk's: each weight's GEMMs, then its accumulation (the
    reducer's hook takes and frees it), then the next weight's."""
    from trident.parallel import wgrad

    log = []
    weights = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(5)]
    for w in weights:
        w.register_post_accumulate_grad_hook(lambda p: log.append("accumulated"))
    backward = wgrad._WeightGrad.backward

    def logged(ctx, grad):  # noqa: ANN001, ANN202
        log.append("gemm")
        return backward(ctx, grad)

    monkeypatch.setattr(wgrad._WeightGrad, "backward", staticmethod(logged))
    weight_pass([(w, torch.randn(3, 8), torch.randn(3, 8)) for w in weights])
    assert log == ["gemm", "accumulated"] * 5
