"""A decoder-only transformer, GPT-2 or Llama family, the block chosen by configuration (``model.*``):

    model.norm      layernorm (GPT-2) | rmsnorm (Llama)         pre-norm blocks, and a final norm
    model.mlp       gelu (GPT-2)      | swiglu (Llama)          d_ff is the hidden size either way
    model.position  learned (GPT-2)   | rope (Llama)            a position table, or rotary q and k
    model.n_kv_heads                    n_heads (MHA, default), fewer (grouped-query), 1 (multi-query)
    model.bias, model.tie_embeddings    biases in linear layers; the LM head tied to the token embedding
    model.head_dim                      each head's width, when not d_model / n_heads (Qwen3)
    model.qk_norm, model.qk_norm_scope  RMSNorm of queries and keys before RoPE: per head (Qwen3) or over the whole
                                        projection (OLMoE)
    model.moe.*                         mixture-of-experts MLPs on the sparse layers (models/moe.py)

Attention is causal, through scaled_dot_product_attention. The model is one file read top to bottom (norm,
attention, MLP, block, GPT, then its FLOPs and parameter count), as nanoGPT's is, so it stays whole past ~400 lines.

Dropout (``model.dropout``) sits where GPT-2's does: on the embeddings, the attention probabilities and each
residual branch. Its masks are derived from (seed, step, sample, site) by the RNG tracker the model is given
(parallel/random.py), so every layout drops what one process drops. Training with dropout therefore
computes attention explicitly (SDPA's own dropout draws from the global generator); dropout 0 and evaluation
keep SDPA.

Built from tensor-parallel layers (parallel/tensor.py): attention splits its heads over the tp group
(``CausalSelfAttention`` says how the kv heads follow), the MLP is column- then row-parallel, and the token
embedding is vocab-parallel, its weight doubling as the LM head when tied. With no tp group, or a group of one,
every layer is the plain torch one. With sequence parallelism the residual stream, norms and dropout work on
``[batch, seq / tp, d]`` shards.

Layers live in a ModuleDict keyed by their global index ("0", "1", ...), so a parameter's name is the
same whichever pipeline stage holds it, and the same at every tp: checkpoints and the name-seeded
initialisation rely on that. Every parameter carries its ``Placement`` (parallel/placement.py).

A pipeline stage is a GPT built for some of the layers (``layers``), with the embedding if it is the first
stage and the final norm and LM head if it is the last (parallel/pipeline/stages.py). An untied head is
``lm_head``; a tied one is ``wte`` itself, or on a last stage that is not also the first ``lm_head``, a copy of
``wte`` tied to it (``Placement.tied_to``).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from trident.config.schema import ModelConfig
from trident.models.context_window import ContextWindow
from trident.models.documents import Documents
from trident.models.kv_cache import KVCache
from trident.models.moe import MoE, TokenSplit, set_loss_multiplier
from trident.models.rope import apply_rope, rope_frequencies, rope_tables
from trident.parallel.comm import GroupShape, copy_to_region, rank_and_size, reduce_from_region
from trident.parallel.context.span import TokenSpan
from trident.parallel.placement import Placement, add_grad_sum, placement_of, replicated, set_placement
from trident.parallel.random import (
    ATTENTION,
    ATTENTION_RESIDUAL,
    EMBEDDING,
    EMBEDDING_LAYER,
    MLP_RESIDUAL,
    Dropout,
    RNGTracker,
)
from trident.parallel.tensor import (
    ColumnParallelLinear,
    ReplicatedColumnLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_error,
    tp_split_error,
    vocab_parallel_cross_entropy,
)


def padded_vocab_size(vocab_size: int, multiple: int, tp: int = 1) -> int:
    """Round the vocab up so the embedding splits evenly over tp ranks and matmuls stay aligned."""
    step = multiple * tp
    return math.ceil(vocab_size / step) * step


def check_tp_split(cfg: ModelConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Refuse a shape the tp group cannot split, naming the nearest values that would do."""
    sizes = [("model.n_heads", cfg.n_heads), ("model.d_ff", cfg.ffn_dim)]
    if sequence_parallel:
        sizes.append(("model.seq_len", cfg.seq_len))
    for key, value in sizes:
        if error := tp_split_error(key, value, tp):
            raise ValueError(error)
    if error := kv_heads_error(cfg.n_heads, cfg.kv_heads, tp):
        raise ValueError(error)


