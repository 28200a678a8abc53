"""Activations predicted, per rank: kept for backward at the schedule's peak.

Traced from the real model where trident/memory/trace.py covers a layout (CPU layouts); the formula here is for GPU
layouts and context parallelism, its CPU terms kept so the tests can compare it with the trace and real forwards.
The formula (per layer and micro-batch, the tensors each operator saves, after Korthikanti et al. 2022, counted
for this model's kernels; the micro-batches in flight from the rank's own action list; the backward's transients)
is written out term by term in docs/planning.md ("The activation formula"). It is one table's terms, each beside the
bytes it counts, so it stays whole past ~400 lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trident.config import ModelConfig
from trident.layout import Layout
from trident.memory import trace
from trident.memory.params import local_heads, rank_chunks
from trident.memory.trace import traceable
from trident.models.checkpointing import parse_label, recomputed_layers
from trident.models.gpt import padded_vocab_size
from trident.models.moe import grouped_mm_fits
from trident.parallel.fp8 import FP8_ALIGN
from trident.parallel.pipeline.schedules import SPLIT_BACKWARD, activation_peak, build_schedule, stage_placement
from trident.parallel.pipeline.stages import stage_layers
from trident.parallel.precision import precision_policy

FP32 = 4
# The recomputations the estimator reports beside the layout's own (models/checkpointing.py ``recompute_label``).
POLICIES = ("none", "attention", "selective", "full/2", "full")
# The sparse layers' routings the estimator reports (``routed_rows``): the worst (a bound) and a balanced one.
WORST, BALANCED = "worst", "balanced"


@dataclass(frozen=True)
class _Shape:
    b: int  # sequences per micro-batch
    s: int  # tokens per sequence a rank holds: seq_len / cp
    h: int
    f: int
    a: int
    t: int  # tp
    t_sp: int  # tp with sequence parallelism, else 1
    e: int  # bytes of an activation element (the compute dtype)
    e_norm: int  # bytes of a LayerNorm's saved input, mean and rstd: fp32 under 16-bit autocast on CUDA
    device: str  # cuda | cpu
    norm: str  # layernorm | rmsnorm
    q: int  # this rank's query width: its heads x head_dim (h / t)
    kv: int  # this rank's key (or value) width: the kv heads it computes x head_dim
    fused_qkv: bool  # multi-head attention's one qkv projection (else grouped-query q and kv)
    rope: bool
    head_dim: int
    documents: bool  # packed documents: a mask and positions per sample
    cp: int = 1  # context parallelism: the ranks a sequence is split over (parallel/context/)
    cp_comm: str = "ring"
    ep: int = 1  # expert parallelism: the ranks a sparse layer's experts are divided over

    @classmethod
    def of(cls, m: ModelConfig, layout: Layout) -> _Shape:
        e = precision_policy(layout.precision).compute_dtype.itemsize
        heads, kv_heads = local_heads(m, layout.tp)
        return cls(
            b=layout.micro_batch_size,
            s=m.seq_len // layout.cp,
            h=m.d_model,
            f=m.ffn_dim,
            a=m.n_heads,
            t=layout.tp,
            t_sp=layout.tp if layout.sequence_parallel and layout.tp > 1 else 1,
            e=e,
            e_norm=FP32 if layout.device != "cpu" else e,
            device=layout.device,
            norm=m.norm,
            q=heads * m.head_size,
            kv=kv_heads * m.head_size,
            fused_qkv=m.kv_heads == m.n_heads,
            rope=m.position == "rope",
            head_dim=m.head_size,
            documents=layout.document_mask,
            cp=layout.cp,
            cp_comm=layout.cp_comm,
            ep=layout.ep,
        )

    def layer_norm(self) -> int:
        """A norm's saved tensors, on this rank's share of the sequence. LayerNorm: its input, mean and rstd.
        RMSNorm: on CUDA the fused kernel's input and fp32 rstd (in fp32 under 16-bit autocast, which casts it up);
        on a CPU the composite's fp32 input (upcast under 16-bit), its normalised fp32 copy and the fp32 rstd."""
        tokens = self.s * self.b // self.t_sp
        if self.norm == "layernorm":
            return tokens * (self.h + 2) * self.e_norm
        return tokens * ((self.h if self.device != "cpu" else 2 * self.h) + 1) * FP32

    def attention(self, explicit: bool) -> int:
        """q, k and v as attention keeps them, and its output (the projection's input), per rank. Multi-head: the
        fused qkv output, which the q, k and v views keep whole, and with RoPE the rotated q and k besides.
        Grouped-query: q (rotated, with RoPE), the kv output (v is a view of it) and with RoPE the rotated k. The
        explicit core (``explicit``: dropout in training) keeps instead q, k and v at every query head's width,
        as its matmuls save them (k and v repeated to the query heads; views of the fused qkv copied contiguous),
        and none of the projections' outputs."""
        sb = self.s * self.b
        if explicit:
            return sb * 4 * self.q * self.e
        if self.fused_qkv:
            return sb * self.q * (6 if self.rope else 4) * self.e
        return sb * (2 * self.q + (3 if self.rope else 2) * self.kv) * self.e

    def rope_tables(self) -> int:
        """RoPE's cos and sin, fp32 [s, head_dim], kept by the rotations' multiplies; in a 16-bit model each of q
        and k gets its own 16-bit cast of them: the same bytes. Packed documents, and context parallelism (whose
        batches carry positions): one pair per sample [b, s, hd]."""
        per_sample = self.b if self.documents or self.cp > 1 else 1
        return 2 * per_sample * self.s * self.head_dim * FP32 if self.rope else 0

    def context_attention(self) -> int:
        """Under context parallelism, in place of ``attention``: what the exchange (parallel/context/) keeps of q,
        k, v and the output per layer, its fp32 log-sum-exp aside (the same as the fused kernel's). Every exchange
        keeps the output (the projection's input) and the core's own fp32 copy of it. ring: q, k and v as the fused
        kernel does (the gathered spans, which every layer shares, are the chunk's: ``context_bytes``). allgather:
        q's storage (the fused qkv output without RoPE), the gathered k and v of the whole sequence and the bool
        mask [b or 1, s, cp s]. ulysses: the head-split q, k and v of the whole sequence (a kv head repeated when cp
        does not divide them) and the mask [b or 1, cp s, cp s]; none of the projections' outputs."""
        sb, whole = self.s * self.b, self.s * self.cp
        # The core's fp32 output and the projection's input in the compute dtype. CPU: the flash kernel's output is
        # laid out [b, s, heads, d], so allgather's projection input is a view of it, the same storage in fp32 (the
        # ring's joins its query halves, ulysses' comes back through the all-to-all: copies).
        out = sb * self.q * (self.e + FP32)
        shared = sb * self.q * FP32 if self.e == FP32 and self.device == "cpu" else 0
        per_sample = self.b if self.documents else 1
        if self.cp_comm == "ring":  # the gathered spans: once per chunk (``context_bytes``)
            return self.attention(False) + sb * self.q * FP32
        if self.cp_comm == "allgather":
            q = 3 * self.q if self.fused_qkv and not self.rope else self.q
            return out - shared + sb * q * self.e + 2 * self.b * whole * self.kv * self.e + per_sample * self.s * whole
        kv_heads = self.kv // self.head_dim
        kv = self.kv // self.cp if kv_heads % self.cp == 0 else self.head_dim
        return out + sb * self.q * self.e + 2 * self.b * whole * kv * self.e + per_sample * whole * whole

    def dropped_context_attention(self) -> int:
        """Under context parallelism in training with dropout (models/context_window.py ``dropped_attention``): q,
        the gathered k and v repeated to the query heads (the matmuls' operands) and the output, as the explicit
        core keeps them over the whole window's keys; its probabilities, their dropped copy and keep mask, and the
        inverted bool mask [b or 1, s, cp s] (``explicit_core``)."""
        return 2 * self.s * self.b * self.q * self.e + 2 * self.b * self.s * self.cp * self.q * self.e

    def explicit_core(self) -> int:
        """The explicit core's probabilities, their dropped copy and keep mask [b, a, s, keys], and the inverted
        mask masked_fill keeps: the causal one, under context parallelism the spans' [b or 1, s, cp s]."""
        keys = self.s * self.cp
        core = self.b * self.a * self.s * keys // self.t * (2 * self.e + 1)
        if self.cp > 1:
            return core + (self.b if self.documents else 1) * self.s * keys
        return core + self.s * self.s


