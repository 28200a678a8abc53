"""Rotary position embeddings (RoPE), in the Hugging Face Llama convention: each head's vector is two halves
``[x1 | x2]`` rotated pairwise, ``x1' = x1 cos - x2 sin``, ``x2' = x2 cos + x1 sin``, with frequency
``theta ** (-2i / head_dim)`` for pair i. Q and K weights therefore map to Hugging Face's ``q_proj`` / ``k_proj``
rows unpermuted. ``model.rope_scaling=llama3`` rescales the frequencies as Llama 3.1 and 3.2 do.

Positions are absolute within the sequence: a pipeline stage and a sequence-parallel rank see the whole sequence
inside attention (the column-parallel layer gathers it), and generation passes the offset of the new tokens.
"""

from __future__ import annotations

import math

import torch

from trident.config.schema import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The inverse frequency of each of the head_dim / 2 pairs, fp32 on the CPU."""
    dh = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
    if cfg.rope_scaling == "llama3":
        inv_freq = _llama3_scaled(inv_freq, cfg)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's rule: long wavelengths (past original / low_freq_factor) slowed by ``factor``, short ones (below
    original / high_freq_factor) kept, and between them a blend linear in original / wavelength."""
    low, high, original = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_seq_len
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, blended, scaled)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, fp32 ``[*positions.shape, head_dim]``, for the given integer positions (``[T]``, or ``[B, T]``
    when each sample has its own: packed documents)."""
    angles = positions.float()[..., None] * inv_freq.float()
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., T, head_dim]`` by the tables of its T positions (in x's dtype, as Hugging Face does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