class CausalSelfAttention(nn.Module):
    """Heads split over tp: query heads column-parallel (whole heads per rank), the output projection row-parallel.

    Multi-head attention (``n_kv_heads`` = ``n_heads``) keeps q, k and v in one fused ``qkv`` whose rows are laid out
    head by head, ``(h three d)``, so a tp block of rows holds whole heads. Grouped-query attention has ``q`` (rows
    ``(h d)``) and ``kv`` (rows ``(g two d)``, each kv head's k then v): split over tp like the query heads when tp
    divides the kv heads, else held whole by every rank, each computing the one kv head its query heads read
    (``ReplicatedColumnLinear``). Query head i reads kv head ``i // (n_heads / n_kv_heads)``, as in Hugging Face.

    With ``position=rope``, q and k are rotated by their absolute positions. The attention probabilities' dropout
    keeps this rank's heads of the logical ``[n_heads, T, T]`` mask."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp_group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        rng: RNGTracker | None,
        layer: int,
    ) -> None:
        super().__init__()
        tp_rank, tp_size = rank_and_size(tp_group)
        heads, kv_heads, dh = cfg.n_heads, cfg.kv_heads, cfg.head_size
        self.layer, self.head_dim = layer, dh
        self.n_heads = heads // tp_size  # this rank's query heads
        self.n_kv_heads = kv_heads // tp_size if kv_heads % tp_size == 0 else 1  # and the kv heads they read
        # RoPE's frequencies, fp32 whatever the parameters' dtype: not a buffer, which a cast of the model would round;
        # moved with the model (``_apply``).
        self.inv_freq = rope_frequencies(cfg) if cfg.position == "rope" else None
        self.dropout = cfg.dropout
        self.drop = Dropout(cfg.dropout, rng, layer, ATTENTION, shard_dim=0, rank=tp_rank, parts=tp_size)
        d, sp = cfg.d_model, sequence_parallel
        if kv_heads == heads:
            self.qkv = ColumnParallelLinear(d, 3 * heads * dh, tp_group, bias=cfg.bias, sequence_parallel=sp)
        else:
            self.q = ColumnParallelLinear(d, heads * dh, tp_group, bias=cfg.bias, sequence_parallel=sp)
            if kv_heads % tp_size == 0:
                self.kv = ColumnParallelLinear(d, 2 * kv_heads * dh, tp_group, bias=cfg.bias, sequence_parallel=sp)
            else:
                self.kv = ReplicatedColumnLinear(d, 2 * kv_heads * dh, kv_heads, tp_group, bias=cfg.bias)
        self.proj = RowParallelLinear(heads * dh, d, tp_group, bias=cfg.bias, sequence_parallel=sp)
        if cfg.qk_norm and cfg.qk_norm_scope == "projection":  # a gain per unit, split over tp with the heads
            if kv_heads % tp_size:
                raise ValueError(
                    f"model.qk_norm_scope=projection needs tp={tp_size} to divide model.n_kv_heads={kv_heads}: a rank "
                    "holding every kv head computes only the one its query heads read"
                )
            self.q_norm = ProjectionRMSNorm(heads, dh, cfg.norm_eps, tp_group)
            self.k_norm = ProjectionRMSNorm(kv_heads, dh, cfg.norm_eps, tp_group)
        elif cfg.qk_norm:  # one gain per head dim, shared by every head: held whole by every tp rank
            self.q_norm, self.k_norm = nn.RMSNorm(dh, eps=cfg.norm_eps), nn.RMSNorm(dh, eps=cfg.norm_eps)
            for p in (self.q_norm.weight, self.k_norm.weight):
                replicated(p)
                if tp_size > 1:  # each rank's backward saw only its own heads: the gradient is a partial sum
                    add_grad_sum(p, "tp")

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202
        """``.to``, ``.cuda``, ...: RoPE's frequencies take the device and keep fp32. (They were copied per device in
        forward, into a dict whose state, empty at the first call and full after, made dynamo recompile the
        compiled block at the second step.)"""
        out = super()._apply(fn, recurse)
        if self.inv_freq is not None:
            self.inv_freq = self.inv_freq.to(fn(self.inv_freq).device)
        return out

    def project(
        self, x: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's q ``[b, h, T, d]`` and k, v ``[b, kv_h, T, d]`` (rotated, with RoPE) of the whole sequence;
        ``start``: the position of its first token, or ``positions`` ``[b, T]`` each token's (packed documents)."""
        if hasattr(self, "qkv"):
            q, k, v = rearrange(self.qkv(x), "b t (h three d) -> three b h t d", three=3, h=self.n_heads)
        else:
            x = self.q.enter(x)
            q = rearrange(self.q.local(x), "b t (h d) -> b h t d", h=self.n_heads)
            k, v = rearrange(self.kv.local(x), "b t (h two d) -> two b h t d", two=2, h=self.n_kv_heads)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.inv_freq is not None:
            inv_freq = self.inv_freq
            if positions is None:
                positions = torch.arange(start, start + q.shape[-2], device=q.device)
            cos, sin = rope_tables(positions, inv_freq)
            if cos.dim() == 3:  # per sample: [b, T, d] -> [b, 1, T, d], the same for every head
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        """Attention proper, no weights: the part selective checkpointing recomputes. ``documents``: a packed
        window's, whose mask keeps attention inside each document."""
        if self.training and self.dropout > 0 and isinstance(documents, ContextWindow):
            y = documents.dropped_attention(q, k, v, self.drop)
        elif self.training and self.dropout > 0:
            group = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
            y = self.drop(causal_attention_probs(q, k, None if documents is None else documents.mask)) @ v
        elif documents is not None:
            y = documents.attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return rearrange(y, "b h t d -> b t (h d)")

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, documents: Documents | None = None
    ) -> torch.Tensor:
        if cache is None:
            positions = None if documents is None else documents.positions
            return self.proj(self.core(*self.project(x, 0, positions), documents))
        if documents is not None:
            raise ValueError("generation with a KV cache runs one document: no document ids")
        q, k, v = self.project(x, cache.length)
        k, v = cache.append(self.layer, k, v)
        t, held = q.shape[-2], k.shape[-2]
        # The new tokens see everything held before them and each other causally (bottom-right aligned).
        mask = torch.ones(t, held, dtype=torch.bool, device=q.device).tril(held - t)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection, every head of it at once (OLMoE's and OLMo 2's q and k norms): ``x``
    ``[b, heads, T, head_dim]`` normalised over its heads and head dims together, a gain per unit.

    Under tp each rank holds some of the heads: the sum of squares is all-reduced over the group, forward and
    backward (every rank's normalised heads depend on every rank's units), and the gain is split with the heads
    (rank r holds units ``[r*k, (r+1)*k)``, k = heads / tp x head_dim)."""

    def __init__(self, heads: int, head_dim: int, eps: float, tp_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        tp_rank, tp_size = rank_and_size(tp_group)
        self.width, self.eps, self.head_dim = heads * head_dim, eps, head_dim
        self.tp_group = tp_group if tp_size > 1 else None
        placement = Placement((self.width,), split_dim=0, tp_rank=tp_rank, tp_size=tp_size)
        self.weight = set_placement(nn.Parameter(torch.ones(placement.local_shape)), placement)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.square().sum(dim=(1, 3), keepdim=True)
        if self.tp_group is not None:
            squares = reduce_from_region(copy_to_region(squares, self.tp_group), self.tp_group)
        y = (xf * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)
        return y * self.weight.view(-1, 1, self.head_dim)


def causal_attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) under the causal mask (or ``mask``, a dense one keeping documents apart),
    [b, h, T, T]: what SDPA computes inside, spelled out so that dropout can act on it."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


class MLP(nn.Module):
    """GELU (GPT-2: fc, tanh-approximated GELU, proj) or SwiGLU (Llama: ``silu(gate(x)) * up(x)``, proj). SwiGLU's
    gate and up are two column-parallel layers that enter the tp region once (one all-gather under sequence
    parallelism): tp rank r holds the same hidden units of both."""

    def __init__(self, cfg: ModelConfig, tp_group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
        super().__init__()
        d, f, sp = cfg.d_model, cfg.ffn_dim, sequence_parallel
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.gate = ColumnParallelLinear(d, f, tp_group, bias=cfg.bias, sequence_parallel=sp)
            self.up = ColumnParallelLinear(d, f, tp_group, bias=cfg.bias, sequence_parallel=sp)
        else:
            self.fc = ColumnParallelLinear(d, f, tp_group, bias=cfg.bias, sequence_parallel=sp)
        self.proj = RowParallelLinear(f, d, tp_group, bias=cfg.bias, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            x = self.gate.enter(x)
            return self.proj(F.silu(self.gate.local(x)) * self.up.local(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def make_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm (with a bias when ``model.bias``) or RMSNorm, every tp rank holding it whole."""
    if cfg.norm == "rmsnorm":
        norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    else:
        norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
    for p in norm.parameters():
        replicated(p)
    return norm


