"""Context-parallel attention (parallel/context/) on real gloo groups: each exchange against dense attention in
float64 (outputs and q/k/v gradients to 1e-12), and bitwise against a one-process run of the same blocks in the same
order in float32; and the head-tail split and its balance, pure."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trident.parallel.context import core
from trident.parallel.context.attention import CP_COMMS, context_attention
from trident.parallel.context.core import block_attention, default_scale
from trident.parallel.context.ring import block_grads, fold_block, joined
from trident.parallel.context.span import TokenSpan
from trident.parallel.context.split import (
    balance,
    head_tail_order,
    pairs_per_rank,
    rank_index,
    split_error,
    split_sequence,
    unsplit_sequence,
)
from trident.parallel.context.ulysses import heads_error
from trident.ranks import run_distributed

B, H, T, D = 2, 4, 32, 8
# Packed documents crossing the chunk borders of every cp tested (chunks of 8 at cp=2, of 4 at cp=4).
DOC_LENGTHS = ([5, 11, 3, 13], [20, 12])


def _documents() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in DOC_LENGTHS])


def _inputs(kv_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(kv_heads)
    q, dy = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, T, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, dy


def _local(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    return split_sequence(x, cp, rank, dim=2)


def _run(comm, q, k, v, dy, docs, cp, rank, group):
    """This rank's output and q/k/v gradients from the distributed attention."""
    ql, kl, vl = (_local(x, cp, rank).requires_grad_() for x in (q, k, v))
    span = TokenSpan(rank_index(T, cp, rank), None if docs is None else split_sequence(docs, cp, rank))
    out = context_attention(ql, kl, vl, span, group, comm)
    out.backward(_local(dy, cp, rank))
    return out.detach(), ql.grad, kl.grad, vl.grad