def layer_bytes(m: ModelConfig, layout: Layout, policy: str, sparse: bool = False, routing: str = WORST) -> int:
    """Activation bytes one recomputed transformer layer keeps for backward per micro-batch (see the module
    docstring); ``policy`` a label without ``/N`` (``none``, ``attention``, ``selective[...]``, ``full``).
    ``sparse``: a mixture-of-experts layer, whose MLP keeps ``moe_bytes`` under ``routing``."""
    x = _Shape.of(m, layout)
    sbh, sbf = x.s * x.b * x.h, x.s * x.b * x.f
    name, modules, _ = parse_label(policy)
    if policy == "full":
        return sbh * x.e // x.t_sp
    if name == "selective":
        return _selective_layer_bytes(m, x, set(modules), moe_bytes(m, layout, policy, routing) if sparse else None)
    masks = 2 * sbh // x.t_sp if m.dropout > 0 else 0
    core = 0  # what the attention core keeps beyond q, k, v and its output; nothing when it is recomputed
    explicit = policy == "none" and m.dropout > 0  # under attention the core is recomputed
    if policy == "none":
        if explicit:  # the explicit core (models/gpt.py, models/context_window.py under cp)
            core = x.explicit_core()
        else:  # the fused kernel's fp32 logsumexp
            core = FP32 * x.a * x.b * x.s // x.t
    # The fc (or gate and up) input, and GELU: fc output, GELU output; SwiGLU: gate and up outputs, silu(gate), their
    # product. A sparse layer: what its router, experts and shared experts keep instead.
    mlp = sbh * x.e + (4 if m.mlp == "swiglu" else 2) * sbf * x.e // x.t
    if sparse:
        mlp = moe_bytes(m, layout, "none", routing)
    return (
        2 * x.layer_norm()
        + sbh * x.e  # the qkv (or q and kv) input
        + _attention(x, explicit)
        + x.rope_tables()
        + mlp
        + core
        + masks
    )


