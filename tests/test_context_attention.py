"""Context-parallel attention (parallel/context/) on real gloo groups: each exchange against dense attention in
float64 (outputs and q/k/v gradients to 1e-12), and bitwise against a one-process run of the same blocks in the same
order in float32; and the head-tail split and its balance, pure."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trident.data.dataset import TokenDataset
from trident.data.loader import BatchLoader
from trident.data.sampler import GlobalBatchSampler
from trident.loop import cp_balance
from trident.parallel.batch import document_ids
from trident.parallel.context import core
from trident.parallel.context.attention import CP_COMMS, context_attention
from trident.parallel.context.core import block_attention, default_scale
from trident.parallel.context.ring import block_grads, fold_block, joined
from trident.parallel.context.span import TokenSpan
from trident.parallel.context.split import (
    attended_pairs,
    balanced_order,
    head_tail_order,
    pairs_from_order,
    rank_index,
    rank_part,
    split_error,
    take,
)
from trident.parallel.context.ulysses import heads_error
from trident_dev.ranks import run_distributed

B, H, T, D = 2, 4, 32, 8
# Packed documents crossing the chunk borders of every cp tested (chunks of 8 at cp=2, of 4 at cp=4).
DOC_LENGTHS = ([5, 11, 3, 13], [20, 12])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (the sequence dim; ``[B, T, ...]`` by default)."""
    return x.index_select(dim, rank_index(x.shape[dim], cp, rank, x.device))


def pairs_per_rank(seq_len: int, cp: int, documents: torch.Tensor | None = None) -> list[int]:
    """Attended (query, key) pairs each rank computes under the split (``balanced_order``), summed over the
    batch."""
    return pairs_from_order(attended_pairs(seq_len, documents), balanced_order(seq_len, cp, documents), cp)


def balance(seq_len: int, cp: int, documents: torch.Tensor | None = None) -> float:
    """``cp_balance``: the most attended pairs any rank computes over their mean (1.0 is perfect)."""
    pairs = pairs_per_rank(seq_len, cp, documents)
    return max(pairs) * len(pairs) / sum(pairs)


def _documents() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in DOC_LENGTHS])