def _dense(q, k, v, dy, docs):
    """Plain SDPA over the whole sequence: output and gradients."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    whole = TokenSpan.whole(T, docs)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=whole.mask(whole)[:, None], enable_gqa=True)
    out.backward(dy)
    return out.detach(), q.grad, k.grad, v.grad


# One-process twins of each exchange: the same blocks through the same core, merged and summed in the same order.


def _spans(docs, cp):
    return [TokenSpan(rank_index(T, cp, r), None if docs is None else split_sequence(docs, cp, r)) for r in range(cp)]


def _ring_twin(q, k, v, dy, docs, cp, rank):
    spans, scale = _spans(docs, cp), default_scale(D)
    qs, ks, vs, dys = ([_local(x, cp, r) for r in range(cp)] for x in (q, k, v, dy))
    outs, lses = [], []
    for r in range(cp):
        parts = [(None, None)] * 2
        for step in range(cp):
            o = (r - step) % cp
            parts = fold_block(qs[r], ks[o], vs[o], spans[r], spans[o], scale, parts)
        out, lse = joined(parts, qs[r])
        outs.append(out)
        lses.append(lse)

    def grads(r, o):
        return block_grads(qs[r], ks[o], vs[o], spans[r], spans[o], outs[r], lses[r], dys[r], scale)

    dq = torch.zeros_like(qs[rank])
    for step in range(cp):
        for part, _, bq, _, _ in grads(rank, (rank - step) % cp):
            dq[:, :, part] += bq
    dkv = torch.zeros(2, *ks[rank].shape, dtype=k.dtype)
    for step in range(cp):  # the owner's running sum visits ranks owner, owner+1, ...
        for _, part, _, bk, bv in grads((rank + step) % cp, rank):
            dkv[0, :, :, part] += bk
            dkv[1, :, :, part] += bv
    return outs[rank], dq, dkv[0], dkv[1]


def _allgather_twin(q, k, v, dy, docs, cp, rank):
    spans = _spans(docs, cp)
    keys = TokenSpan.cat(spans)
    kg, vg = (torch.cat([_local(x, cp, r) for r in range(cp)], dim=2) for x in (k, v))
    grads_k, grads_v, mine = [], [], None
    for r in range(cp):
        qr, kr, vr = _local(q, cp, r).requires_grad_(), kg.clone().requires_grad_(), vg.clone().requires_grad_()
        out, _ = block_attention(qr, kr, vr, spans[r].mask(keys))
        out.backward(_local(dy, cp, r))
        grads_k.append(kr.grad.chunk(cp, dim=2)[rank])
        grads_v.append(vr.grad.chunk(cp, dim=2)[rank])
        if r == rank:
            mine = out.detach(), qr.grad
    return *mine, sum(grads_k), sum(grads_v)


def _ulysses_twin(q, k, v, dy, docs, cp, rank):
    keys = TokenSpan.cat(_spans(docs, cp))
    qg, kg, vg, dyg = (torch.cat([_local(x, cp, r) for r in range(cp)], dim=2) for x in (q, k, v, dy))
    qg, kg, vg = (x.requires_grad_() for x in (qg, kg, vg))
    kx, vx = kg, vg
    if kg.shape[1] % cp:
        kx, vx = (x.repeat_interleave(cp // kg.shape[1], dim=1) for x in (kg, vg))
    heads = [
        block_attention(qj, kj, vj, keys.mask(keys))[0]
        for qj, kj, vj in zip(qg.chunk(cp, dim=1), kx.chunk(cp, dim=1), vx.chunk(cp, dim=1), strict=True)
    ]
    out = torch.cat(heads, dim=1)
    out.backward(dyg)
    return tuple(x.chunk(cp, dim=2)[rank] for x in (out.detach(), qg.grad, kg.grad, vg.grad))


TWINS = {"ring": _ring_twin, "allgather": _allgather_twin, "ulysses": _ulysses_twin}
NAMES = ("output", "dq", "dk", "dv")


def _check(rank: int, cp: int) -> None:
    group = dist.new_group(list(range(cp)))  # a subgroup, as the cp group of a bigger world is
    for comm in CP_COMMS:
        for kv_heads in (H, 2):
            for docs in (None, _documents()):
                case = f"{comm} cp={cp} kv_heads={kv_heads} documents={docs is not None}"
                q, k, v, dy = _inputs(kv_heads, torch.float64)
                got = _run(comm, q, k, v, dy, docs, cp, rank, group)
                for name, a, b in zip(NAMES, got, _dense(q, k, v, dy, docs), strict=True):
                    diff = (a - _local(b, cp, rank)).abs().max().item()
                    assert diff < 1e-12, f"{case}: {name} differs from dense float64 by {diff}"
                q, k, v, dy = _inputs(kv_heads, torch.float32)
                got = _run(comm, q, k, v, dy, docs, cp, rank, group)
                twin = TWINS[comm](q, k, v, dy, docs, cp, rank)
                for name, a, b in zip(NAMES, got, twin, strict=True):
                    # allgather's dK/dV are gloo's reduce-scatter sums: the same order as the twin's for two terms.
                    if comm == "allgather" and name in ("dk", "dv") and cp > 2:
                        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), f"{case}: {name}"
                    else:
                        assert torch.equal(a, b), f"{case}: {name} not bitwise the one-process twin's"


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [2, 4])
def test_exchanges_match_dense_and_their_one_process_twin(cp):
    run_distributed(_check, cp)


def test_head_tail_split_and_its_inverse():
    assert rank_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert head_tail_order(16, 4).tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    x = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3, 4):
        parts = [split_sequence(x, cp, r) for r in range(cp)]
        assert torch.equal(unsplit_sequence(parts), x)


def test_causal_split_is_balanced_and_documents_are_measured():
    assert pairs_per_rank(8, 2) == [18, 18]
    for cp in (2, 4, 8):
        assert balance(4096, cp) == 1.0
    docs = _documents()
    # Counted by hand from DOC_LENGTHS: each query sees its place in its document + 1 keys.
    assert sum(pairs_per_rank(T, 2, docs)) == sum(n * (n + 1) // 2 for lengths in DOC_LENGTHS for n in lengths)
    assert balance(T, 2, docs) > 1.0


def test_refusals_name_the_key_and_a_value_that_works():
    assert split_error(32, 4) is None
    assert split_error(100, 4) == (
        "model.seq_len=100 does not split into 2 x parallel.cp=4 equal chunks; set model.seq_len=96"
    )
    assert heads_error(8, 2, 4) is None and heads_error(8, 8, 2, tp=2) is None
    assert "model.n_heads=6" in heads_error(6, 6, 4) and "parallel.cp_comm=ring" in heads_error(6, 6, 4)
    assert "model.n_kv_heads=6" in heads_error(12, 6, 4)


def test_the_plain_core_and_the_kernel_agree_with_rows_that_see_no_key():
    """The plain PyTorch core (CUDA in fp32, other devices) against the CPU kernel's, both directions, in float64:
    grouped kv heads, packed documents, and query rows whose keys all lie in another block (output 0, lse -inf)."""
    q, k, v, dy = _inputs(2, torch.float64)
    docs = _documents()
    queries, keys = TokenSpan(torch.arange(8), docs[:, :8]), TokenSpan(torch.arange(16, 32), docs[:, 16:])
    mask = queries.mask(keys)
    assert not mask.any(dim=-1).all()  # some rows see nothing here
    args = (q[:, :, :8], k[:, :, 16:], v[:, :, 16:], mask, default_scale(D))
    out, lse = core._plain_forward(*args)
    kernel_out, kernel_lse = core._cpu_forward(*args)
    assert torch.allclose(out, kernel_out, rtol=0, atol=1e-12)
    assert torch.equal(lse.isinf(), kernel_lse.isinf()) and torch.allclose(lse, kernel_lse, rtol=0, atol=1e-12)
    assert (out[lse.isinf()] == 0).all()
    plain = core._plain_backward(*args[:4], out, lse, dy[:, :, :8], args[4])
    kernel = core._cpu_backward(*args[:4], out, lse, dy[:, :, :8], args[4])
    for name, a, b in zip(NAMES[1:], plain, kernel, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name
