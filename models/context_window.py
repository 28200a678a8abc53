"""A cp rank's part of the windows, as attention sees it: what ``Documents`` (models/documents.py) is to one
process, under context parallelism (parallel/context/).

It carries the tokens' positions (computed on the whole window before the split: RoPE and the learned table read
them) and their span (global indices, document ids), and attends through the cp group's exchange
(``parallel.cp_comm``), masked causally by global index and inside documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trident.parallel.context.attention import context_attention
from trident.parallel.context.span import TokenSpan
from trident.parallel.context.split import rank_index


@dataclass
class ContextWindow:
    positions: torch.Tensor  # [B, T / cp] int64: each token's position (in the window, or in its document)
    span: TokenSpan  # this rank's tokens: their global indices and document ids
    group: dist.ProcessGroup
    comm: str

    @classmethod
    def of(
        cls,
        positions: torch.Tensor,
        documents: torch.Tensor | None,
        group: dist.ProcessGroup,
        comm: str,
        index: torch.Tensor | None = None,
    ) -> ContextWindow:
        """From this rank's positions, document ids (None: the window is one sequence) and its tokens' places in
        the window ``[B or 1, T / cp]`` (parallel/context/batch.py; None: the head-tail split's)."""
        if index is None:
            rank, cp = dist.get_rank(group), dist.get_world_size(group)
            index = rank_index(positions.shape[-1] * cp, cp, rank, positions.device)
        return cls(positions, TokenSpan(index, documents), group, comm)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v over the whole sequence, for this rank's queries; k and v may have fewer
        (grouped) heads than q."""
        return context_attention(q, k, v, self.span, self.group, self.comm)