def _attention(x: _Shape, explicit: bool) -> int:
    if x.cp == 1:
        return x.attention(explicit)
    return x.dropped_context_attention() if explicit else x.context_attention()


def _selective_layer_bytes(m: ModelConfig, x: _Shape, modules: set[str], sparse: int | None = None) -> int:
    """Op-level selective recomputation: the block's input and the outputs it keeps of the modules not recomputed
    (models/checkpointing.py): always the attention projections' (fused qkv, or q and kv) and the output
    projection's (whole: the partial sums before tp's reduction); the core's (SDPA's output and fp32 log-sum-exp,
    or the explicit core's scores and output) unless ``attn_core``; the MLP's matmuls unless ``mlp``; its
    activation (GELU's output, SwiGLU's silu and product) unless ``mlp_act`` or ``mlp``; the norms' outputs unless
    ``norm`` (LayerNorm's with its mean and rstd; a CPU's composite RMSNorm's fp32 rstd, normalised input and
    its product with the gain, in fp32 before the cast back; CUDA's fused RMSNorm's output and rstd). A sparse layer's
    MLP keeps ``sparse`` bytes instead (``moe_bytes``' selective share)."""
    sb, sbh, sbf = x.s * x.b, x.s * x.b * x.h, x.s * x.b * x.f
    out = sbh * x.e // x.t_sp + sbh * x.e  # the input; the output projection
    out += sb * (3 * x.q if x.fused_qkv else x.q + 2 * x.kv) * x.e
    if "attn_core" not in modules:
        if m.dropout > 0:  # the explicit core: its scores [b h s s] and their product with v
            out += x.a // x.t * x.b * x.s * x.s * x.e + sb * x.q * x.e
        else:
            out += sb * x.q * x.e + FP32 * x.a * x.b * x.s // x.t
    hidden = (2 if m.mlp == "swiglu" else 1) * sbf * x.e // x.t
    if sparse is not None:
        out += sparse
    elif "mlp" not in modules:
        out += hidden + sbh * x.e
        if "mlp_act" not in modules:
            out += hidden
    if "norm" not in modules:
        tokens = sb // x.t_sp
        if x.norm == "layernorm":
            out += 2 * tokens * (x.h + 2) * x.e_norm
        elif x.device == "cpu":
            out += 2 * tokens * (2 * x.h + 1) * FP32
        else:  # the fused kernel's output and rstd, fp32 (under 16-bit autocast too)
            out += 2 * tokens * (x.h + 1) * FP32
    return out


@dataclass(frozen=True)
class Routing:
    """The rows one sparse layer handles on a rank per micro-batch under a routing: ``tokens`` routed here, ``sent``
    (token, expert) pairs kept (dispatched to their experts and combined back), ``received`` rows this rank's experts
    compute (at ep = 1 the pairs sent)."""

    tokens: int
    sent: int
    received: int


