"""A cp rank's part of a micro-batch: what the data loader hands each rank of a cp group.

Every cp rank reads the same windows (the dp rank's share of the global batch) and keeps its head-tail part
(split.py). What depends on the whole window is computed before the split: the targets are the windows shifted by
one token (the loader's), each token's position (its index in the window, or with ``data.document_mask`` its place
in its document, which may have begun on another rank's chunk) and the attended pairs of every rank (cp_balance).
"""

from __future__ import annotations

from trident.parallel.batch import Batch
from trident.parallel.context.split import pairs_per_rank, positions_in_window, split_sequence


def context_part(batch: Batch, cp: int, rank: int) -> Batch:
    """This cp rank's part of ``batch``: tokens, targets, document ids and positions ``[B, T / cp]``."""
    b, t = batch.tokens.shape
    positions = positions_in_window(t, batch.documents, batch.tokens.device).expand(b, t)
    return batch._replace(
        tokens=split_sequence(batch.tokens, cp, rank),
        targets=split_sequence(batch.targets, cp, rank),
        documents=None if batch.documents is None else split_sequence(batch.documents, cp, rank),
        positions=split_sequence(positions, cp, rank),
        cp_pairs=tuple(pairs_per_rank(t, cp, batch.documents)),
    )
