"""Deferred weight gradients: the zero-bubble schedules' W as the weight-gradient GEMMs alone (Megatron's
WeightGradStore).

A linear layer given a ``WeightGradStore`` (``defer_weight_grads``; trident/build.py gives one to every eager chunk
past stage 0 under zb-h1 and zb-v) computes, in a backward run while the store is ``deferring`` (the executor's I),
its input and bias gradients only, and keeps its input and output gradient for the weight's GEMM; ``weight_pass``
(W) does those GEMMs and hands their sums to autograd in one engine call on the weights themselves, so each weight's
gradient is accumulated once, through its post-accumulate hooks (the reducers'; autograd also calls them in I with
no gradient, which they ignore). Outside ``deferring`` the layer computes both gradients, as ``F.linear`` does. Every
other parameter (norms, embeddings, the LM head, experts, FP8 layers) gets its gradient in I. I + W cost one
backward's FLOPs (full recomputation: a GEMM a block more), torch's split more (docs/benchmarks.md). A compiled
block keeps torch's split: the store's side effect in backward would break its graph at every layer.
"""

from __future__ import annotations

import torch
from torch import nn


class WeightGradStore:
    """What I keeps for W: (weight, input, output gradient) of each deferred GEMM, tokens as rows, in the compute
    dtype."""

    def __init__(self) -> None:
        self.deferring = False
        self._kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def keep(self, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
        self._kept.append((weight, x, dy))

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        kept, self._kept = self._kept, []
        return kept


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` on the tokens as rows (its kernels: addmm, and mm for the two gradients)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store: WeightGradStore, dtype: torch.dtype):  # type: ignore[override]
        x2, wc = x.reshape(-1, x.shape[-1]).to(dtype), weight.to(dtype)
        ctx.save_for_backward(x2, wc)
        # The parameter itself, for W to accumulate into: a saved tensor comes back detached from a recomputation.
        ctx.weight, ctx.store, ctx.x_dtype, ctx.shape = weight, store, x.dtype, x.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        # Grad mode on (nothing to record: detached) for selective recomputation's policy to see the layer's GEMM.
        with torch.enable_grad():
            x2, wt = x2.detach(), wc.detach().t()
            y = x2.mm(wt) if bias is None else torch.addmm(bias.to(dtype).detach(), x2, wt)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        (x2, wc), weight = ctx.saved_tensors, ctx.weight
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dy2.mm(wc).view(ctx.shape).to(ctx.x_dtype)
        db = None if ctx.bias_dtype is None else dy2.sum(0).to(ctx.bias_dtype)
        if ctx.store.deferring:  # detached: the saved input's graph would keep the chunk's input and its gradient
            ctx.store.keep(weight, x2.detach(), dy2)
            return dx, None, db, None, None
        return dx, dy2.t().mm(x2).to(weight.dtype), db, None, None


def deferred_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: WeightGradStore
) -> torch.Tensor:
    """``F.linear`` whose weight gradient waits in ``store`` while it defers (under autocast: in its dtype)."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return _DeferredLinear.apply(x, weight, bias, store, x.dtype)
    with torch.autocast(kind, enabled=False):
        return _DeferredLinear.apply(x, weight, bias, store, torch.get_autocast_dtype(kind))


class _WeightGrad(torch.autograd.Function):
    """A root whose backward is one weight's kept GEMMs, summed: autograd accumulates the sum as the weight's gradient
    (its hooks run) right after, so about one weight's gradient exists at a time, and, holding the only reference to
    it, takes it without the copy that a gradient handed to ``torch.autograd.backward`` would cost."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, uses: list) -> torch.Tensor:  # type: ignore[override]
        ctx.uses, ctx.dtype = uses, weight.dtype
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):  # type: ignore[override]
        uses, ctx.uses = ctx.uses, None
        x, dy = uses.pop()
        g = dy.t().mm(x)
        while uses:  # each pair let go once added in
            x, dy = uses.pop()
            g.addmm_(dy.t(), x)
        return g.to(ctx.dtype), None


def weight_pass(kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """W: the kept GEMMs, summed per weight and accumulated by autograd, in one engine call."""
    uses: dict[int, tuple[torch.Tensor, list]] = {}
    for weight, x, dy in kept:
        uses.setdefault(id(weight), (weight, []))[1].append((x, dy))
    kept.clear()
    roots = [_WeightGrad.apply(weight, pairs) for weight, pairs in uses.values()]
    uses.clear()
    if roots:
        torch.autograd.backward(roots)


def defer_weight_grads(model: nn.Module, store: WeightGradStore) -> int:
    """Give ``store`` to every linear layer of ``model`` that can defer (a leaf weight, not FP8); how many."""
    layers = [m for m in model.modules() if hasattr(m, "wgrad") and getattr(m, "fp8", None) is None]
    for m in layers:
        m.wgrad = store
    return len(layers)
