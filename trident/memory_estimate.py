"""Per-rank memory predicted before launch, for a model shape and a parallel layout.

Model states are counted from the model's structure, parameter by parameter (``rank_params``: the padded
vocabulary's share of the embedding, the tp split of every matrix and column-parallel bias, the replicated norms
and row-parallel biases, grouped-query attention's kv weight split over tp or, with fewer kv heads than tp ranks,
held whole by every rank, SwiGLU's gate and up beside each other, a position table only with learned positions, the
layers of each pipeline stage, the LM head on the last stage: an untied head of its own, or with pp > 1 the tied
copy of the embedding), laid out in the flat buffers with the reducer's buckets and their padding to a multiple of
dp (parallel/layout.py; a tied embedding and its copy isolated in buckets of their own under pp > 1), then
held as each ZeRO stage holds them (``model_states``). With Psi parameters and N dp ranks this is the ZeRO paper's
accounting (Rajbhandari et al., 2020: 16 Psi in 16-bit training, 4 Psi + 12 Psi / N at stage 1, 2 Psi + 14 Psi / N
at stage 2, 16 Psi / N at stage 3) made exact: padding, the gradient buffer's fp32 even for 16-bit parameters,
Adam's per-tensor step counters, buffers a stage keeps whole. tests/test_memory.py checks it to the byte against
real ranks (memory.json).

Activations follow Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models"):
count, per transformer layer and micro-batch, the tensors each operator saves for backward, then multiply by the
micro-batches in flight on a pipeline stage. Counted for this model's operators rather than Megatron's: attention
runs a fused kernel (flash / memory-efficient, taking grouped-query k and v as they are) that saves q, k, v, its
output and an fp32 logsumexp, never the s x s scores, so Korthikanti's 5as/h term is absent, and selective
recomputation of the attention core saves only the logsumexp. With s tokens, b sequences, h the model width, f the
MLP width, a heads, t = tp, t_sp = t under sequence parallelism (else 1), e the activation dtype's bytes, e_n a
LayerNorm's (fp32 under 16-bit autocast on CUDA, where layer_norm is an fp32 op; the activation dtype on CPU,
where it is not), q = h / t this rank's query width and k its key width (its kv heads x head_dim):

    per layer, no recomputation   LayerNorm inputs, mean, rstd    2 sb (h + 2) e_n / t_sp
                                  RMSNorm instead                 2 sb (h + 1) 4 / t_sp on CUDA (the fused kernel's
                                                                  input and rstd, fp32 under autocast), 2 sb (2h + 1)
                                                                  4 / t_sp on a CPU (the composite's fp32 input, its
                                                                  normalised copy and rstd)
                                  qkv and fc inputs               2 sbh e    (whole: all-gathered under SP)
                                  q, k, v, attention output       multi-head: 4 sbq e (the fused qkv output, which
                                                                  the q, k, v views keep, and the output), 6 sbq e
                                                                  with RoPE (the rotated q and k besides);
                                                                  grouped-query: sb (2q + 2k) e, sb (2q + 3k) e with
                                                                  RoPE (the kv output and the rotated q and k)
                                  RoPE's cos and sin tables       2 s (h / a) 4 (fp32; two 16-bit casts each in 16 bits)
                                  attention logsumexp             4 abs / t
                                  fc output, GELU output          2 sbf e / t
                                  SwiGLU instead                  4 sbf e / t (gate and up outputs, silu(gate), product)
                                  dropout masks (p > 0)           2 sbh / t_sp  (bool)
                                  with dropout (p > 0), training runs attention explicitly (SDPA's dropout draws from
                                  the global generator): instead of the logsumexp, the probabilities and their
                                  dropped copy 2 a b s^2 e / t, the keep mask a b s^2 / t and the causal mask s^2;
                                  its matmuls keep q, k and v at the query heads' width, 4 sbq e in all with the
                                  output (k and v repeated, views copied contiguous), instead of the projections'
    selective recomputation       the same without the logsumexp (or the explicit core's s^2 tensors)
    full recomputation            the layer's input, sbh e / t_sp, plus one layer recomputed during backward
    packed documents (CPU)        per layer: SDPA's float copy of the dense mask b s^2 e (the explicit core's inverted
                                  mask b s^2 instead of the causal s^2), RoPE's tables per sample (b x); per chunk
                                  under recomputation: the bool mask b s^2 and the int64 positions 8 b s its
                                  arguments keep; the learned position ids are per sample (b x). On CUDA flex
                                  attention's block mask, whose few block indices are not counted.

For f = 4h, fp32 and t = 1 that is 16 sbh elements per layer, Korthikanti's 34 sbh bytes of 16-bit activations
without their two dropout masks. The first stage adds the position ids with learned positions (and at tp > 1 the
vocab-parallel lookup's mask and local ids), the last stage the final norm, the head's whole input and the loss's
fp32 probabilities over this rank's vocab block, 4 b s V (tied or untied head alike). Micro-batches in flight come
from walking the rank's own action list, the one the executor runs (parallel/pipeline/schedules.py
``build_schedule``, ``activation_peak``): a chunk's bytes are taken at its forward and given back at the action that
finishes its backward (B; under zb-h1 its W, which keeps the weight path's inputs after I). GPipe holds all M, 1F1B
min(pp - r, M) on stage r, zb-h1 more (its W passes are delayed), interleaved its warm-up + 1 chunk forwards (on the
first stage Korthikanti's L (1 + (pp - 1) / (pp vpp)) layers when M is a multiple of pp). On a CPU every term is
checked to the byte against a real forward (tests/test_memory.py); the CUDA terms (LayerNorm and RMSNorm in fp32
under autocast, fused attention for every head layout) are from the kernels' signatures, not measured here. Not
counted: the logits the runner holds while backward runs, allocator fragmentation, communication buffers, the CUDA
context and workspaces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

from trident.config import ModelConfig
from trident.layout import Layout
from trident.memory import KINDS, PLACES, Figures
from trident.models.gpt import count_params, padded_vocab_size
from trident.parallel.layout import FlatLayout
from trident.parallel.pipeline.schedules import activation_peak, build_schedule
from trident.parallel.reducer import bucket_numel
from trident.parallel.zero.grads import ShardedGradReducer
from trident.parallel.zero.optimizer import shard_segments

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32, one element each per parameter element
STEP_COUNTER = 4  # AdamW's per-tensor step: a float32 scalar
POLICIES = ("none", "selective", "full")


# --- parameters -----------------------------------------------------------------------------------------------


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


def _meta(numel: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(numel, device="meta"))


def _chunk_indices(names: list[str]) -> list[int]:
    """Which of the rank's model chunks each parameter of ``rank_params`` is in: they come chunk after chunk, each
    chunk's layers contiguous, the next chunk's starting further on (the other ranks' chunks lie between)."""
    chunk, last, out = 0, None, []
    for name in names:
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            if last is not None and layer not in (last, last + 1):
                chunk += 1
            last = layer
        out.append(chunk)
    return out


def flat_layout(params: list[tuple[str, int]], layout: Layout, isolate: Collection[str] = ()) -> FlatLayout:
    """The flat layout trident builds over these parameters (trident/build.py), from stand-in
    parameters on the meta device: at stages 0-2 the reducer's buckets of about ``bucket_mb`` of fp32 in reverse
    registration order, the parameters named in ``isolate`` (``isolated``: a tied embedding and its copy under
    pipeline parallelism) each in a bucket of its own; at stage 3 (parallel/zero/stage3.py ``unit_layout``), per
    model chunk, one bucket per transformer block, last block first, then the rest (the root: none on a chunk with
    no embedding or head), an isolated parameter in a bucket of its own; every bucket padded to a multiple of dp."""
    metas = [(name, _meta(n)) for name, n in params]
    if layout.zero < 3:
        alone = [p for name, p in metas if name in isolate]
        numel = bucket_numel(layout.bucket_mb, torch.float32)
        chunks: list[list[nn.Parameter]] = []  # no bucket spans two of the rank's model chunks
        for (_, p), c in zip(metas, _chunk_indices([name for name, _ in metas]), strict=True):
            chunks += [[] for _ in range(c + 1 - len(chunks))]
            chunks[c].append(p)
        return FlatLayout.by_size([p for _, p in metas], numel, layout.dp, isolate=alone, chunks=chunks)
    buckets = []
    for blocks, roots in _stage3_chunks(metas, isolate):
        buckets += [list(reversed(u)) for u in [*reversed(blocks), *roots]]
    return FlatLayout(buckets, layout.dp)


def _stage3_chunks(
    metas: list[tuple[str, nn.Parameter]], isolate: Collection[str]
) -> list[tuple[list[list[nn.Parameter]], list[list[nn.Parameter]]]]:
    """Stage 3's buckets of each model chunk, unpadded (parallel/zero/stage3.py ``unit_layout``): each block's
    parameters in forward order, and the root's buckets: the chunk's other parameters, then each one in ``isolate``
    alone; an empty root has no bucket."""
    out = []
    for blocks, root in _chunk_units(metas):
        roots = [[p for name, p in root if name not in isolate]] + [[p] for name, p in root if name in isolate]
        out.append((blocks, [r for r in roots if r]))
    return out


def _chunk_units(metas: list[tuple[str, nn.Parameter]]) -> list[tuple[list[list[nn.Parameter]], list]]:
    """(each block's parameters in forward order, the root's (name, parameter)s) of each model chunk among
    ``metas`` (a rank's, chunk after chunk, as ``rank_params`` lists them; chunks as ``_chunk_indices`` finds
    them): the embedding opens the first chunk, the final norm and head close the last."""
    chunks: list[tuple[list[list[nn.Parameter]], list]] = []
    previous = None
    for (name, p), c in zip(metas, _chunk_indices([name for name, _ in metas]), strict=True):
        chunks += [([], []) for _ in range(c + 1 - len(chunks))]
        blocks, root = chunks[c]
        if not name.startswith("layers."):
            root.append((name, p))
            continue
        layer = int(name.split(".")[1])
        if layer != previous:
            blocks.append([])
        blocks[-1].append(p)
        previous = layer
    return chunks


# --- model states ---------------------------------------------------------------------------------------------


def _figures() -> Figures:
    return {kind: dict.fromkeys(PLACES, 0) for kind in KINDS}


def _total(figures: Figures) -> Figures:
    figures["total"] = {place: sum(figures[kind][place] for kind in KINDS) for place in PLACES}
    return figures


def _place(figures: Figures, layout: Layout) -> Figures:
    """On a CPU run the "device" is host memory: fold it in."""
    if layout.device != "cpu":
        return figures
    return {kind: {"device": 0, "host": v["device"] + v["host"]} for kind, v in figures.items()}


@dataclass
class ModelStates:
    """One rank's predicted model-state bytes, and the transient buffers above them."""

    figures: Figures  # kind -> place -> bytes, as ``trident.memory.measure_model_states`` measures them
    staging: int  # stages 2-3: fp32 staging of the bucket filling and those in flight (the largest ones)
    gathered: int  # stage 3: the most full buffers gathered at once, in the parameter dtype (``_gathered``)
    checkpoint: int  # what the rank's checkpoint holds: fp32 masters and moments of its shard, a step per piece


def model_states(
    params: list[tuple[str, int]], layout: Layout, dp_rank: int | None = None, isolate: Collection[str] = ()
) -> ModelStates:
    """Bytes of parameters, gradients and optimizer states that dp rank ``dp_rank`` (None: the largest) holds
    for ``params`` (``rank_params``; ``isolate``: ``isolated``), held as trident/build.py's optimizer holds
    them. B is the flat layout's numel (parameters plus bucket padding), S the shards (dp at stages 1-3, else 1), p
    the parameter dtype's bytes. Every stage, 0 included, is ZeRO's optimizer over this rank's 1/S of every bucket,
    cut into pieces per parameter:

                          parameters  p B (stages 0-2: one flat buffer), p B / S (stage 3: the shards)
                          gradients   4 B (stages 0-1: the reducer's buffer), 4 B / S (stages 2-3: the shard)
                          masters     4 B / S in fp32 (none where fp32 parameters are their own masters)
                          moments     2 x 4 per parameter element of the shard (padding has none), a step per piece
        offload ratio r   the shard's first round(r B / S) elements keep masters and moments on the host, and a
                          host copy of their gradients (4 bytes each)

    Transient, above these: stages 2-3 stage each bucket's fp32 gradients while it fills and until its
    reduce-scatter is waited for; ``staging`` bounds it by the largest buckets that can be held at once: those
    filling (at stage 2 two, where one bucket ends and the next begins; at stage 3 a block and the root, which fills
    from backward's first gradient to its last) and MAX_IN_FLIGHT = 2 in flight (under gradient accumulation, maybe
    another micro-batch's copies of those filling). Stage 3 gathers a block's parameters while it runs
    (``gathered``: the roots and 1 + ``zero3_prefetch`` blocks, the running and the prefetched; every bucket with
    ``zero3_gather=step``).
    """
    flat = flat_layout(params, layout, isolate)
    ranks = range(layout.dp if layout.zero >= 1 else 1) if dp_rank is None else [dp_rank]
    units = _stage3_units(params, flat, isolate) if layout.zero == 3 else []
    first = any(name == "wte.weight" for name, _ in params)
    states = (_rank_states(params, flat, layout, r, units, first) for r in ranks)
    return max(states, key=lambda s: sum(s.figures["total"].values()))


def _stage3_units(
    params: list[tuple[str, int]], flat: FlatLayout, isolate: Collection[str]
) -> list[tuple[list[int], list[int]]]:
    """(its blocks' bucket numels, its root buckets' numels) of each model chunk, as ``flat_layout`` laid them."""
    out, at = [], 0
    for blocks, roots in _stage3_chunks([(name, _meta(n)) for name, n in params], isolate):
        spans = [s.numel for s in flat.spans[at : at + len(blocks) + len(roots)]]
        out.append((spans[: len(blocks)], spans[len(blocks) :]))
        at += len(blocks) + len(roots)
    return out


def _gathered(layout: Layout, flat: FlatLayout, units: list[tuple[list[int], list[int]]], first: bool) -> int:
    """Stage 3's most full-buffer elements gathered at once (parallel/zero/stage3.py): in step mode every bucket;
    else every chunk's root (held while any micro-batch is in flight) and the running block of one chunk with the
    ``zero3_prefetch`` next ones; under zb-h1 off the first stage every block too (held from I to W)."""
    if layout.zero3_gather == "step" or (layout.schedule == "zb-h1" and not first):
        return flat.numel
    roots = sum(sum(root) for _, root in units)
    running = max(sum(sorted(blocks, reverse=True)[: 1 + layout.zero3_prefetch]) for blocks, _ in units)
    return roots + running


def _rank_states(
    params: list[tuple[str, int]],
    flat: FlatLayout,
    layout: Layout,
    dp_rank: int,
    units: list[tuple[list[int], list[int]]],
    first: bool,
) -> ModelStates:
    fig = _figures()
    pb = DTYPE_BYTES[layout.precision]
    ratio = layout.offloaded_fraction

    shards = layout.dp if layout.zero >= 1 else 1
    rank = dp_rank if layout.zero >= 1 else 0
    shard = flat.numel // shards
    host_numel = round(ratio * flat.numel / shards)
    fig["params"]["device"] = (shard if layout.zero == 3 else flat.numel) * pb
    fig["grads"]["device"] = (shard if layout.zero >= 2 else flat.numel) * FP32
    fig["grads"]["host"] = host_numel * FP32
    fig["optimizer"]["host"] = host_numel * FP32
    if pb != FP32:
        fig["optimizer"]["device"] = (shard - host_numel) * FP32
    checkpoint = 0
    for span, start, stop, on_host in shard_segments(flat, rank, shards, host_numel):
        pieces = flat.pieces(span, start, stop)
        place = "host" if on_host else "device"
        fig["optimizer"][place] += sum(p.numel for p in pieces) * ADAM_MOMENTS * FP32 + len(pieces) * STEP_COUNTER
        checkpoint += sum(p.numel for p in pieces) * (1 + ADAM_MOMENTS) * FP32 + len(pieces) * STEP_COUNTER
    staging = gathered = 0
    if layout.zero >= 2:
        largest = sorted((s.numel for s in flat.spans), reverse=True)
        in_flight = sum(largest[: ShardedGradReducer.MAX_IN_FLIGHT])
        if layout.zero == 2:  # filling: two buckets at most, where one ends and the next begins
            staging = (sum(largest[:2]) + in_flight) * FP32
        else:  # filling: a chunk's block, and its root from backward's first gradient (final norm) to its last
            filling = max(sum(root) + max(blocks, default=0) for blocks, root in units)
            staging = (filling + in_flight) * FP32
            gathered = _gathered(layout, flat, units, first) * pb
    return ModelStates(_place(_total(fig), layout), staging, gathered, checkpoint)


# --- activations ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    b: int  # sequences per micro-batch
    s: int  # tokens per sequence
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

    @classmethod
    def of(cls, m: ModelConfig, layout: Layout) -> _Shape:
        e = DTYPE_BYTES[layout.precision]
        return cls(
            b=layout.micro_batch_size,
            s=m.seq_len,
            h=m.d_model,
            f=m.ffn_dim,
            a=m.n_heads,
            t=layout.tp,
            t_sp=layout.tp if layout.sequence_parallel and layout.tp > 1 else 1,
            e=e,
            e_norm=FP32 if layout.device != "cpu" else e,
            device=layout.device,
            norm=m.norm,
            q=m.n_heads * m.head_dim // layout.tp,
            kv=kv_heads_local(m, layout.tp) * m.head_dim,
            fused_qkv=m.kv_heads == m.n_heads,
            rope=m.position == "rope",
            head_dim=m.head_dim,
            documents=layout.document_mask,
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
        and k gets its own 16-bit cast of them: the same bytes. Packed documents: one pair per sample [b, s, hd]."""
        per_sample = self.b if self.documents else 1
        return 2 * per_sample * self.s * self.head_dim * FP32 if self.rope else 0

    def document_mask(self) -> int:
        """Packed documents on a CPU: the dense bool mask [b, 1, s, s], whole on every tp rank (attention sees
        the whole sequence). On CUDA flex attention's block mask, whose few block indices are left out."""
        return self.b * self.s * self.s if self.documents and self.device == "cpu" else 0


def layer_bytes(m: ModelConfig, layout: Layout, policy: str) -> int:
    """Activation bytes one transformer layer keeps for backward per micro-batch (see the module docstring)."""
    x = _Shape.of(m, layout)
    sbh, sbf = x.s * x.b * x.h, x.s * x.b * x.f
    if policy == "full":
        return sbh * x.e // x.t_sp
    masks = 2 * sbh // x.t_sp if m.dropout > 0 else 0
    core = 0  # what the attention core keeps beyond q, k, v and its output; nothing when it is recomputed
    explicit = policy == "none" and m.dropout > 0
    if policy == "none":
        if explicit:  # the explicit core (models/gpt.py): probabilities, their dropped copy and keep mask
            core = x.b * x.a * x.s * x.s // x.t * (2 * x.e + 1)
            # + the inverted mask masked_fill keeps: the causal one, or with packed documents the samples' own
            core += x.document_mask() or x.s * x.s
        else:  # the fused kernel's fp32 logsumexp, and with packed documents its own copy of the mask as a float
            core = FP32 * x.a * x.b * x.s // x.t + x.document_mask() * x.e
    # GELU: fc output, GELU output. SwiGLU: gate and up outputs, silu(gate), their product.
    mlp = (4 if m.mlp == "swiglu" else 2) * sbf * x.e // x.t
    return (
        2 * x.layer_norm()
        + 2 * sbh * x.e  # qkv (or q and kv) and fc (or gate and up) inputs
        + x.attention(explicit)
        + x.rope_tables()
        + mlp
        + core
        + masks
    )


def documents_bytes(m: ModelConfig, layout: Layout, policy: str, first: bool) -> int:
    """What packed documents add per chunk and micro-batch under recomputation: its arguments keep the chunk's
    mask and int64 positions [b, s] (on the first stage, with learned positions and no sequence parallelism,
    those positions are the embedding's own, counted there). Without recomputation the mask is freed once
    attention has taken its copy."""
    x = _Shape.of(m, layout)
    if not x.documents or policy == "none":
        return 0
    shared = first and m.position == "learned" and x.t_sp == 1
    return x.document_mask() + (0 if shared else 8 * x.b * x.s)


def embed_bytes(m: ModelConfig, layout: Layout) -> int:
    """What the first stage's embedding keeps per micro-batch: with learned positions the int64 position ids (this
    rank's share of them under sequence parallelism); at tp > 1 the vocab-parallel lookup's bool mask and int64
    local ids; the embedding dropout's mask."""
    x = _Shape.of(m, layout)
    out = 8 * x.s // x.t_sp * (x.b if x.documents else 1) if m.position == "learned" else 0
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
    if x.t == 1:  # log-probabilities, and nll_loss's output and total weight
        loss = FP32 * x.b * x.s * m.vocab_size + 2 * FP32
    else:  # the vocab-parallel loss's probabilities, owner mask and local ids, and the loss
        block = padded_vocab_size(m.vocab_size, m.vocab_multiple, x.t) // x.t
        loss = FP32 * x.b * x.s * min(block, m.vocab_size) + x.b * x.s * (1 + 8) + FP32
    return x.layer_norm() + x.s * x.b * x.h * x.e + loss


def activation_bytes(m: ModelConfig, layout: Layout, stage: int, policy: str | None = None) -> int:
    """Peak activation bytes pipeline stage ``stage`` keeps for backward: walk its schedule, adding a chunk's
    bytes at each forward and releasing them at its backward."""
    policy = policy or layout.activation_checkpointing
    chunks = rank_chunks(layout, stage)
    per_layer = layer_bytes(m, layout, policy)
    layers = m.n_layers // (layout.pp * layout.vpp)
    last = layout.pp * layout.vpp - 1
    chunk_bytes = [
        layers * per_layer
        + (embed_bytes(m, layout) if c == 0 else 0)
        + (head_bytes(m, layout) if c == last else 0)
        + documents_bytes(m, layout, policy, c == 0)
        for c in chunks
    ]
    return activation_peak(stage_actions(layout, stage), stage, layout.pp, lambda c: chunk_bytes[c])


def stage_actions(layout: Layout, stage: int) -> list:
    """The actions pipeline stage ``stage`` runs in a training step: the executor's own list (its schedule), or
    without a pipeline one forward and one backward per micro-batch (gradient accumulation)."""
    return build_schedule(layout.schedule or "1f1b", layout.pp, layout.vpp, layout.micro_batches)[stage]


def activation_sets(layout: Layout, stage: int) -> int:
    """The most activation sets (micro-batch x model chunk) pipeline stage ``stage`` holds at once; memory.json
    writes it beside the count the executor measured."""
    return activation_peak(stage_actions(layout, stage), stage, layout.pp)


def recompute_bytes(m: ModelConfig, layout: Layout, policy: str | None = None) -> int:
    """Transient bytes above the held activations while backward recomputes: one whole layer under full
    recomputation, one attention core's logsumexp under selective."""
    policy = policy or layout.activation_checkpointing
    if policy == "none":
        return 0
    return layer_bytes(m, layout, "none") - (0 if policy == "full" else layer_bytes(m, layout, "selective"))


# --- the whole prediction -------------------------------------------------------------------------------------


@dataclass
class StageEstimate:
    """A rank of one pipeline stage (every tp rank of it holds the same; the largest dp shard)."""

    stage: int
    compute_place: str  # where activations and transient buffers live: "device", or "host" on a CPU run
    params: int  # parameter elements this rank holds (local, unpadded)
    model_states: Figures  # kind -> place -> bytes
    staging: int  # transient gradient buffers (stages 2-3)
    gathered: int  # transient gathered parameters (stage 3)
    activations: dict[str, int]  # bytes kept for backward at the schedule's peak, per recomputation policy
    recompute: dict[str, int]  # transient bytes while backward recomputes, per policy
    checkpoint_staging: int = 0  # checkpoint.async: host memory holding a copy of what the rank saves, for the run
    activation_sets: int = 1  # the most micro-batch x chunk activation sets held at once (the schedule's walk)

    def peak(self, policy: str) -> dict[str, int]:
        """Model states, transient buffers and activations, by place, at the schedule's peak under ``policy``."""
        out = dict(self.model_states["total"])
        out[self.compute_place] += self.staging + self.gathered + self.activations[policy] + self.recompute[policy]
        out["host"] += self.checkpoint_staging
        return out


@dataclass
class Estimate:
    model: str
    layout: Layout
    total_params: int  # the model's, unpadded, tied embedding once
    stages: list[StageEstimate] = field(default_factory=list)

    @property
    def worst(self) -> StageEstimate:
        """The pipeline stage needing the most memory at its peak under the layout's checkpointing policy."""
        policy = self.layout.activation_checkpointing
        return max(self.stages, key=lambda s: (s.peak(policy)["device"], s.peak(policy)["host"]))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def estimate(m: ModelConfig, layout: Layout) -> Estimate:
    """Predicted per-rank bytes of every pipeline stage: model states, transient buffers and activations."""
    out = Estimate(model=m.name, layout=layout, total_params=count_params(m))
    for stage in range(layout.pp):
        params = rank_params(m, layout, stage)
        states = model_states(params, layout, isolate=isolated(m, layout))
        out.stages.append(
            StageEstimate(
                stage=stage,
                compute_place="host" if layout.device == "cpu" else "device",
                params=sum(n for _, n in params),
                model_states=states.figures,
                staging=states.staging,
                gathered=states.gathered,
                activations={p: activation_bytes(m, layout, stage, p) for p in POLICIES},
                recompute={p: recompute_bytes(m, layout, p) for p in POLICIES},
                checkpoint_staging=states.checkpoint if layout.async_checkpoint else 0,
                activation_sets=activation_sets(layout, stage),
            )
        )
    return out