def routed_rows(m: ModelConfig, layout: Layout, routing: str = WORST) -> Routing:
    """Rows of a sparse layer on one rank per micro-batch (models/moe.py). The router sees b sequences of
    t = s / t_sp tokens (under tp without sequence parallelism every tp rank routes them all); each expert keeps at
    most c = min(t, capacity) pairs of a sequence (a token picks an expert once). ``worst``: the routing that loads
    one rank most, every token's top k on that rank's L = E / ep experts as far as k allows, and the rest kept
    elsewhere: it sends b min(t k, E c) pairs and receives, from each of the ep ranks, b min(t min(k, L), L c)
    rows; routing makes no figure larger. ``balanced``: each expert t k / E of a sequence's pairs (capped), what a
    rank sends it receives."""
    x = _Shape.of(m, layout)
    moe = m.moe
    t, k, e = x.s // x.t_sp, moe.top_k, moe.experts
    local = e // x.ep
    cap = math.ceil(moe.capacity_factor * t * k / e) if moe.capacity_factor is not None else t
    per_expert = min(t, cap)
    if routing == BALANCED:
        sent = x.b * min(t * k, e * cap)
        return Routing(x.b * t, sent, sent)
    sent = x.b * min(t * k, e * per_expert)
    received = x.ep * x.b * min(t * min(k, local), local * per_expert) if x.ep > 1 else sent
    return Routing(x.b * t, sent, received)


def _grouped(m: ModelConfig, x: _Shape) -> bool:
    """Whether the experts run as grouped products (models/moe.py ``grouped_mm_fits``; a GPU assumed sm80+)."""
    dtype = torch.float32 if x.e == FP32 else torch.bfloat16
    return m.moe.grouped_mm and grouped_mm_fits((x.h, m.expert_dim), dtype)


def moe_bytes(m: ModelConfig, layout: Layout, policy: str = "none", routing: str = WORST) -> int:
    """What a sparse layer's MLP (models/moe.py) keeps for backward per micro-batch in place of the dense MLP's
    input and hidden tensors; ``policy`` ``none`` (``attention`` is the same) or a ``selective[...]`` label. With n
    tokens routed here, S pairs sent and R rows received (``routed_rows``), E experts, L = E / ep local, k = top_k,
    f the expert width:

        router      its fp32 input 4 n h (the norm's output itself in fp32; in 16 bits a copy, and the weight's fp32
                    copy 4 E h), the logits and scores 2 x 4 n E (z-loss's logsumexp keeps the logits), the top-k
                    indices 8 n k, with normalised weights the gathered weights and their sum 4 n (k + 1) (a sigmoid
                    router's balancing probabilities another 4 n), the balancing share 4 b E, the logsumexp 4 n
        dispatch    per pair sent: its int64 order and token ids, its weight, the expert output in fp32 and weighted,
                    S (8 + 8 + 4 + 2 x 4 h)
        experts     per row received: its input R h e, the hidden R f e x 4 (SwiGLU: gate, up, silu, product; GELU
                    2), under ep the int64 permutations into and out of expert order 16 R; the grouped products' int32
                    offsets 4 L each
        shared      a dense MLP of shared_experts x f: its hidden (as the dense MLP's) and its input sbh e where that
                    is not the router's (16 bits, or gathered under sequence parallelism)

    Selective recomputation keeps the router's logits and the experts' products (gate and up R f e each, or GELU's
    one; down R h e), and with the activation not recomputed (``mlp_act`` unlisted) its outputs R f e (SwiGLU
    twice), the products the routing takes: the int64 run ids 8 n k, the weighted outputs 4 S h, the share 4 b E
    and five scalars (28 bytes); nothing with ``mlp`` listed."""
    x = _Shape.of(m, layout)
    moe, r = m.moe, routed_rows(m, layout, routing)
    name, modules, _ = parse_label(policy)
    n, e, k, f, local = r.tokens, moe.experts, moe.top_k, m.expert_dim, moe.experts // x.ep
    mats = 3 if m.mlp == "swiglu" else 2  # the experts' matrices: gate, up, down (GELU: up, down)
    shared_f = moe.shared_experts * f
    shared_hidden = (mats - 1) * x.s * x.b * shared_f * x.e // x.t  # gate and up outputs (GELU: fc output)
    if name == "selective":
        if "mlp" in modules:
            return 0
        out = FP32 * n * e + r.received * ((mats - 1) * f + x.h) * x.e
        out += shared_hidden + (x.s * x.b * x.h * x.e if shared_f else 0)
        if "mlp_act" not in modules:
            out += r.received * (mats - 1) * f * x.e + shared_hidden
            out += 8 * n * k + FP32 * r.sent * x.h + FP32 * x.b * e + 28
        return out
    normalised = moe.router == "sigmoid" or moe.norm_topk
    router = FP32 * n * x.h + (FP32 * e * x.h if x.e != FP32 else 0) + 2 * FP32 * n * e + 8 * n * k
    router += FP32 * n * (k + 1) if normalised else 0
    router += FP32 * n if moe.router == "sigmoid" else 0
    router += FP32 * x.b * e + FP32 * n
    dispatch = r.sent * (8 + 8 + FP32 + 2 * FP32 * x.h)
    experts = r.received * (x.h + 2 * (mats - 1) * f) * x.e + (16 * r.received if x.ep > 1 else 0)
    experts += FP32 * local * mats if _grouped(m, x) else 0
    shared = 0
    if shared_f:
        shared = 2 * shared_hidden + (x.s * x.b * x.h * x.e if x.e != FP32 or x.t_sp > 1 else 0)
    return router + dispatch + experts + shared