def _dropped(drop: nn.Module, x: torch.Tensor, documents: Documents | ContextWindow | None) -> torch.Tensor:
    """``drop(x)``, naming under context parallelism the tokens this rank holds (its mask's rows)."""
    if isinstance(drop, Dropout) and isinstance(documents, ContextWindow):
        return drop(x, documents.tokens())
    return drop(x)


def _residual_dropout(
    cfg: ModelConfig, tp_group: dist.ProcessGroup | None, sequence_parallel: bool, rng: RNGTracker | None, site: tuple
) -> nn.Module:
    """Dropout on the residual stream (logical ``[T, d]`` a sample): replicated over tp, every tp rank drawing the
    whole mask, or under sequence parallelism this rank's sequence shard of it. None of it at dropout 0."""
    if cfg.dropout == 0:
        return nn.Identity()
    if not sequence_parallel:
        return Dropout(cfg.dropout, rng, *site)
    tp_rank, tp_size = rank_and_size(tp_group)
    return Dropout(cfg.dropout, rng, *site, shard_dim=0, rank=tp_rank, parts=tp_size)


class Block(nn.Module):
    """Layer ``layer`` (its global index: the dropout sites are the layer's wherever it is held)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp_group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        rng: RNGTracker | None,
        layer: int,
        ep_group: dist.ProcessGroup | GroupShape | None = None,
        split: TokenSplit | None = None,
    ) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, tp_group, sequence_parallel, rng, layer)
        self.ln_2 = make_norm(cfg)
        if cfg.moe.is_sparse(layer):
            shared = cfg.moe.shared_experts * cfg.expert_dim
            dense = MLP(dataclasses.replace(cfg, d_ff=shared), tp_group, sequence_parallel) if shared else None
            self.mlp: nn.Module = MoE(cfg, dense, ep_group, split)
        else:
            self.mlp = MLP(cfg, tp_group, sequence_parallel)
        self.drop_attn = _residual_dropout(cfg, tp_group, sequence_parallel, rng, (layer, ATTENTION_RESIDUAL))
        self.drop_mlp = _residual_dropout(cfg, tp_group, sequence_parallel, rng, (layer, MLP_RESIDUAL))

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, documents: Documents | None = None
    ) -> torch.Tensor:
        x = x + _dropped(self.drop_attn, self.attn(self.ln_1(x), cache, documents), documents)
        h = self.ln_2(x)
        if isinstance(self.mlp, MoE):  # a capacity needs the batch's split (cp), or the pairs a cache has routed
            window = documents.span.index if isinstance(documents, ContextWindow) else None
            return x + _dropped(self.drop_mlp, self.mlp(h, window=window, cache=cache), documents)
        return x + _dropped(self.drop_mlp, self.mlp(h), documents)


class GPT(nn.Module):
    """Token ids [B, T] -> logits. At tp=1 they are [B, T, vocab_size] (padding columns dropped); at tp>1 each
    rank returns its block of the padded vocab, [B, T, padded_vocab / tp], and ``loss_sum`` computes the loss
    from the blocks without ever gathering the vocabulary. Given ``targets``, the summed loss instead (``head``).

    ``tp_group``: the tensor-parallel group (None: one process). ``sequence_parallel``: split the activations
    outside the tp regions along the sequence. ``rng``: the RNG tracker dropout derives its masks from, which
    training needs at ``model.dropout`` > 0 (evaluation and dropout 0 do not); a runner sets its micro-batch.

    A pipeline stage: ``layers`` (global indices; default all), ``first`` (holds the embedding and takes token
    ids) and ``last`` (holds the final norm and LM head and returns logits); a stage that is not last returns
    its residual stream [B, T, d] (under sequence parallelism [B, T / tp, d]).

    ``ep_group``: the expert-parallel group; each rank holds experts / ep of every sparse layer's experts and
    exchanges tokens with the others by all-to-all (models/moe.py). None: every expert here. Under sequence or
    context parallelism each rank routes its own tokens, the balancing statistics summed over the split.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        rng: RNGTracker | None = None,
        layers: Sequence[int] | None = None,
        first: bool = True,
        last: bool = True,
        cp_group: dist.ProcessGroup | None = None,
        cp_comm: str = "ring",
        ep_group: dist.ProcessGroup | GroupShape | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = rank_and_size(tp_group)
        # Context parallelism: this rank holds part of each sequence, attention exchanges K/V over the cp group.
        self.cp_group = cp_group if rank_and_size(cp_group)[1] > 1 else None
        self.cp_comm = cp_comm
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        check_tp_split(cfg, self.tp_size, self.sequence_parallel)
        self.cfg, self.tp_group, self.rng = cfg, tp_group, rng
        sp = self.sequence_parallel
        self.is_first, self.is_last = first, last
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, cfg.vocab_multiple, self.tp_size)
        layers = range(cfg.n_layers) if layers is None else layers
        if first:
            self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group, self.padded_vocab, sp)
            if cfg.position == "learned":
                self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
                replicated(self.wpe.weight)
            self.drop = _residual_dropout(cfg, tp_group, sp, rng, (EMBEDDING_LAYER, EMBEDDING))
        # The ranks each sequence is split over (cp, and tp under sequence parallelism): the experts' statistics.
        split = TokenSplit(self.cp_group, tp_group if sp else None)
        self.layers = nn.ModuleDict({str(i): Block(cfg, tp_group, sp, rng, i, ep_group, split) for i in layers})
        if last:
            self.ln_f = make_norm(cfg)
            if not (first and cfg.tie_embeddings):
                # The LM head of its own (untied), or the tied one on a stage without the embedding: a copy,
                # initialised and updated like wte.
                self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group, self.padded_vocab, sp)
                if cfg.tie_embeddings:
                    w = self.lm_head.weight
                    set_placement(w, dataclasses.replace(placement_of(w), tied_to="wte.weight"))
        # The sums each gradient needs beyond dp, as placement data (parallel/grad_sums.py reads them).
        if first != last and cfg.tie_embeddings:  # the tied copies on different stages: each takes their sum
            add_grad_sum(self.wte.weight if first else self.lm_head.weight, "embedding")
        if sp:  # held whole by every tp rank, whose backward saw only its own tokens
            for param in self.parameters():
                if placement_of(param).split_dim is None:
                    add_grad_sum(param, "tp")

    def embed(
        self,
        idx: torch.Tensor,
        start: int = 0,
        positions: torch.Tensor | None = None,
        window: ContextWindow | None = None,
    ) -> torch.Tensor:
        """Token (+ learned position) embeddings: what the first pipeline stage does before its blocks; ``start``:
        the position of the first token (generation), or ``positions`` ``[B, T]`` each token's (packed documents);
        ``window``: under context parallelism, the tokens this rank holds (the dropout mask's rows).
        Under sequence parallelism, this rank's shard of the sequence: tokens [r*t/tp, (r+1)*t/tp). With RoPE,
        positions enter in attention instead."""
        t = idx.shape[1]
        if start + t > self.cfg.seq_len:
            raise ValueError(f"sequence of {start + t} tokens is longer than model.seq_len={self.cfg.seq_len}")
        x = self.wte(idx)
        if not hasattr(self, "wpe"):
            return _dropped(self.drop, x, window)
        if not self.sequence_parallel:
            if positions is None:
                positions = torch.arange(start, start + t, device=idx.device)
            return _dropped(self.drop, x + self.wpe(positions), window)
        if t % self.tp_size:
            raise ValueError(f"sequence of {t} tokens does not split over tp={self.tp_size} (sequence parallelism)")
        lo, hi = self.tp_rank * (t // self.tp_size), (self.tp_rank + 1) * (t // self.tp_size)
        # Only this shard's positions (the embedding keeps its indices for backward: not a view of all of them).
        shard = torch.arange(lo, hi, device=idx.device) if positions is None else positions[..., lo:hi].contiguous()
        return _dropped(self.drop, x + self.wpe(shard), window)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and the LM head (the embedding, or lm_head): what the last pipeline stage does after its
        blocks. Padding rows never become real logits: dropped at tp=1, left out by the loss at tp>1. Given
        ``targets``, the summed loss instead, the head fused with the loss ``model.loss_chunk_tokens`` tokens at a
        time (``VocabParallelEmbedding.loss_sum``; 0: the whole logits, then ``loss_sum``)."""
        lm, chunk = self.lm_head if hasattr(self, "lm_head") else self.wte, self.cfg.loss_chunk_tokens
        if targets is None or not chunk:
            logits = lm.logits(self.ln_f(x))
            return logits if targets is None else self.loss_sum(logits, targets)
        return lm.loss_sum(self.ln_f(x), targets, chunk)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
        keys: TokenSpan | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids on the first stage, else the residual stream from the stage before. ``targets`` (the
        runners give them): on the last stage return the summed token loss rather than the logits (``head``).
        ``cache`` (generation, one process): the keys and values of the tokens before ``x``, which this call
        extends. ``documents`` ``[B, T]``: the document ids of packed windows (parallel/batch.py ``document_ids``),
        which keep attention inside each document and restart positions at each; every stage takes the micro-batch's.
        Under context parallelism, ``x`` and ``documents`` are this cp rank's part of the windows and
        ``positions`` ``[B, T / cp]`` its tokens' positions and ``index`` ``[B or 1, T / cp]`` their places in the
        window (parallel/context/batch.py), ``keys`` every cp rank's span on the host (None: gathered)."""
        docs = None
        if self.cp_group is not None:
            if positions is None:
                raise ValueError("under context parallelism a micro-batch carries its tokens' positions")
            docs = ContextWindow.of(positions, documents, self.cp_group, self.cp_comm, index, keys)
        elif documents is not None:  # a dense mask when dropout needs the probabilities spelled out
            docs = Documents.of(documents, "dense" if self.training and self.cfg.dropout > 0 else "auto")
        if self.is_first:
            start, positions = cache.length if cache is not None else 0, None if docs is None else docs.positions
            x = self.embed(x, start, positions, docs if isinstance(docs, ContextWindow) else None)
        for block in self.layers.values():
            x = block(x, cache, docs)
        if cache is not None:
            cache.advance(x.shape[1])
        return self.head(x, targets) if self.is_last else x

    def set_loss_multiplier(self, multiplier: float) -> None:
        """The gradient each token's loss gets, which the runner scales the token loss by and gives the auxiliary
        losses of this chunk's sparse layers (models/moe.py)."""
        set_loss_multiplier(self, multiplier)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy in fp32 of this model's logits (the trainer's loss function). A forward given
        the targets returned the loss itself (a scalar), which this passes on."""
        if logits.dim() == 0:
            return logits
        if self.tp_size == 1:
            return lm_loss_sum(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, self.tp_group, self.cfg.vocab_size)


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies in fp32; the caller divides by the global token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def _is_residual_projection(name: str) -> bool:  # the output projections of attention and the MLP (or experts)
    return name.endswith(("attn.proj.weight", "mlp.proj.weight", "shared.proj.weight", "experts.down"))


def param_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed, so init does not depend on creation order or on which rank holds it."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The logical (one-process, unpadded) initial value of parameter ``name``."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln_" in name or name.startswith("ln_") or name.endswith("_norm.weight"):  # LayerNorm and RMSNorm gains
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
    one-process tensor, whatever the layout (padding rows are zero and stay unused). A tied copy is initialised
    from the name of the parameter it copies, so both start identical."""
    for name, param in model.named_parameters():
        placement = placement_of(param)
        param.copy_(initial_value(placement.tied_to or name, placement, cfg, seed))


