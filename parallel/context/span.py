"""Which tokens of the whole sequence a block holds, and the attention mask between two blocks.

A block of a rank's sequence is no longer contiguous once the sequence is split head-tail (split.py), so the mask
is not a triangle of local indices: it is read from each token's global ``index`` (its place in the sequence) and,
with packed documents (``data.document_mask``), its document id. Query i sees key j iff ``index[j] <= index[i]``
and both lie in the same document. The index is one for every sample (``[T]``: the head-tail split of causal
windows) or each sample's own (``[B, T]``: the document-aware split, split.py ``balanced_order``).

A span holds torch tensors (on the device its masks are used on) or, on the host, numpy arrays (``on_host``): the
form core.py's ``plain_form`` reads a mask in, with no device sync, and on fake tensors too (the memory trace).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenSpan:
    index: torch.Tensor  # int64, each token's place in the whole sequence: [T] (every sample's) or [B, T]
    documents: torch.Tensor | None = None  # [B, T]: each token's document id, or None (one causal sequence)

    def __len__(self) -> int:
        return self.index.shape[-1]

    def part(self, part: slice) -> TokenSpan:
        """The tokens ``part`` of this span's."""
        return TokenSpan(self.index[..., part], None if self.documents is None else self.documents[:, part])

    def mask(self, keys: TokenSpan) -> torch.Tensor:
        """Which of ``keys`` each query of this span sees: bool ``[B or 1, T_q, T_k]``."""
        queries, seen_keys = self.index.reshape(-1, len(self)), keys.index.reshape(-1, len(keys))
        seen = seen_keys[:, None, :] <= queries[:, :, None]
        if self.documents is not None:
            assert keys.documents is not None, "queries with document ids need keys with document ids"
            seen = seen & (self.documents[:, :, None] == keys.documents[:, None, :])
        return seen

    def on_host(self) -> TokenSpan:
        """This span as numpy arrays in host memory."""
        return TokenSpan(*(None if t is None else t.detach().cpu().numpy() for t in (self.index, self.documents)))

    def to(self, device: torch.device) -> TokenSpan:
        """This span as torch tensors on ``device`` (from host numpy arrays or tensors elsewhere)."""
        return TokenSpan(*(None if t is None else torch.as_tensor(t).to(device) for t in (self.index, self.documents)))

    @classmethod
    def cat(cls, spans: list[TokenSpan]) -> TokenSpan:
        """The spans one after another (the order of a gathered sequence)."""
        index = torch.cat([s.index for s in spans], dim=-1)
        documents = None if spans[0].documents is None else torch.cat([s.documents for s in spans], dim=1)
        return cls(index, documents)

    @classmethod
    def whole(
        cls, seq_len: int, documents: torch.Tensor | None = None, device: torch.device | None = None
    ) -> TokenSpan:
        """The whole sequence in order."""
        device = documents.device if documents is not None else device
        return cls(torch.arange(seq_len, device=device), documents)
