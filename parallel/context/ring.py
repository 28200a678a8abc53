"""``parallel.cp_comm=ring``: K/V blocks passed around the cp ring, each rank merging partial outputs by their
log-sum-exp.

Forward, at step s = 0 .. cp-1 rank r holds the K/V of rank r-s: it starts sending them on to rank r+1 (and
receiving the next block from r-1), attends its queries to the held block meanwhile, then waits. The partial
outputs are merged in the accumulation dtype (core.merge), in step order. Only one extra K/V block is held at a
time, whatever cp.

Backward walks the ring again: at step s rank r holds the K/V of rank r-s and computes its queries' share of that
block's dK/dV (core.block_backward, from the merged output and log-sum-exp). Its own block's share (step 0) stays
home; from step 1 on the other ranks' shares of a block travel as one running sum, started by rank r+1 at step 1,
added to by each rank it passes and home after step cp-1, where the owner adds it to its own share: cp-1
transfers of dK/dV, as of K/V. dQ stays with its rank. The summation order of every gradient is thus fixed by
the ring, whatever the timing.

Each (query block, key block) pair is computed as its four (query half, key half) quarters, the two chunks of the
head-tail split: under the causal mask a quarter whose keys all come after its queries is skipped, and about a
quarter of the pairs is (half of them in every step but the first).

What depends only on the spans is worked out once per forward and shared by every layer's forward and backward
(``RingPlan``, kept by models/context_window.py): every rank's span (the micro-batch's, or one all-gather) and,
for each block, the quarters that are not masked out with their masks' forms, read on the host spans (core.plain_form:
under the head-tail split of causal windows each is all seen or a triangle, and no mask is built or read again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trident.parallel.context.allgather import host_keys, window_keys
from trident.parallel.context.core import Mask, accumulation_dtype, block_backward, block_forward, merge, plain_form
from trident.parallel.context.span import TokenSpan

_KV, _DKV = 0, 1  # message tags
CP_MARK = "trident.cp"  # around the ring's sends and receives


class _Ring:
    """This rank's neighbours on the ring of ``group``, and a started transfer of one tensor to the next."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def pass_on(self, x: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[dist.Work]]:
        """Send ``x`` to the next rank and receive the previous rank's into a new tensor; wait on the works.
        ``tag`` keeps K/V and their gradients apart when both are in flight."""
        x = x.contiguous()
        received = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        # Marked for a profiled step's split (trident_dev/plan/breakdown.py): cp's messages, not a pipeline's.
        with torch.profiler.record_function(CP_MARK):
            return received, dist.batch_isend_irecv(ops)


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _halves(n: int) -> list[slice]:
    return [slice(0, n // 2), slice(n // 2, n)] if n > 1 else [slice(0, n)]


Quarter = tuple[int, slice, slice, Mask | None]  # (query half's number, its tokens, the key half's tokens, mask)


def _quarters(queries: TokenSpan, keys: TokenSpan) -> list[Quarter]:
    """(query half's number, its tokens, the key half's tokens, their mask's form: a ``PlainMask``, or None for a
    dense mask) of every quarter whose mask is not empty, in the order they are computed; ``queries`` and ``keys``
    on the host (span.py ``on_host``)."""
    out = []
    for i, qs in enumerate(_halves(len(queries))):
        for ks in _halves(len(keys)):
            mask = queries.part(qs).mask(keys.part(ks))
            if mask.any():
                out.append((i, qs, ks, plain_form(mask)))
    return out


def _masked(
    queries: TokenSpan, keys: TokenSpan, quarters: list[Quarter] | None
) -> list[tuple[int, slice, slice, Mask]]:
    """The quarters with their masks: ``quarters`` (a plan's), or worked out from the spans; a dense mask (None)
    built from the spans."""
    if quarters is None:
        quarters = _quarters(queries.on_host(), keys.on_host())
    return [(i, qs, ks, queries.part(qs).mask(keys.part(ks)) if mask is None else mask) for i, qs, ks, mask in quarters]


@dataclass(frozen=True)
class RingPlan:
    """What every layer of one forward shares: this rank's span (``queries``), every rank's (``spans``, from one
    all-gather) and the quarters of each owner's block that are not masked out (``quarters[owner]``). A dense
    quarter's mask (packed documents) is not kept, None, but rebuilt at each use: between forward and backward the
    plan holds the gathered spans only."""

    queries: TokenSpan
    spans: list[TokenSpan]
    quarters: list[list[Quarter]]

    @classmethod
    def of(cls, span: TokenSpan, group: dist.ProcessGroup, shared: dict | None = None) -> RingPlan:
        """The plan of this rank's ``span`` in ``group``; ``shared``: where the window keeps every rank's span
        (allgather.py ``window_keys``)."""
        spans = _rank_spans(window_keys(span, group, shared), len(span))
        hosts = _rank_spans(host_keys(span, group, shared), len(span))
        queries = hosts[dist.get_rank(group)]
        return cls(span, spans, [_quarters(queries, keys) for keys in hosts])


Partial = tuple[torch.Tensor | None, torch.Tensor | None]  # a query half's running (out, lse)


def fold_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    queries: TokenSpan,
    keys: TokenSpan,
    scale: float,
    parts: list[Partial],
    quarters: list[Quarter] | None = None,
) -> list[Partial]:
    """Each query half's running (out, lse) with one key block merged in, quarter by quarter (``quarters``: a
    plan's for this block, else worked out from the spans)."""
    parts = list(parts)
    for i, qs, ks, mask in _masked(queries, keys, quarters):
        parts[i] = merge(*parts[i], *block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], mask, scale))
    return parts