def initial_value(name: str, placement: Placement, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """This rank's initial tensor of parameter ``name``: its block of the logical one, cut by ``placement``."""
    return placement.shard(init_tensor(name, placement.shape, cfg, seed))


def _block_matmul_params(cfg: ModelConfig, layer: int = 0, active: bool = True) -> int:
    """Weights of block ``layer``'s matmuls: q, k, v and the output projection, and the MLP (SwiGLU has three). A
    sparse layer's MLP: the router, the shared experts and the top-k routed experts a token meets (``active``), or
    all of them."""
    d, f, dh = cfg.d_model, cfg.ffn_dim, cfg.head_size
    attention = d * cfg.n_heads * dh + 2 * d * cfg.kv_heads * dh + cfg.n_heads * dh * d
    mats = 3 if cfg.mlp == "swiglu" else 2
    moe = cfg.moe
    if not moe.is_sparse(layer):
        return attention + mats * d * f
    experts = (moe.top_k if active else moe.experts) + moe.shared_experts
    return attention + mats * d * cfg.expert_dim * experts + moe.experts * d


def count_params(cfg: ModelConfig) -> int:
    """Trainable parameters of the unpadded model (a tied embedding counted once; every expert)."""
    d, f, L = cfg.d_model, cfg.ffn_dim, cfg.n_layers
    norm = 2 * d if cfg.bias and cfg.norm == "layernorm" else d
    shared = cfg.moe.shared_experts * cfg.expert_dim
    total = 0
    for layer in range(L):
        width = (shared if cfg.moe.is_sparse(layer) else f) if cfg.bias else 0  # the dense MLP's (biases)
        mlp_bias = (2 * width if cfg.mlp == "swiglu" else width) + d if width else 0
        attn_bias = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_size + d
        biases = attn_bias + mlp_bias if cfg.bias else 0
        qk_widths = (cfg.n_heads, cfg.kv_heads) if cfg.qk_norm_scope == "projection" else (1, 1)
        qk = sum(qk_widths) * cfg.head_size if cfg.qk_norm else 0
        total += _block_matmul_params(cfg, layer, active=False) + biases + 2 * norm + qk
    embeddings = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    positions = cfg.seq_len * d if cfg.position == "learned" else 0
    return embeddings + positions + total + norm


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6N for the matmul weights a token meets (grouped-query k and v at their own width,
    SwiGLU's three matrices, a sparse layer's router, shared and top-k experts only, the LM head included, the
    embedding lookups excluded) plus 12 * L * d * T for attention scores and their product with v (every query
    head's, PaLM's convention: full, not causal)."""
    t = seq_len or cfg.seq_len
    blocks = sum(_block_matmul_params(cfg, layer) for layer in range(cfg.n_layers))
    matmul_params = blocks + cfg.vocab_size * cfg.d_model
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.d_model * t
