"""The zero-bubble W pass does only what the weight gradients need: the input pass (I) and the weight pass (W) of a
chunk together cost the FLOPs of one whole backward, and give its gradients (parallel/pipeline/executor.py
``backward_weight``). One backward over all the parameter groups at once also redid the input-gradient path between
them: 1.5 backwards' FLOPs (about a third more CPU time for the bench's zb-h1 ranks)."""

from __future__ import annotations

import torch
from torch.distributed.pipelining._backward import stage_backward_input
from torch.utils.flop_counter import FlopCounterMode

from trident.config import ModelConfig
from trident.models.gpt import GPT, init_weights
from trident.parallel.pipeline.executor import backward_weight

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
