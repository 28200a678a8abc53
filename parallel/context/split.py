"""How a window is split over cp ranks: each rank's tokens, in its local order, and the causal balance it gives.

Causal windows are split head-tail: the sequence is cut into 2 cp equal chunks and rank r holds chunks r and
2cp-1-r, one from the head and one from the tail. Under a causal mask a query attends to as many keys as its index,
so a rank with a late chunk alone would do most of the work; head-tail gives every rank the same number of attended
(query, key) pairs. With cp=2 and 8 tokens::

    chunks   [0 1] [2 3] [4 5] [6 7]
    rank 0:  [0 1]             [6 7]      pairs 1+2 + 7+8 = 18
    rank 1:        [2 3] [4 5]            pairs 3+4 + 5+6 = 18

With packed documents (``data.document_mask``) a query attends only inside its document, so the pairs a chunk
holds follow the document lengths and head-tail may be far from even. Each window (sample) then gets its own split
(``balanced_order``): its chunks are sorted by the pairs they hold and dealt out in a snake, ranks 0..cp-1 then
cp-1..0, each rank taking its chunks in window order. For a causal window that is head-tail itself; any deal leaves
the ranks at most one chunk's pairs apart, so when that is more than ``TOLERANCE`` of the mean the chunks are
halved and dealt again, down to single tokens if need be: no rule on document lengths, no padding. (torch's
per-document head-tail needs every document length divisible by 2 cp, Megatron's THD pads each to it; torch's
round-robin balancer for block masks deals sorted blocks the same way, at a fixed block size.)

Positions (RoPE, learned), labels and document ids are computed on the whole window first and taken by the same
indices, so every token keeps what one process gives it; attention reads each token's global index and document
id (span.py), whatever the order a rank holds them in.
"""

from __future__ import annotations

import torch


def split_error(seq_len: int, cp: int) -> str | None:
    """Why ``seq_len`` cannot be split head-tail over ``cp`` ranks, naming a length that can; None if it can."""
    step = 2 * cp
    if seq_len % step == 0:
        return None
    fit = max(step, seq_len // step * step)
    return f"model.seq_len={seq_len} does not split into 2 x parallel.cp={cp} equal chunks; set model.seq_len={fit}"


def rank_index(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global indices rank ``rank`` holds, in its local order: chunk r, then chunk 2cp-1-r."""
    if error := split_error(seq_len, cp):
        raise ValueError(error)
    n = seq_len // (2 * cp)
    head = torch.arange(rank * n, (rank + 1) * n, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * n, (2 * cp - rank) * n, device=device)
    return torch.cat([head, tail])


def head_tail_order(seq_len: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Every rank's indices one after another, rank 0 first: the order of a sequence gathered over cp."""
    return torch.cat([rank_index(seq_len, cp, r, device) for r in range(cp)])


def positions_in_window(
    seq_len: int, documents: torch.Tensor | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Each token's position, ``[B or 1, T]``: its index in the window, or with document ids ``[B, T]`` its place in
    its document (models/documents.py's, computed here on the whole window before it is split)."""
    index = torch.arange(seq_len, device=device if documents is None else documents.device)
    if documents is None:
        return index.unsqueeze(0)
    opens = torch.ones_like(documents, dtype=torch.bool)
    opens[:, 1:] = documents[:, 1:] != documents[:, :-1]
    starts = torch.where(opens, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - starts


def attended_pairs(seq_len: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """How many keys each query attends to, ``[B or 1, T]``: its position (in the window or its document) + 1."""
    return positions_in_window(seq_len, documents) + 1


TOLERANCE = 1.01  # the most attended pairs a rank may hold over their mean before the chunks are halved


def _deal(pairs: torch.Tensor, cp: int, chunks: int) -> torch.Tensor:
    """Each window's token indices ``[B, T]``, rank 0's then rank 1's ..., each rank's in window order: the
    ``chunks`` equal chunks of each window sorted by the pairs they hold (``pairs`` ``[B, T]``, most first) and
    dealt to the ranks in a snake, 0..cp-1 then cp-1..0 (every rank gets chunks / cp of them)."""
    b, t = pairs.shape
    size = t // chunks
    work = pairs.view(b, chunks, size).sum(dim=-1)
    heaviest = work.argsort(dim=1, descending=True, stable=True)  # [B, chunks]: chunk ids, most pairs first
    slot = torch.arange(chunks, device=pairs.device)
    turn, seat = slot // cp, slot % cp
    dealt = torch.where(turn % 2 == 0, seat, cp - 1 - seat)  # the rank the j-th heaviest chunk goes to
    owner = torch.empty_like(heaviest).scatter_(1, heaviest, dealt.expand(b, chunks))
    chunk_order = (owner * chunks + slot).argsort(dim=1)  # rank 0's chunks in window order, then rank 1's ...
    return (chunk_order[:, :, None] * size + torch.arange(size, device=pairs.device)).view(b, t)


def _rank_sums(pairs: torch.Tensor, order: torch.Tensor, cp: int) -> torch.Tensor:
    """Attended pairs of each rank ``[B, cp]`` under ``order``."""
    return pairs.gather(1, order).view(order.shape[0], cp, -1).sum(dim=-1)


def balanced_order(seq_len: int, cp: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """The split of each window: ``[B or 1, T]`` global token indices, rank r's ``T / cp`` in its local order at
    ``[:, r T/cp : (r+1) T/cp]``. Causal windows (no ``documents``): head-tail, the same for every window. With
    document ids ``[B, T]``: per window, the coarsest snake deal of 2 cp x 2^k chunks whose most loaded rank is
    within ``TOLERANCE`` of the mean (single tokens at the finest)."""
    if error := split_error(seq_len, cp):
        raise ValueError(error)
    if documents is None:
        return head_tail_order(seq_len, cp).unsqueeze(0)
    pairs = attended_pairs(seq_len, documents)
    chunks = 2 * cp
    order = _deal(pairs, cp, chunks)
    done = _within(_rank_sums(pairs, order, cp))
    while not bool(done.all()) and seq_len % (2 * chunks) == 0:
        chunks *= 2
        finer = _deal(pairs, cp, chunks)
        order = torch.where(done[:, None], order, finer)
        done = done | _within(_rank_sums(pairs, finer, cp))
    return order


def _within(sums: torch.Tensor) -> torch.Tensor:
    """Which windows' rank sums ``[B, cp]`` are balanced to ``TOLERANCE``."""
    return sums.max(dim=1).values * sums.shape[1] <= TOLERANCE * sums.sum(dim=1)


def rank_part(order: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s global indices ``[B or 1, T / cp]`` of a ``balanced_order``."""
    n = order.shape[1] // cp
    return order[:, rank * n : (rank + 1) * n]


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, T]`` at the per-window token indices ``index`` ``[B or 1, T']``: ``[B, T']``."""
    return x.gather(1, index.expand(x.shape[0], -1))


def pairs_from_order(pairs: torch.Tensor, order: torch.Tensor, cp: int) -> list[int]:
    """Attended pairs each rank computes under ``order``, summed over the batch (``pairs``: ``attended_pairs``)."""
    n = max(pairs.shape[0], order.shape[0])
    return [int(s) for s in _rank_sums(pairs.expand(n, -1), order.expand(n, -1), cp).sum(dim=0)]
