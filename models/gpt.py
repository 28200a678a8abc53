"""A GPT-2 family language model: pre-LayerNorm blocks, learned positions, GELU MLP, causal attention
through scaled_dot_product_attention, and an LM head tied to the token embedding.

Layers live in a ModuleDict keyed by their global index ("0", "1", ...), so a parameter's name is the
same whichever pipeline stage holds it; checkpoints and the name-seeded initialisation rely on that.

Every parameter carries its ``Placement`` (trident/parallel/placement.py): the logical shape and the dim a
tensor-parallel layer splits. The fused qkv projection is laid out head by head, ``(h three d)``, so a
contiguous block of its output rows holds whole heads with their q, k and v.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from trident.config import ModelConfig
from trident.parallel.placement import Placement, placement_of, replicated, set_placement


def padded_vocab_size(vocab_size: int, multiple: int, tp: int = 1) -> int:
    """Round the vocab up so the embedding splits evenly over tp ranks and matmuls stay aligned."""
    step = multiple * tp
    return math.ceil(vocab_size / step) * step


def _column(linear: nn.Linear) -> None:
    """Y = X W^T with W split by output rows: tp rank r computes output features [r*k, (r+1)*k)."""
    set_placement(linear.weight, Placement(tuple(linear.weight.shape), split_dim=0))
    if linear.bias is not None:
        set_placement(linear.bias, Placement(tuple(linear.bias.shape), split_dim=0))


def _row(linear: nn.Linear) -> None:
    """Y = X W^T with W split by input columns: partial sums are added over tp; the bias is added once."""
    set_placement(linear.weight, Placement(tuple(linear.weight.shape), split_dim=1))
    if linear.bias is not None:
        replicated(linear.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        _column(self.qkv)
        _row(self.proj)

    def core(self, qkv: torch.Tensor) -> torch.Tensor:
        """Attention proper, no weights: the part selective checkpointing recomputes."""
        q, k, v = rearrange(qkv, "b t (h three d) -> three b h t d", three=3, h=self.n_heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return rearrange(y, "b h t d -> b t (h d)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.core(self.qkv(x)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        _column(self.fc)
        _row(self.proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)
        for p in [*self.ln_1.parameters(), *self.ln_2.parameters()]:
            replicated(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab_size] (padding columns already dropped)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, cfg.vocab_multiple)
        self.wte = nn.Embedding(self.padded_vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        # Vocab rows are what a vocab-parallel embedding splits; the padding rows are never real.
        vocab = Placement((cfg.vocab_size, cfg.d_model), split_dim=0, padded=self.padded_vocab)
        set_placement(self.wte.weight, vocab)
        for p in [self.wpe.weight, *self.ln_f.parameters()]:
            replicated(p)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings: what the first pipeline stage does before its blocks."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than model.seq_len={self.cfg.seq_len}")
        return self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and the tied LM head: what the last pipeline stage does after its blocks.

        The padded rows of wte never become logits, so padding cannot change the loss.
        """
        return F.linear(self.ln_f(x), self.wte.weight[: self.cfg.vocab_size])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.layers.values():
            x = block(x)
        return self.head(x)


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies in fp32; the caller divides by the global token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def _is_residual_projection(name: str) -> bool:
    return name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight")


def param_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed, so init does not depend on creation order or on which rank holds it."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The logical (one-process, unpadded) initial value of parameter ``name``."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln_" in name or name.startswith("ln_"):
        return torch.ones(shape)
    std = cfg.init_std
    if _is_residual_projection(name):
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layers) to keep the residual stream's variance flat.
        std = std / math.sqrt(2 * cfg.n_layers)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise every parameter from (seed, its name) alone: each rank's tensor is exactly its slice of the
    one-process tensor, whatever the layout (padding rows are zero and stay unused)."""
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, placement_of(param), cfg, seed))


def initial_value(name: str, placement: Placement, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """This rank's initial tensor of parameter ``name``: its block of the logical one, cut by ``placement``."""
    return placement.shard(init_tensor(name, placement.shape, cfg, seed))


def count_params(cfg: ModelConfig) -> int:
    """Trainable parameters of the unpadded model (tied embedding counted once)."""
    d, f, L = cfg.d_model, cfg.ffn_dim, cfg.n_layers
    b = 1 if cfg.bias else 0
    ln = 2 * d if cfg.bias else d
    block = (3 * d * d + 3 * d * b) + (d * d + d * b) + (d * f + f * b) + (f * d + d * b) + 2 * ln
    return cfg.vocab_size * d + cfg.seq_len * d + L * block + ln


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6N for the matmul weights (the tied LM head included, the embedding
    lookups excluded) plus 12 * L * d * T for attention scores, PaLM's convention (full, not causal)."""
    t = seq_len or cfg.seq_len
    d, f, L = cfg.d_model, cfg.ffn_dim, cfg.n_layers
    matmul_params = L * (3 * d * d + d * d + 2 * d * f) + cfg.vocab_size * d
    return 6.0 * matmul_params + 12.0 * L * d * t
