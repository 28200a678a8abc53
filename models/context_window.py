"""A cp rank's part of the windows, as attention sees it: what ``Documents`` (models/documents.py) is to one
process, under context parallelism (parallel/context/).

It carries the tokens' positions (computed on the whole window before the split: RoPE and the learned table read
them) and their span (global indices, document ids), and attends through the cp group's exchange
(``parallel.cp_comm``), masked causally by global index and inside documents. Training with dropout spells the
attention probabilities out as one process does (models/gpt.py ``causal_attention_probs``), over keys gathered
whatever the exchange, and names the tokens held, whose places in the window are the dropout masks' rows and
columns (parallel/random.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trident.parallel.context.allgather import GatherKV, window_keys
from trident.parallel.context.attention import context_attention
from trident.parallel.context.span import TokenSpan
from trident.parallel.context.split import rank_index


@dataclass
class ContextWindow:
    positions: torch.Tensor  # [B, T / cp] int64: each token's position (in the window, or in its document)
    span: TokenSpan  # this rank's tokens: their global indices and document ids
    group: dist.ProcessGroup
    comm: str
    # What every layer's exchange shares (parallel/context/attention.py): a window lives for one forward.
    shared: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(
        cls,
        positions: torch.Tensor,
        documents: torch.Tensor | None,
        group: dist.ProcessGroup,
        comm: str,
        index: torch.Tensor | None = None,
        keys: TokenSpan | None = None,
    ) -> ContextWindow:
        """From this rank's positions, document ids (None: the window is one sequence) and its tokens' places in
        the window ``[B or 1, T / cp]`` (parallel/context/batch.py; None: the head-tail split's). ``keys``: every
        rank's span of the window on the host (the micro-batch's ``keys``), which the exchanges read their masks'
        forms from and copy to the device; None: gathered over ``group`` at the first layer."""
        if index is None:
            rank, cp = dist.get_rank(group), dist.get_world_size(group)
            index = rank_index(positions.shape[-1] * cp, cp, rank, positions.device)
        return cls(positions, TokenSpan(index, documents), group, comm, {} if keys is None else {"host_keys": keys})

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v over the whole sequence, for this rank's queries; k and v may have fewer
        (grouped) heads than q."""
        return context_attention(q, k, v, self.span, self.group, self.comm, shared=self.shared)

    @property
    def seq_len(self) -> int:
        """The whole window's tokens."""
        return self.positions.shape[-1] * dist.get_world_size(self.group)

    def tokens(self) -> dict[int, tuple[int, torch.Tensor]]:
        """The rows of a ``[T, d]`` dropout mask this rank holds: its tokens' places in the window."""
        return {0: (self.seq_len, self.span.index)}

    def dropped_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, drop: nn.Module) -> torch.Tensor:
        """``drop(softmax(q k^T / sqrt(d))) v`` for this rank's queries over the whole window's keys and values,
        gathered over cp (their gradients reduce-scattered back): the probabilities ``[B, H, T / cp, T]`` are the
        rows of the one-process ``[B, H, T, T]`` at this rank's queries, and the columns at the gathered keys, and
        so is their dropout mask (the logical ``[H, T, T]``'s, parallel/random.py)."""
        keys = window_keys(self.span, self.group, self.shared)
        kv = GatherKV.apply(torch.stack([k, v]), self.group)
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in kv)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        probs = scores.masked_fill(~self.span.mask(keys)[:, None], float("-inf")).softmax(dim=-1)
        t = self.seq_len
        return drop(probs, {1: (t, self.span.index), 2: (t, keys.index)}) @ v
