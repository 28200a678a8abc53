"""``parallel.cp_comm=allgather``: gather every rank's K/V before attention, reduce-scatter their gradients after.

Each rank then attends its own queries to the whole sequence's keys in one block. The gathered K/V cost
``cp`` times a rank's own, cheap with grouped-query heads (few kv heads); torchtitan's current choice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trident.parallel.comm import _all_gather, _reduce_scatter
from trident.parallel.context.core import block_attention
from trident.parallel.context.span import TokenSpan


class GatherKV(torch.autograd.Function):
    """All-gather ``[..., T, D]`` along the sequence dim (-2) forward; reduce-scatter the gradient backward (every
    rank's queries read every key, so each key's gradient is a sum over the ranks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group, -2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, ctx.group, -2), None


def gather_span(span: TokenSpan, group: dist.ProcessGroup) -> TokenSpan:
    """Every rank's span one after another, rank 0 first (no gradient: indices and document ids)."""
    index = _all_gather(span.index, group, -1)
    documents = None if span.documents is None else _all_gather(span.documents, group, 1)
    return TokenSpan(index, documents)


def window_keys(span: TokenSpan, group: dist.ProcessGroup, shared: dict | None) -> TokenSpan:
    """Every rank's span one after another, rank 0 first, on ``span``'s device: the window's (``shared["keys"]``,
    from the micro-batch: parallel/context/batch.py), else gathered over ``group``, once for the calls that share
    ``shared``."""
    if shared is not None and "keys" in shared:
        return shared["keys"]
    if shared is not None and "host_keys" in shared:
        keys = shared["host_keys"].to(span.index.device)
    else:
        keys = gather_span(span, group)
    if shared is not None:
        shared["keys"] = keys
    return keys


def host_keys(span: TokenSpan, group: dist.ProcessGroup, shared: dict | None) -> TokenSpan:
    """``window_keys`` on the host (numpy arrays): the micro-batch's, else the gathered keys copied to the host."""
    if shared is not None and "host_keys" in shared:
        return shared["host_keys"]
    keys = window_keys(span, group, shared).on_host()
    if shared is not None:
        shared["host_keys"] = keys
    return keys


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: TokenSpan,
    group: dist.ProcessGroup,
    scale: float,
    shared: dict | None = None,
) -> torch.Tensor:
    """This rank's queries ``[B, H, T/cp, D]`` against the gathered keys and values."""
    keys = window_keys(span, group, shared)
    kv = GatherKV.apply(torch.stack([k, v]), group)  # one collective for both
    out, _ = block_attention(q, kv[0], kv[1], span.mask(keys), scale)
    return out