def documents_bytes(m: ModelConfig, layout: Layout, policy: str, first: bool) -> int:
    """What packed documents add per chunk and micro-batch under recomputation: its arguments keep the chunk's
    int64 positions [b, s] (on the first stage, with learned positions and no sequence parallelism, those positions
    are the embedding's own, counted there) and flex attention's block mask, whose few block indices are left
    out."""
    x = _Shape.of(m, layout)
    if not x.documents or policy == "none":
        return 0
    shared = first and m.position == "learned" and x.t_sp == 1
    return 0 if shared else 8 * x.b * x.s


def context_bytes(m: ModelConfig, layout: Layout) -> int:
    """What context parallelism adds per chunk and micro-batch: the ring's plan, which every layer shares
    (parallel/context/ring.py ``RingPlan``), keeps the gathered spans of the whole sequence (int64 indices, per
    sample with documents, and int32 document ids); in training with dropout no layer runs the ring."""
    x = _Shape.of(m, layout)
    if x.cp == 1 or x.cp_comm != "ring" or m.dropout > 0:
        return 0
    whole = x.s * x.cp
    return 8 * (x.b if x.documents else 1) * whole + (4 * x.b * whole if x.documents else 0)


def stream_bytes(m: ModelConfig, layout: Layout, policy: str, first: bool, last: bool) -> int:
    """What a runner keeps of a chunk's forward beside what the chunk keeps (parallel/pipeline/executor.py
    ``saved``), sbh e / t_sp each: on every chunk but the last its output, the residual stream it sends and runs
    backward from; on every chunk but the first the residual stream received, where the chunk's first layer (under
    ``policy``) keeps a copy of it rather than itself: its norm's input cast, RMSNorm's in 16 bits, LayerNorm's
    under 16-bit autocast on CUDA (full and selective recomputation keep the input itself)."""
    x = _Shape.of(m, layout)
    stream = x.s * x.b * x.h * x.e // x.t_sp
    cast = x.e != FP32 and (m.norm == "rmsnorm" or x.device != "cpu")
    received = not first and cast and parse_label(policy)[0] not in ("full", "selective")
    return stream * ((not last) + received)


def embed_bytes(m: ModelConfig, layout: Layout) -> int:
    """What the first stage's embedding keeps per micro-batch: with learned positions the int64 position ids (this
    rank's share of them under sequence parallelism); at tp > 1 the vocab-parallel lookup's bool mask and int64
    local ids; the embedding dropout's mask."""
    x = _Shape.of(m, layout)
    out = 8 * x.s // x.t_sp * (x.b if x.documents else 1) if m.position == "learned" else 0
    if x.cp > 1 and m.position == "learned":  # the batch's positions (parallel/context/batch.py), sliced under SP
        out = 8 * x.b * x.s // x.t_sp if x.t_sp > 1 else 0
    if x.t > 1:
        out += x.b * x.s * (1 + 8)
    if m.dropout > 0:
        out += x.b * x.s * x.h // x.t_sp
    return out


