"""``parallel.cp_comm=ulysses``: all-to-all from sequence-split to head-split, whole-sequence attention on a
rank's share of the heads, and all-to-all back (DeepSpeed-Ulysses).

Rank j receives query heads ``[j H/cp, (j+1) H/cp)`` of every rank's tokens, so the heads (after tensor
parallelism: a tp rank's heads) must divide by cp. K/V heads follow: split the same way when cp divides them;
when fewer (cp a multiple of them) each is repeated so that every rank receives the one its query heads read,
as tensor parallelism does (parallel/tensor.py), the repeats' gradients summed back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trident.parallel.context.allgather import window_keys
from trident.parallel.context.core import block_attention
from trident.parallel.context.span import TokenSpan


def heads_error(n_heads: int, kv_heads: int, cp: int, tp: int = 1) -> str | None:
    """Why ulysses cannot spread these heads (each tp rank's share) over cp ranks; None if it can."""
    if n_heads % (tp * cp):
        return (
            f"parallel.cp_comm=ulysses spreads model.n_heads={n_heads} over parallel.tp={tp} x parallel.cp={cp} "
            f"ranks, which does not divide them; set parallel.cp_comm=ring"
        )
    local_kv = kv_heads // tp if kv_heads % tp == 0 else 1
    if local_kv % cp and cp % local_kv:
        return (
            f"parallel.cp_comm=ulysses cannot spread {local_kv} kv heads per tp rank (model.n_kv_heads={kv_heads}) "
            f"over parallel.cp={cp} ranks; set parallel.cp_comm=ring"
        )
    return None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Block j of ``scatter_dim`` goes to rank j; the blocks received are concatenated along ``gather_dim``."""
    size = dist.get_world_size(group)
    blocks = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(blocks)
    dist.all_to_all_single(received.view(-1), blocks.view(-1), group=group)
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class DimAllToAll(torch.autograd.Function):
    """Sequence-split <-> head-split; the backward is the same exchange the other way."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: TokenSpan,
    group: dist.ProcessGroup,
    scale: float,
    shared: dict | None = None,
) -> torch.Tensor:
    """This rank's queries ``[B, H, T/cp, D]``, attended over the whole sequence one head block per rank."""
    cp, heads, kv_heads = dist.get_world_size(group), q.shape[1], k.shape[1]
    if error := heads_error(heads, kv_heads, cp):
        raise ValueError(error)
    keys = window_keys(span, group, shared)
    kv = torch.stack([k, v])  # [2, B, G, T/cp, D]
    if kv_heads % cp:
        kv = kv.repeat_interleave(cp // kv_heads, dim=2)  # kv head j // (cp / G) for rank j
    q_heads = DimAllToAll.apply(q, group, 1, 2)  # [B, H/cp, T, D]
    kv_heads_block = DimAllToAll.apply(kv, group, 2, 3)
    out, _ = block_attention(q_heads, kv_heads_block[0], kv_heads_block[1], keys.mask(keys), scale)
    return DimAllToAll.apply(out, group, 2, 1)