def _inputs(kv_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(kv_heads)
    q, dy = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, T, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, dy


# A split: every rank's global token indices in its local order, [1, T] (head-tail, one for every sample) or [B, T]
# (split.py balanced_order with documents: each sample's own).
ORDER: torch.Tensor = torch.empty(0)


def _local(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens of ``x`` [B, H, T, D] under ``ORDER``."""
    index = rank_part(ORDER, cp, rank).expand(x.shape[0], -1)
    return x.gather(2, index[:, None, :, None].expand(x.shape[0], x.shape[1], -1, x.shape[3]))


def _span(docs, cp, rank) -> TokenSpan:
    index = rank_part(ORDER, cp, rank)
    return TokenSpan(index[0] if len(index) == 1 else index, None if docs is None else take(docs, index))


def _run(comm, q, k, v, dy, docs, cp, rank, group):
    """This rank's output and q/k/v gradients from the distributed attention."""
    ql, kl, vl = (_local(x, cp, rank).requires_grad_() for x in (q, k, v))
    out = context_attention(ql, kl, vl, _span(docs, cp, rank), group, comm)
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
    return [_span(docs, cp, r) for r in range(cp)]


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
    own, dkv = (torch.zeros(2, *ks[rank].shape, dtype=k.dtype) for _ in range(2))
    for step in range(cp):  # the owner's own share, and the others' running sum visiting ranks owner+1, owner+2, ...
        total = own if step == 0 else dkv
        for _, part, _, bk, bv in grads((rank + step) % cp, rank):
            total[0, :, :, part] += bk
            total[1, :, :, part] += bv
    dkv = own + dkv
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
    global ORDER
    group = dist.new_group(list(range(cp)))  # a subgroup, as the cp group of a bigger world is
    docs = _documents()
    # Causal windows head-tail; documents split head-tail and split by the document-aware deal (per sample).
    splits = [(None, balanced_order(T, cp)), (docs, balanced_order(T, cp)), (docs, balanced_order(T, cp, docs))]
    assert not torch.equal(splits[2][1][0], splits[2][1][1])  # the two samples are split differently
    for comm in CP_COMMS:
        for kv_heads in (H, 2):
            for split, (docs, order) in enumerate(splits):
                ORDER = order
                case = f"{comm} cp={cp} kv_heads={kv_heads} documents={docs is not None} split={split}"
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
        assert torch.equal(balanced_order(4096, cp)[0], head_tail_order(4096, cp))  # the deal of causal chunks
    docs = _documents()
    # Counted by hand from DOC_LENGTHS: each query sees its place in its document + 1 keys.
    assert sum(pairs_per_rank(T, 2, docs)) == sum(n * (n + 1) // 2 for lengths in DOC_LENGTHS for n in lengths)
    for cp in (2, 4):
        head_tail = [int(split_sequence(_pairs(docs), cp, r).sum()) for r in range(cp)]
        assert max(head_tail) * cp / sum(head_tail) > 1.1  # head-tail is far off with these documents
        assert balance(T, cp, docs) <= 1.02  # single tokens at cp=4: 118 pairs on one rank, 116 on the others
        order = balanced_order(T, cp, docs)
        # Every sample's split is a permutation of its tokens, T / cp to a rank, each rank's in window order.
        assert torch.equal(order.sort(dim=1).values, torch.arange(T).expand(B, T))
        for r in range(cp):
            part = rank_part(order, cp, r)
            assert part.shape == (B, T // cp) and (part.diff(dim=1) > 0).all()


def _pairs(docs: torch.Tensor) -> torch.Tensor:
    """Each query's attended keys: its place in its document + 1."""
    b, t = docs.shape
    starts = torch.cat([torch.zeros(b, 1, dtype=torch.bool), docs[:, 1:] != docs[:, :-1]], dim=1)
    index = torch.arange(t).expand(b, t)
    return index - torch.where(starts, index, 0).cummax(dim=1).values + 1


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


@pytest.mark.parametrize("seq_len", [512, 1024])
def test_cp_balance_on_the_corpus_at_cp4_with_and_without_documents(tiny_dataset, seq_len):
    """``cp_balance`` as metrics.jsonl records it (trident/loop.py: the attended pairs of every cp rank summed over
    a step's micro-batches, as the loader hands them to cp rank 0) over an epoch of real text (standard-library
    source, the embedded corpus' kind), global batch 8 in micro-batches of 4: at most 1.05 at cp=4 with and without
    document masks. Head-tail alone, not document-aware, goes past it on the same steps."""
    dataset = TokenDataset(tiny_dataset)
    windows, _ = dataset.split(seq_len, 0.01, 8)
    sampler = GlobalBatchSampler(len(windows), 8, 0)
    for eos_id in (None, dataset.eos_id):
        loader = BatchLoader(windows, sampler, 0, 1, 4, torch.device("cpu"), eos_id, prefetch=False, cp_size=4)
        head_tail = []
        for step in range(len(windows) // 8):
            batches = loader.read(step)
            balance = cp_balance(batches)
            assert balance <= 1.05, f"step {step} seq_len {seq_len} documents={eos_id is not None}: {balance}"
            if eos_id is not None:
                whole = [windows.batch(w)[0] for w in sampler.micro_batches(step, 0, 1, 4)]
                pairs = [_pairs(document_ids(x, eos_id)) for x in whole]
                per_rank = [sum(int(split_sequence(p, 4, r).sum()) for p in pairs) for r in range(4)]
                head_tail.append(max(per_rank) * 4 / sum(per_rank))
        assert eos_id is None or max(head_tail) > 1.05


def unsplit_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part, rank 0's first: the inverse of ``split_sequence``."""
    gathered = torch.cat(parts, dim=dim)
    order = head_tail_order(gathered.shape[dim], len(parts), gathered.device)
    return gathered.index_select(dim, order.argsort())