def head_bytes(m: ModelConfig, layout: Layout) -> int:
    """What the last stage's head keeps per micro-batch: the final norm, the head matmul's (whole) input and the
    loss's fp32 probabilities over this rank's vocab block (at tp > 1 with a bool and an int64 per token); the
    same for a tied head and an untied ``lm_head``."""
    x = _Shape.of(m, layout)
    if m.loss_chunk_tokens:  # the fused loss: its gradients of the head's input (every token's) and weight block
        block = padded_vocab_size(m.vocab_size, m.vocab_multiple, x.t) // x.t
        return x.layer_norm() + x.b * x.s * x.h * x.e_norm + block * x.h * x.e + FP32
    if x.t == 1:  # log-probabilities, and nll_loss's output and total weight
        loss = FP32 * x.b * x.s * m.vocab_size + 2 * FP32
    else:  # the vocab-parallel loss's probabilities, owner mask and local ids, and the loss
        block = padded_vocab_size(m.vocab_size, m.vocab_multiple, x.t) // x.t
        loss = FP32 * x.b * x.s * min(block, m.vocab_size) + x.b * x.s * (1 + 8) + FP32
    return x.layer_norm() + x.s * x.b * x.h * x.e + loss


def activation_bytes(
    m: ModelConfig,
    layout: Layout,
    stage: int,
    policy: str | None = None,
    routing: str = WORST,
    traced: bool = True,
) -> int:
    """Peak activation bytes pipeline stage ``stage`` keeps for backward: walk its schedule, adding a chunk's
    bytes at each forward and releasing them at its backward. ``policy``: a recomputation label
    (models/checkpointing.py ``recompute_label``), the layout's own by default. ``routing``: the sparse layers'
    (``routed_rows``): the worst, a bound, by default. A chunk's bytes are traced (trident/memory/trace.py) where
    the trace covers the layout, else this module's formula; ``traced=False``: the formula alone (the tests
    compare the two)."""
    policy = policy or layout.recompute
    name, _, every = parse_label(policy)
    kept = policy.partition("/")[0]
    chunks = rank_chunks(layout, stage)
    layers = m.n_layers // (layout.pp * layout.vpp)
    last = layout.pp * layout.vpp - 1
    per_layer: dict[tuple[str, bool], int] = {}

    def one(label: str, sparse: bool) -> int:
        if (label, sparse) not in per_layer:
            per_layer[label, sparse] = layer_bytes(m, layout, label, sparse, routing)
        return per_layer[label, sparse]

    chunk_bytes = []
    for c in chunks:
        if traced and traceable(m, layout):  # the real chunk traced, its sparse layers routed as ``routing``
            rows = routed_rows(m, layout, routing) if m.moe.enabled else None
            chunk_bytes.append(trace.chunk_bytes(m, layout, c, policy, rows and (rows.sent, rows.received)))
            continue
        held = range(c * layers, (c + 1) * layers)  # virtual stage c's global layers (parallel/pipeline/stages.py)
        recomputed = set(recomputed_layers(held, name, every))
        chunk_bytes.append(
            sum(one(kept if i in recomputed else "none", m.moe.is_sparse(i)) for i in held)
            + (embed_bytes(m, layout) if c == 0 else 0)
            + (head_bytes(m, layout) if c == last else 0)
            + documents_bytes(m, layout, policy if recomputed else "none", c == 0)
            + context_bytes(m, layout)
            + stream_bytes(m, layout, kept if held[0] in recomputed else "none", c == 0, c == last)
        )
    # Under zb-h1 and zb-v an eager chunk past stage 0 keeps its linear layers' inputs and gradients from I to W; a
    # compiled one its whole set (torch's split), as the walk counts without ``kept``.
    placement, split = stage_placement(layout.schedule), layout.schedule in SPLIT_BACKWARD and not layout.compiled
    kept = [weight_pass_bytes(m, layout, c, routing, traced) if layout.defers_weight_grads(c) else 0 for c in chunks]
    walk = (lambda c: kept[c]) if split else None
    return activation_peak(stage_actions(layout, stage), stage, layout.pp, lambda c: chunk_bytes[c], placement, walk)


