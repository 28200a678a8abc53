"""``context_attention``: attention of a rank's part of the sequence, exact over the whole, by ``parallel.cp_comm``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trident.parallel.comm import rank_and_size
from trident.parallel.context.allgather import allgather_attention
from trident.parallel.context.core import block_attention, default_scale
from trident.parallel.context.ring import ring_attention
from trident.parallel.context.span import TokenSpan
from trident.parallel.context.ulysses import ulysses_attention

EXCHANGES = {"allgather": allgather_attention, "ring": ring_attention, "ulysses": ulysses_attention}
CP_COMMS = tuple(EXCHANGES)


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: TokenSpan,
    group: dist.ProcessGroup | None,
    comm: str = "ring",
    scale: float | None = None,
    shared: dict | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v of this rank's queries ``[B, H, T/cp, D]`` over the whole sequence (k, v
    ``[B, G, T/cp, D]``, G dividing H), masked causally by global index and inside documents (``span``).
    ``shared``: a dict the calls with one span share (every layer of a forward: models/context_window.py), where
    the exchange keeps what depends on the span alone, worked out at the first call."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    if rank_and_size(group)[1] == 1:
        return block_attention(q, k, v, span.mask(span), scale)[0]
    if comm not in EXCHANGES:
        raise ValueError(f"parallel.cp_comm={comm!r} is not one of {', '.join(CP_COMMS)}")
    return EXCHANGES[comm](q, k, v, span, group, scale, shared)
