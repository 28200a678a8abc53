"""Rotary position embeddings (RoPE), in the Hugging Face Llama convention: each head's vector is two halves
``[x1 | x2]`` rotated pairwise, ``x1' = x1 cos - x2 sin``, ``x2' = x2 cos + x1 sin``, with frequency
``theta ** (-2i / head_dim)`` for pair i. Q and K weights therefore map to Hugging Face's ``q_proj`` / ``k_proj``
rows unpermuted.

Positions are absolute within the sequence: a pipeline stage and a sequence-parallel rank see the whole sequence
inside attention (the column-parallel layer gathers it), and generation passes the offset of the new tokens.
"""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, fp32 ``[len(positions), head_dim]``, for the given integer positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., T, head_dim]`` by the tables of its T positions (in x's dtype, as Hugging Face does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