def weight_pass_bytes(m: ModelConfig, layout: Layout, chunk: int, routing: str = WORST, traced: bool = True) -> int:
    """What virtual stage ``chunk`` keeps per micro-batch from its deferred I to its W (zb past stage 0,
    parallel/wgrad.py): each deferred linear layer's input as it entered the tp region and its output gradient
    (docs/planning.md, "Zero-bubble schedules"); traced where the trace covers the layout, or ``traced=False``."""
    held = stage_layers(m.n_layers, layout.pp, layout.vpp, chunk)
    if traced and traceable(m, layout) and layout.fp8 == "off":
        rows = routed_rows(m, layout, routing) if m.moe.enabled else None
        key = rows and (rows.sent, rows.received)
        return sum(trace.traced_weight_pass_bytes(m, layout, m.moe.is_sparse(i), key) for i in held)
    x, d, q, mats = _Shape.of(m, layout), m.d_model, m.n_heads * m.head_size, 3 if m.mlp == "swiglu" else 2

    def kept(width: int, layers: list[tuple[int, int, int]]) -> int:  # one input into layers (out, in, local out)
        # Its bytes and each deferred layer's output gradient's; an FP8 layer (train.fp8) defers nothing.
        grads = [local for out, inp, local in layers if layout.fp8 == "off" or out % FP8_ALIGN or inp % FP8_ALIGN]
        return width + sum(grads) if grads else 0

    kv = [(2 * m.kv_heads * m.head_size, d, 2 * x.kv)] if m.kv_heads % layout.tp == 0 else []  # else replicated
    qkv = [(3 * q, d, 3 * x.q)] if m.kv_heads == m.n_heads else [(q, d, x.q), *kv]
    attention = kept(x.h, qkv) + kept(x.q, [(d, q, x.h)])

    def mlp(f: int) -> int:  # its up projections (and gate) of width f, then the down projection
        return kept(x.h, [(f, d, f // x.t)] * (mats - 1)) + kept(f // x.t, [(d, f, x.h)]) if f else 0

    dense, shared = mlp(m.ffn_dim), mlp(m.moe.shared_experts * m.expert_dim)
    return x.s * x.b * x.e * sum(attention + (shared if m.moe.is_sparse(i) else dense) for i in held)


def stage_actions(layout: Layout, stage: int) -> list:
    """The actions pipeline stage ``stage`` runs in a training step: the executor's own list (its schedule), or
    without a pipeline one forward and one backward per micro-batch (gradient accumulation)."""
    return build_schedule(layout.schedule or "1f1b", layout.pp, layout.vpp, layout.micro_batches)[stage]


def activation_sets(layout: Layout, stage: int, m: ModelConfig | None = None) -> int:
    """The most activation sets (micro-batch x model chunk) stage ``stage`` holds at once, beside the executor's count
    in memory.json; given ``m``, an eager zb chunk deferring no GEMM (all FP8) holds none from I to W."""
    chunks, placement = rank_chunks(layout, stage), stage_placement(layout.schedule)
    split = m is not None and layout.schedule in SPLIT_BACKWARD and not layout.compiled
    defers = [split and layout.defers_weight_grads(c) for c in chunks]
    sets = [int(d and weight_pass_bytes(m, layout, c, traced=False) > 0) for c, d in zip(chunks, defers, strict=True)]
    walk = (lambda c: sets[c]) if split else None
    return activation_peak(stage_actions(layout, stage), stage, layout.pp, placement=placement, kept=walk)


def loss_backward_bytes(m: ModelConfig, layout: Layout) -> int:
    """Transient bytes of the loss's backward on the last stage, above the held activations (its probabilities are
    among those). tp = 1: the gradients of the log-probabilities and of the fp32 logits, 4 b s V each, together.
    tp > 1: the vocab-parallel loss builds its gradient in place in its probabilities, then pads it with fp32 zero
    columns where the rank's block holds padding, and casts it to 16-bit logits' dtype, the padded copy alive
    during the cast: on the rank with padding 4 b s block + e b s block (e: 0 in fp32, where no cast copies), and
    its int64 row indices, 8 b s. Both with the loss's own scalar gradient."""
    x = _Shape.of(m, layout)
    tokens = x.b * x.s
    seed = FP32  # the loss's own gradient, a scalar
    if m.loss_chunk_tokens:  # the fused loss scales its two gradients into new tensors (by a 16-bit copy of seed)
        block = padded_vocab_size(m.vocab_size, m.vocab_multiple, x.t) // x.t
        # At tp > 1 the head's input gradient then leaves the tp region: an all-reduced copy (parallel/comm.py
        # ``CopyToRegion``), or under sequence parallelism its reduce-scattered shard.
        # (allocated once the 16-bit copy of the seed is gone).
        region = 0 if x.t == 1 else tokens * x.h * x.e_norm // (x.t if layout.sequence_parallel else 1)
        copy = x.e if x.e != FP32 else 0
        return seed + tokens * x.h * x.e_norm + block * x.h * x.e + max(copy, region)
    if x.t == 1:
        return 2 * FP32 * tokens * m.vocab_size + seed
    padded = padded_vocab_size(m.vocab_size, m.vocab_multiple, x.t)
    block = padded // x.t
    pad = FP32 * tokens * block if padded > m.vocab_size else 0
    cast = x.e * tokens * block if x.e != FP32 else 0
    rows = 8 * tokens  # the int64 row indices of the target columns, held to the end of the backward
    return pad + cast + rows + seed


def recompute_bytes(
    m: ModelConfig, layout: Layout, policy: str | None = None, routing: str = WORST, traced: bool = True
) -> int:
    """Transient bytes above the held activations while backward recomputes one layer: what the layer would keep
    without recomputation and does not under ``policy`` (the larger of a dense and a sparse layer's); traced where
    the trace covers the layout (``traced=False``: the formula alone)."""
    policy = (policy or layout.recompute).partition("/")[0]
    if policy == "none":
        return 0
    kinds = {m.moe.is_sparse(i) for i in range(m.n_layers)}
    if traced and traceable(m, layout):  # each kind's layer traced, without recomputation and under the policy
        rows = routed_rows(m, layout, routing) if m.moe.enabled else None
        key = rows and (rows.sent, rows.received)
        return max(
            trace.traced_layer_bytes(m, layout, "none", sparse, key)
            - (0 if policy == "full" else trace.traced_layer_bytes(m, layout, policy, sparse, key))
            for sparse in kinds
        )
    return max(
        layer_bytes(m, layout, "none", sparse, routing)
        - (0 if policy == "full" else layer_bytes(m, layout, policy, sparse, routing))
        for sparse in kinds
    )


def recompute_flops(m: ModelConfig, layout: Layout, stage: int, policy: str | None = None) -> float:
    """Matmul and attention FLOPs pipeline stage ``stage``'s backward recomputes in one training step, over its
    chunks and micro-batches (the pointwise work recomputed beside them, norms, activations, RoPE, dropout, is
    memory-bound and left out here; the planner prices it, trident/plan/ops.py). Per recomputed layer and
    micro-batch, the forward's: all its matmuls but a dense MLP's output projection (torch's checkpoint stops after
    the last tensor backward saved), 2 sb x the layer's matmul weights / tp, and attention's 4 sbsh / tp
    (``flops_per_token``'s convention) under ``full``; the attention core's under ``attention`` or a selective
    list with ``attn_core``; the MLP's matmuls with ``mlp`` (a sparse layer's: the router's, the experts' on a
    balanced routing's rows, the shared experts'); none under the default ``selective``. Under zb-h1 and zb-v a
    chunk after virtual stage 0 recomputes in I only, the MLP's output projection included under ``full`` (its
    layers' deferred GEMMs are saved after they run: parallel/wgrad.py)."""
    policy = policy or layout.recompute
    name, modules, every = parse_label(policy)
    if name == "none":
        return 0.0
    x = _Shape.of(m, layout)
    sb = x.s * x.b
    mats = 3 if m.mlp == "swiglu" else 2
    core = 4.0 * sb * x.s * x.h / x.t
    dense = 2.0 * sb * mats * x.h * x.f / x.t
    projections = 2.0 * sb * (2 * x.h * x.q + 2 * x.h * x.kv)
    sparse = 0.0
    if m.moe.enabled:  # the router, the experts on a balanced routing's rows, the shared experts (split over tp)
        r = routed_rows(m, layout, BALANCED)
        shared = m.moe.shared_experts * m.expert_dim
        sparse = 2.0 * (r.tokens * x.h * m.moe.experts + r.received * mats * x.h * m.expert_dim)
        sparse += 2.0 * sb * mats * x.h * shared / x.t

    down = 2.0 * sb * x.h * x.f / x.t  # the dense MLP's output projection, which full recomputation never reruns

    def per_layer(sparse_layer: bool) -> float:
        mlp = sparse if sparse_layer else dense
        return {
            # torch's checkpoint stops recomputing after the last tensor backward saved (the projection's input)
            "full": core + mlp - (0.0 if sparse_layer else down) + projections,
            "attention": core,
            "selective": core * ("attn_core" in modules) + mlp * ("mlp" in modules),
        }[name]

    layers = m.n_layers // (layout.pp * layout.vpp)
    total = 0.0
    for c in rank_chunks(layout, stage):
        for i in recomputed_layers(range(c * layers, (c + 1) * layers), name, every):
            sparse_layer = m.moe.is_sparse(i)
            deferred = layout.defers_weight_grads(c) and name == "full" and not sparse_layer
            total += per_layer(sparse_layer) + (down if deferred else 0.0)
    return total * layout.micro_batches
