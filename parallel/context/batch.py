"""A cp rank's part of a micro-batch: what the data loader hands each rank of a cp group.

Every cp rank reads the same windows (the dp rank's share of the global batch) and keeps its part of each
(split.py ``balanced_order``: head-tail for causal windows, a document-aware deal per window with packed
documents). What depends on the whole window is computed before the split: the targets are the windows shifted by
one token (the loader's), each token's position (its index in the window, or with ``data.document_mask`` its place
in its document, which may have begun on another rank's chunk), the global index of each token a rank holds (the
mask's, span.py) and the attended pairs of every rank (cp_balance).
"""

from __future__ import annotations

from trident.parallel.batch import Batch
from trident.parallel.context.span import TokenSpan
from trident.parallel.context.split import balanced_order, pairs_from_order, positions_in_window, rank_part, take


def context_part(batch: Batch, cp: int, rank: int) -> Batch:
    """This cp rank's part of ``batch``: tokens, targets, document ids and positions ``[B, T / cp]``, and their
    global indices ``[B or 1, T / cp]``; every rank's span on the host (``keys``: each rank's indices and document
    ids one after another, what a gather of the spans over cp would give)."""
    b, t = batch.tokens.shape
    positions = positions_in_window(t, batch.documents, batch.tokens.device).expand(b, t)
    order = balanced_order(t, cp, batch.documents).to(batch.tokens.device)
    index = rank_part(order, cp, rank)
    return batch._replace(
        tokens=take(batch.tokens, index),
        targets=take(batch.targets, index),
        documents=None if batch.documents is None else take(batch.documents, index),
        positions=take(positions, index),
        index=index.contiguous(),
        cp_pairs=tuple(pairs_from_order(positions + 1, order, cp)),
        keys=TokenSpan(order, None if batch.documents is None else take(batch.documents, order)).on_host(),
    )
