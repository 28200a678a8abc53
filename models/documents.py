"""Packed documents (``data.document_mask``): attention stays inside each document of a window, and positions
restart at each.

A window of the token store holds documents back to back, each followed by eos; ``document_ids``
(parallel/batch.py) numbers them, the eos that ends one opening the next. From those ids:

- ``positions`` ``[B, T]``: each token's position within its document (the learned position table and RoPE read
  these instead of 0..T-1);
- the attention mask: query i sees key j iff j <= i and both are in the same document. On a GPU it is a
  ``BlockMask`` for flex attention, which skips the blocks no query of a block sees and never builds a
  sequence x sequence tensor; on a CPU a dense boolean ``[B, 1, T, T]`` for SDPA (shared by the heads).

A window's loss is then exactly the sum of its documents' losses, each computed alone from its leading eos.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

_compiled_flex = None


@dataclass
class Documents:
    positions: torch.Tensor  # [B, T] int64: position within the document
    mask: torch.Tensor | BlockMask  # dense [B, 1, T, T] bool, or flex attention's block mask

    @classmethod
    def of(cls, documents: torch.Tensor, kernel: str = "auto") -> Documents:
        """From document ids ``[B, T]``. ``kernel``: ``flex`` (a BlockMask), ``dense`` (a boolean mask for SDPA) or
        ``auto`` (flex on CUDA, dense elsewhere)."""
        b, t = documents.shape
        index = torch.arange(t, device=documents.device)
        opens = torch.ones_like(documents, dtype=torch.bool)
        opens[:, 1:] = documents[:, 1:] != documents[:, :-1]
        starts = torch.where(opens, index, torch.zeros_like(index)).cummax(dim=1).values
        positions = index - starts
        if kernel == "auto":
            kernel = "flex" if documents.is_cuda else "dense"
        if kernel == "flex":

            def same_document(batch, head, q, kv):
                return (documents[batch, q] == documents[batch, kv]) & (q >= kv)

            mask = create_block_mask(same_document, b, None, t, t, device=documents.device)
        elif kernel == "dense":
            causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
            mask = (documents[:, None, :, None] == documents[:, None, None, :]) & causal
        else:
            raise ValueError(f"unknown attention kernel {kernel!r}")
        return cls(positions, mask)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v inside each document; k and v may have fewer (grouped) heads than q."""
        gqa = k.shape[1] != q.shape[1]
        if isinstance(self.mask, BlockMask):
            return _flex()(q, k, v, block_mask=self.mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)


def _flex():
    """flex attention compiled once (eager flex attention materialises the scores); on a CPU, the eager one."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention
    return _compiled_flex