def block_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    queries: TokenSpan,
    keys: TokenSpan,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
    quarters: list[Quarter] | None = None,
) -> list[tuple[slice, slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(query tokens, key tokens, dq, dk, dv) of each quarter of one key block that is not masked out."""
    return [
        (qs, ks, *block_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks], mask, out[:, :, qs], lse[:, :, qs],
                                 dout[:, :, qs], scale))
        for _, qs, ks, mask in _masked(queries, keys, quarters)
    ]  # fmt: skip


def joined(parts: list[Partial], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query halves' (out, lse) as one; a half that saw no key at all: 0 and -inf."""
    outs, lses = [], []
    for (out, lse), qs in zip(parts, _halves(like.shape[2]), strict=True):
        if out is None:
            shape = (*like.shape[:2], qs.stop - qs.start)
            acc = accumulation_dtype(like.dtype)
            out, lse = (
                like.new_zeros((*shape, like.shape[3]), dtype=acc),
                like.new_full(shape, float("-inf"), dtype=acc),
            )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, group, scale):
        ring = _Ring(group)
        kv = torch.stack([k, v])
        parts: list[Partial] = [(None, None)] * len(_halves(len(plan.queries)))
        for step in range(ring.size):
            if step < ring.size - 1:
                arriving, works = ring.pass_on(kv, _KV)
            owner = (ring.rank - step) % ring.size
            parts = fold_block(q, kv[0], kv[1], plan.queries, plan.spans[owner], scale, parts, plan.quarters[owner])
            if step < ring.size - 1:
                _wait(works)
                kv = arriving
        out, lse = joined(parts, q)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.plan = group, scale, plan
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, ring = ctx.plan, _Ring(ctx.group)
        acc = accumulation_dtype(q.dtype)
        kv = torch.stack([k, v])
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        own = torch.zeros(kv.shape, dtype=acc, device=q.device)  # this rank's share of its own block's dK/dV
        dkv, dkv_works = own, []  # the running sum of the held block's owner, from step 1 on
        for step in range(ring.size):
            if step < ring.size - 1:
                arriving, kv_works = ring.pass_on(kv, _KV)
            owner = (ring.rank - step) % ring.size
            grads = block_grads(
                q, kv[0], kv[1], plan.queries, plan.spans[owner], out, lse, dout, ctx.scale, plan.quarters[owner]
            )
            for qs, _, bq, _, _ in grads:
                dq[:, :, qs] += bq
            if step == 1:
                dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            _wait(dkv_works)
            for _, ks, _, bk, bv in grads:
                dkv[0, :, :, ks] += bk
                dkv[1, :, :, ks] += bv
            if step > 0:  # on to the next rank, which holds this owner's K/V at the next step; after the last, home
                dkv, dkv_works = ring.pass_on(dkv, _DKV)
            if step < ring.size - 1:
                _wait(kv_works)
                kv = arriving
        _wait(dkv_works)
        if ring.size > 1:
            dkv = own + dkv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _rank_spans(keys: TokenSpan, n: int) -> list[TokenSpan]:
    """Every rank's span of ``n`` tokens (the keys of each block that will pass by), cut from the window's."""
    return [keys.part(slice(r * n, (r + 1) * n)) for r in range(len(keys) // n)]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: TokenSpan,
    group: dist.ProcessGroup,
    scale: float,
    shared: dict | None = None,
) -> torch.Tensor:
    """This rank's queries ``[B, H, T/cp, D]`` against every rank's keys and values, passed around the ring.
    ``shared``: where the forward's ``RingPlan`` is kept for its other layers (built at the first call)."""
    plan = None if shared is None else shared.get("ring")
    if plan is None:
        plan = RingPlan.of(span, group, shared)
        if shared is not None:
            shared["ring"] = plan
    return RingAttention.apply(q, k, v, plan, group, scale)
