"""The head-tail split of a sequence over cp ranks, its inverse, and the causal balance it gives.

The sequence is cut into 2 cp equal chunks and rank r holds chunks r and 2cp-1-r, one from the head and one from
the tail. Under a causal mask a query attends to as many keys as its index, so a rank with a late chunk alone
would do most of the work; head-tail gives every rank the same number of attended (query, key) pairs. With cp=2
and 8 tokens::

    chunks   [0 1] [2 3] [4 5] [6 7]
    rank 0:  [0 1]             [6 7]      pairs 1+2 + 7+8 = 18
    rank 1:        [2 3] [4 5]            pairs 3+4 + 5+6 = 18

Positions (RoPE, learned), labels and document ids are computed on the whole sequence first and split the same
way, so every token keeps what one process gives it. With packed documents a query attends only inside its
document, so the pairs per rank follow the document lengths; ``balance`` measures what a batch really gives.
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


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (the sequence dim; ``[B, T, ...]`` by default)."""
    return x.index_select(dim, rank_index(x.shape[dim], cp, rank, x.device))


def unsplit_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part, rank 0's first: the inverse of ``split_sequence``."""
    gathered = torch.cat(parts, dim=dim)
    order = head_tail_order(gathered.shape[dim], len(parts), gathered.device)
    return gathered.index_select(dim, order.argsort())


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


def pairs_per_rank(seq_len: int, cp: int, documents: torch.Tensor | None = None) -> list[int]:
    """Attended (query, key) pairs each rank computes under the head-tail split, summed over the batch."""
    pairs = attended_pairs(seq_len, documents)
    return [int(split_sequence(pairs, cp, r).sum()) for r in range(cp)]


def balance(seq_len: int, cp: int, documents: torch.Tensor | None = None) -> float:
    """``cp_balance``: the most attended pairs any rank computes over their mean (1.0 is perfect)."""
    pairs = pairs_per_rank(seq_len, cp, documents)
    return max(pairs) * len(pairs) / sum(pairs)
