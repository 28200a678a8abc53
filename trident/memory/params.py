"""The parameters a rank holds, for a model shape and a parallel layout.

Counted from the model's structure, parameter by parameter (``rank_params``): the padded vocabulary's share of the
embedding, the tp split of every matrix and column-parallel bias, the replicated norms and row-parallel biases,
grouped-query attention's kv weight split over tp or, with fewer kv heads than tp ranks, held whole by every rank,
SwiGLU's gate and up beside each other, a position table only with learned positions, the layers of each pipeline
stage, the LM head on the last stage: an untied head of its own, or with pp > 1 the tied copy of the embedding.
"""

from __future__ import annotations

from trident.config import ModelConfig
from trident.layout import Layout
from trident.models.gpt import padded_vocab_size


def _norm(prefix: str, m: ModelConfig) -> list[tuple[str, int]]:
    """LayerNorm: a gain, and a bias when the model has biases; RMSNorm: a gain only."""
    bias = m.bias and m.norm == "layernorm"
    return [(f"{prefix}.weight", m.d_model)] + ([(f"{prefix}.bias", m.d_model)] if bias else [])


def _linear(prefix: str, out_local: int, in_local: int, bias_local: int, m: ModelConfig) -> list[tuple[str, int]]:
    return [(f"{prefix}.weight", out_local * in_local)] + ([(f"{prefix}.bias", bias_local)] if m.bias else [])


def kv_heads_local(m: ModelConfig, tp: int) -> int:
    """Key/value heads a tp rank computes: its 1/tp of them when tp divides them, else the one its query heads read."""
    return m.kv_heads // tp if m.kv_heads % tp == 0 else 1


def block_params(m: ModelConfig, tp: int, prefix: str = "") -> list[tuple[str, int]]:
    """(name, local numel) of one transformer block at tp, in registration order (models/gpt.py): the norms whole;
    multi-head attention's fused qkv, or grouped-query attention's q and kv, split by output rows with their
    biases, except a kv that tp does not divide, which every rank holds whole; the MLP's fc (SwiGLU: its gate and
    up) split by output rows; the two projections split by input columns, their biases whole."""
    d, f, dh, heads, kv_heads = m.d_model, m.ffn_dim, m.head_dim, m.n_heads, m.kv_heads
    if kv_heads == heads:
        attention = _linear(f"{prefix}attn.qkv", 3 * d // tp, d, 3 * d // tp, m)
    else:
        kv = 2 * kv_heads * dh // (tp if kv_heads % tp == 0 else 1)
        attention = [
            *_linear(f"{prefix}attn.q", heads * dh // tp, d, heads * dh // tp, m),
            *_linear(f"{prefix}attn.kv", kv, d, kv, m),
        ]
    if m.mlp == "swiglu":
        mlp = [
            *_linear(f"{prefix}mlp.gate", f // tp, d, f // tp, m),
            *_linear(f"{prefix}mlp.up", f // tp, d, f // tp, m),
        ]
    else:
        mlp = _linear(f"{prefix}mlp.fc", f // tp, d, f // tp, m)
    return [
        *_norm(f"{prefix}ln_1", m),
        *attention,
        *_linear(f"{prefix}attn.proj", d, heads * dh // tp, d, m),
        *_norm(f"{prefix}ln_2", m),
        *mlp,
        *_linear(f"{prefix}mlp.proj", d, f // tp, d, m),
    ]


def chunk_params(m: ModelConfig, tp: int, pp: int, vpp: int, chunk: int) -> list[tuple[str, int]]:
    """(name, local numel) of model chunk ``chunk`` of pp * vpp (global order), in registration order.

    Chunk 0 holds the token embedding and, with learned positions, the position table (RoPE has none); the last
    chunk the final norm and the LM head: an ``lm_head`` of its own when untied, and when tied, a copy of the token
    embedding if the embedding is on another chunk (pp > 1), else nothing (the head is ``wte``). The layers split
    evenly over the chunks.
    """
    chunks = pp * vpp
    per = m.n_layers // chunks
    vocab_rows = padded_vocab_size(m.vocab_size, m.vocab_multiple, tp) // tp * m.d_model
    out: list[tuple[str, int]] = []
    if chunk == 0:
        out.append(("wte.weight", vocab_rows))
        if m.position == "learned":
            out.append(("wpe.weight", m.seq_len * m.d_model))
    for i in range(chunk * per, (chunk + 1) * per):
        out += block_params(m, tp, f"layers.{i}.")
    if chunk == chunks - 1:
        out += _norm("ln_f", m)
        if not (chunks == 1 and m.tie_embeddings):
            out.append(("lm_head.weight", vocab_rows))
    return out


def isolated(m: ModelConfig, layout: Layout) -> frozenset[str]:
    """Parameters trident/build.py gives a bucket of their own: the tied embedding and its copy on the last
    stage, whose gradients are summed across those stages (pp > 1); an untied head has no such sum."""
    return frozenset({"wte.weight", "lm_head.weight"}) if m.tie_embeddings and layout.pp > 1 else frozenset()


def rank_chunks(layout: Layout, stage: int) -> list[int]:
    """The global indices of the model chunks pipeline stage ``stage`` holds: stage, stage + pp, ..."""
    return [stage + v * layout.pp for v in range(layout.vpp)]


def rank_params(m: ModelConfig, layout: Layout, stage: int) -> list[tuple[str, int]]:
    """(name, local numel) of every parameter a rank of pipeline stage ``stage`` holds, chunk after chunk."""
    return [p for c in rank_chunks(layout, stage) for p in chunk_params(m, layout.tp, layout.pp, layout.vpp, c)]
