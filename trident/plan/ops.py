"""The work of one micro-batch through one model chunk, as operations the step-time model can price.

Each ``Op`` is one class of work in one pass: ``F`` the forward, ``I`` the backward for the inputs (what the
rank upstream waits for) and ``W`` the backward for the weights (the zero-bubble schedule runs it apart; other
schedules run I and W together as B). Classes:

    matmul       [m, k] @ [k, n] in the compute dtype: forward x @ W^T (T, out, in); backward input dy @ W
                 (T, in, out) and weight dy^T @ x (out, in, T), with T the micro-batch's tokens
    attention    causal SDPA of this rank's query and kv heads, forward in F, backward in I
    elementwise  ``count`` kernels moving ``nbytes`` in all (read + written): norms, activations, residual adds,
                 RoPE, the loss's passes over the logits; a backward moves about twice a forward's bytes. Shape
                 ``("transcendental",)`` marks those bound by arithmetic: GELU, SiLU, the loss's exponentials
    collective   tensor parallelism's all-reduce (or under sequence parallelism all-gather and reduce-scatter) of
                 a [T, d] activation, twice per layer each way, and the vocab-parallel embedding's and loss's;
                 context parallelism's exchange of keys and values over the cp group (``_cp_exchange``)

Under context parallelism (parallel/context/) a rank holds ``seq / cp`` tokens of each sequence, so every op above
is on its tokens; its attention is its share of the causal (query, key) pairs, which the head-tail split makes
1 / cp of them all: ``cp`` causal blocks of ``seq / cp`` (ring and allgather: the ring skips the empty quarters,
so each step is about one such block), or under ulysses the whole sequence on ``1 / cp`` of the heads.

The list follows models/gpt.py operator by operator (a block is norm, qkv (or q and kv), RoPE, attention, proj,
residual, norm, fc (or gate and up), GELU (or SiLU and a product), proj, residual); recomputation adds the
forward again inside the backward: all of a layer's ops under ``full``, the attention core under ``attention``, under
``selective`` its modules' ops and the cheap work between the kept matmuls (RoPE, residual adds, the core output's
copy, and tp's collectives, which rerun), for each recomputed layer (``train.recompute_every``).

The op list is one layer's walk, operator by operator, so it stays whole past ~400 lines.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trident.config import ModelConfig
from trident.memory.params import local_heads
from trident.models.checkpointing import parse_label
from trident.models.gpt import padded_vocab_size

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
PASSES = ("F", "I", "W")


@dataclass(frozen=True)
class Op:
    kind: str  # matmul | attention | elementwise | collective | framework (a pass's work no kernel is, per count)
    phase: str  # F | I | W
    shape: tuple  # matmul (m, n, k, layout); attention (b, heads, kv_heads, s, head_dim); collective (op, "tp")
    nbytes: float = 0.0  # elementwise: bytes moved by all ``count`` kernels; collective: one message's bytes
    count: int = 1  # matmuls, attentions, messages: how many; elementwise: kernels

    def times(self, k: int) -> Op:
        """This op ``k`` times over (``k`` layers)."""
        nbytes = self.nbytes * k if self.kind == "elementwise" else self.nbytes
        return Op(self.kind, self.phase, self.shape, nbytes, self.count * k)

    def in_phase(self, phase: str) -> Op:
        return Op(self.kind, phase, self.shape, self.nbytes, self.count)


@dataclass(frozen=True)
class Shape:
    """One micro-batch on one rank: its sizes after the tp split."""

    batch: int
    seq: int
    tp: int
    sequence_parallel: bool
    precision: str
    cp: int = 1  # context parallelism: ``seq`` is this rank's part of the sequence, 1 / cp of it
    cp_comm: str = "ring"
    ep: int = 1  # expert parallelism: a sparse layer's experts over ep ranks, its pairs exchanged by all-to-all
    fp8: str = "off"  # train.fp8's recipe: the linear layers' GEMMs in FP8 (``_linear``)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def e(self) -> int:
        return BYTES[self.precision]


def _linear(s: Shape, out: int, inp: int, fp8: bool = True) -> list[Op]:
    """A linear layer of ``out x inp`` local weights on the micro-batch's tokens (bias fused into the matmul; its
    gradient a reduction over the tokens). Under ``train.fp8`` (``fp8``: a layer parallel/fp8.py converts, its
    dims multiples of 16) its GEMMs are FP8's, the weight gradient's too but under ``rowwise_with_gw_hp``."""
    t = s.tokens
    low = "fp8" if fp8 and s.fp8 != "off" and out % 16 == 0 and inp % 16 == 0 else None
    return [
        Op("matmul", "F", (t, out, inp, "nt", low)),
        Op("matmul", "I", (t, inp, out, "nn", low)),
        Op("matmul", "W", (out, inp, t, "tn", None if s.fp8 == "rowwise_with_gw_hp" else low)),
    ]


def _elementwise(phase_bytes: float, count: int, heavy: bool = False) -> list[Op]:
    """``count`` kernels moving ``phase_bytes`` in forward, twice that in the input backward; ``heavy``: bound by
    arithmetic (transcendentals), not memory."""
    shape = ("transcendental",) if heavy else ()
    return [Op("elementwise", "F", shape, phase_bytes, count), Op("elementwise", "I", shape, 2 * phase_bytes, count)]


def _tp_collectives(m: ModelConfig, s: Shape, count: int) -> list[Op]:
    """``count`` tp regions entered and left: without sequence parallelism an all-reduce of the [T, d] activation
    leaving (forward) and entering (backward); with it an all-gather entering and a reduce-scatter leaving, each
    with its mirror in backward."""
    if s.tp == 1:
        return []
    nbytes = s.tokens * m.d_model * s.e
    if s.sequence_parallel:
        return [
            Op("collective", "F", ("all_gather", "tp"), nbytes, count),
            Op("collective", "F", ("reduce_scatter", "tp"), nbytes, count),
            Op("collective", "I", ("reduce_scatter", "tp"), nbytes, count),
            Op("collective", "I", ("all_gather", "tp"), nbytes, count),
        ]
    return [
        Op("collective", "F", ("all_reduce", "tp"), nbytes, count),
        Op("collective", "I", ("all_reduce", "tp"), nbytes, count),
    ]


def layer_parts(m: ModelConfig, s: Shape, sparse: bool = False) -> dict[str, list[Op]]:
    """One transformer layer, forward and backward, without recomputation, by part: what a selective policy
    keeps or recomputes (models/checkpointing.py) is a choice of parts. ``sparse``: a mixture-of-experts layer,
    whose MLP is ``_sparse_mlp``'s."""
    d, f, dh, tp, e = m.d_model, m.ffn_dim // s.tp, m.head_size, s.tp, s.e
    heads, kv = local_heads(m, tp)
    t, t_sp = s.tokens, s.tokens // (tp if s.sequence_parallel else 1)
    parts: dict[str, list[Op]] = {}
    # Two norms (each reads and writes [T, d]) and two residual adds (each reads two and writes one) on the
    # (sequence-sharded) stream.
    parts["norm"] = _elementwise(2 * (2 * t_sp * d * e), 2)
    parts["residual"] = _elementwise(2 * (3 * t_sp * d * e), 2)
    if m.kv_heads == m.n_heads:
        parts["projections"] = _linear(s, 3 * heads * dh, d)
    else:
        parts["projections"] = _linear(s, heads * dh, d) + _linear(s, 2 * kv * dh, d)
    q_bytes, k_bytes = t * heads * dh * e, t * kv * dh * e
    # x * cos + cat(-x2, x1) * sin on q and k: five kernels over each
    parts["rope"] = _elementwise(5 * 2 * (q_bytes + k_bytes), 10) if m.position == "rope" else []
    # RMSNorm of q and k (model.qk_norm): each read twice (its squares, its scaling) and written once, in six kernels
    parts["qk_norm"] = _elementwise(3 * (q_bytes + k_bytes), 12) if m.qk_norm else []
    # cp's exchange (and its work beyond the kernels) reruns in any recomputation of the layer's forward: the
    # exchange is no kernel a selective policy keeps the output of (models/checkpointing.py).
    parts["attn_core"], parts["cp_exchange"] = _attention(s, heads, kv, dh)
    parts["copy"] = _elementwise(2 * q_bytes, 1)  # the output's [b, h, T, d] -> [b, T, h d] copy
    parts["projections"] += _linear(s, d, heads * dh)
    if m.mlp == "swiglu":
        parts["mlp"] = _linear(s, f, d) + _linear(s, f, d) + _linear(s, d, f)
        parts["mlp_act"] = _elementwise(2 * t * f * e, 1, heavy=True) + _elementwise(3 * t * f * e, 1)  # silu, product
    else:
        parts["mlp"] = _linear(s, f, d) + _linear(s, d, f)
        parts["mlp_act"] = _elementwise(2 * t * f * e, 1, heavy=True)  # GELU
    parts["bias"] = []
    if m.bias:  # bias gradients: a reduction over the tokens of each linear's output
        parts["bias"] = [Op("elementwise", "W", (), t * (3 * heads * dh + d + f + d) * e, 4)]
    parts["collectives"] = _tp_collectives(m, s, 2)
    parts["dispatch"] = []
    if sparse:
        parts.update(_sparse_mlp(m, s))
        if not m.moe.shared_experts:  # only the shared experts are a tp region: the router's experts are whole
            parts["collectives"] = _tp_collectives(m, s, 1)
    return parts


def _sparse_mlp(m: ModelConfig, s: Shape) -> dict[str, list[Op]]:
    """A mixture-of-experts MLP (models/moe.py) on the tokens this rank routes (all of the micro-batch's on every tp
    rank, or its own share under sequence parallelism), priced with the active parameters: the router [E, d], the
    experts' products on the rows of a balanced routing (each of the ``top_k`` pairs of a token: one matmul of those
    rows, as the grouped product runs them) and the shared experts, split over tp as a dense MLP. ``dispatch``: the
    routing's element-wise work (scores, top-k, sort, the rows gathered and the outputs combined) and under ep the
    all-to-all of the pairs' rows there and back, forward and backward, at the calibrated all-to-all rate; a
    selective recomputation reruns it."""
    d, f, e, moe = m.d_model, m.expert_dim, s.e, m.moe
    n = s.tokens // (s.tp if s.sequence_parallel else 1)
    rows = n * moe.top_k
    if moe.capacity_factor is not None:  # a balanced routing keeps at most a capacity of each expert's pairs
        per_seq = s.seq // (s.tp if s.sequence_parallel else 1)
        cap = math.ceil(moe.capacity_factor * per_seq * moe.top_k / moe.experts)
        rows = min(rows, moe.experts * cap * s.batch)
    routed = Shape(rows, 1, 1, False, s.precision)
    tokens = Shape(n, 1, 1, False, s.precision)
    shared = dataclasses.replace(m, d_ff=moe.shared_experts * f)
    swiglu = m.mlp == "swiglu"
    mlp = _linear(tokens, moe.experts, d)
    mlp += (_linear(routed, f, d) * 2 if swiglu else _linear(routed, f, d)) + _linear(routed, d, f)
    act = _elementwise(2 * rows * f * e, 1, heavy=True) + (_elementwise(3 * rows * f * e, 1) if swiglu else [])
    if moe.shared_experts:
        dense = layer_parts(shared, s)
        mlp, act = mlp + dense["mlp"], act + dense["mlp_act"]
    # Scores, top-k and sort over [n, E] fp32 (a few kernels), the rows gathered and the weighted outputs added back.
    dispatch = _elementwise(4 * n * moe.experts * 4 + 2 * rows * d * e + 3 * rows * d * 4, 8)
    if s.ep > 1:
        dispatch += [Op("collective", phase, ("all_to_all", "ep"), rows * d * e, 2) for phase in ("F", "I")]
    return {"mlp": mlp, "mlp_act": act, "dispatch": dispatch}


def _attention(s: Shape, heads: int, kv: int, dh: int) -> tuple[list[Op], list[Op]]:
    """The attention core of one layer on this rank, its share of the causal pairs (module docstring), and under
    context parallelism the exchange that brings it the keys and values."""
    if s.cp == 1:
        shape = (s.batch, heads, kv, s.seq, dh)
        return [Op("attention", "F", shape), Op("attention", "I", shape)], []
    if s.cp_comm == "ulysses":
        # All-to-all to the whole sequence on heads / cp (kv heads split, or repeated where fewer than cp).
        local_kv = kv // s.cp if kv % s.cp == 0 else 1
        shape = (s.batch, heads // s.cp, local_kv, s.seq * s.cp, dh)
        core = [Op("attention", "F", shape), Op("attention", "I", shape)]
    else:
        shape = (s.batch, heads, kv, s.seq, dh)
        core = [Op("attention", "F", shape, count=s.cp), Op("attention", "I", shape, count=s.cp)]
    return core, _cp_exchange(s, heads, kv, dh, shape)


def _cp_exchange(s: Shape, heads: int, kv: int, dh: int, block: tuple) -> list[Op]:
    """The cp group's messages of one layer, forward (F) and backward (I), by ``parallel.cp_comm``:

    ring       cp - 1 steps passing a rank's K/V block on ([2, T, kv, dh]), each overlapped with the attention
               of the block held (``block``, the attention shape of one step); backward cp - 1 steps passing K/V
               on and cp - 1 passing the running dK/dV (fp32), overlapped likewise but for the dK/dV's last trip
               home, which nothing overlaps (its pass ``home``); the op's shape names the block and its pass, which a
               recomputed forward keeps (``alone`` where the recomputation keeps the core's kernels: nothing to
               overlap)
    allgather  an all-gather of every rank's token positions (int64), then of the whole sequence's K/V, before
               attention; backward the reduce-scatter of their gradients (the gathered K/V are kept for backward)
    ulysses    all-to-alls of q, k, v (sequence-split to head-split) and of the output back, each a rank's
               [T, heads, dh] tensor (k, v: at least cp heads); backward the same four the other way
    """
    kv_block = 2 * s.tokens * kv * dh * s.e
    # What a pass's cp attention costs beyond its kernels and messages (masks, waiting on a peer; the ring's work per
    # quarter it computes, 2 cp + 1 of them: three of its own block's four, two of each other's): measured on a tiny
    # model (cost.py prices it from Profile.overheads, the ring's per quarter).
    count = ring_quarters(s.cp) if s.cp_comm == "ring" else 1
    overhead = [Op("framework", phase, (f"cp:{s.cp_comm}",), 0.0, count) for phase in ("F", "I")]
    return overhead + _cp_messages(s, heads, kv, dh, block, kv_block)


def ring_quarters(cp: int) -> int:
    """The (query half, key half) quarters a cp ring rank computes in a layer's pass under the head-tail split: of its
    own block the three the causal mask leaves, of each other rank's block two (parallel/context/ring.py)."""
    return 2 * cp + 1


def _cp_messages(s: Shape, heads: int, kv: int, dh: int, block: tuple, kv_block: float) -> list[Op]:
    if s.cp_comm == "ring":
        dkv = kv_block * 4 / s.e
        ring = [
            Op("collective", "F", ("ring", "cp", block, "fwd"), kv_block, s.cp - 1),
            Op("collective", "I", ("ring", "cp", block, "bwd"), kv_block, s.cp - 1),
            Op("collective", "I", ("ring", "cp", block, "home"), dkv, 1),
        ]
        if s.cp > 2:
            ring.append(Op("collective", "I", ("ring", "cp", block, "bwd"), dkv, s.cp - 2))
        return ring
    if s.cp_comm == "allgather":
        whole = kv_block * s.cp
        return [
            Op("collective", "F", ("all_gather", "cp"), 8 * s.tokens * s.cp),  # every rank's token positions
            Op("collective", "F", ("all_gather", "cp"), whole),
            Op("collective", "I", ("reduce_scatter", "cp"), whole),
        ]
    # kv heads fewer than cp are repeated to cp before the all-to-all (parallel/context/ulysses.py)
    q_bytes, k_bytes = s.tokens * heads * dh * s.e, s.tokens * max(kv, s.cp) * dh * s.e
    return [
        Op("collective", phase, ("all_to_all", "cp"), nbytes)
        for phase in ("F", "I")
        for nbytes in (q_bytes, k_bytes, k_bytes, q_bytes)
    ]


def layer_ops(m: ModelConfig, s: Shape, sparse: bool = False) -> list[Op]:
    """One transformer layer, forward and backward, without recomputation."""
    return [op for part in layer_parts(m, s, sparse).values() for op in part]


# What every selective policy recomputes besides its modules: the cheap work between the kept matmuls (and tp's
# collectives, ep's all-to-alls and cp's exchange, which rerun: the recomputed stream needs their results).
_ALWAYS = ("residual", "rope", "qk_norm", "copy", "collectives", "dispatch", "cp_exchange")


def recompute_ops(m: ModelConfig, s: Shape, policy: str, sparse: bool = False, deferred: bool = False) -> list[Op]:
    """What backward recomputes for one recomputed layer under ``policy`` (a recomputation label without ``/N``):
    every forward op (``full``), the attention core and its cp exchange (``attention``), or selective's modules and
    the cheap work between them. ``deferred``: the layer's linear GEMMs defer their weight gradients
    (parallel/wgrad.py, zb past stage 0), whose saved tensors are packed after the GEMM runs."""
    name, modules, _ = parse_label(policy)
    parts = layer_parts(m, s, sparse)
    if name == "full":
        chosen = list(parts)
    elif name == "attention":
        chosen = ["attn_core", "cp_exchange"]
    elif name == "selective":
        chosen = [*_ALWAYS, *modules] + (["mlp_act"] if "mlp" in modules else [])
    else:
        return []
    again = [o.in_phase("I") for part in dict.fromkeys(chosen) for o in parts[part] if o.phase == "F"]
    if name == "full" and not sparse:
        again = _early_stopped(again, parts, deferred)
    if "attn_core" not in chosen:  # the core's kernels are kept: the ring's messages rerun with nothing to hide behind
        again = [_alone(o) for o in again]
    work = [Op("framework", "I", ("recompute",), 0.0, 1)]  # and the checkpoint's own work (cost.py)
    if name == "selective":  # and its dispatch mode's, on every op of the forward and of the recomputation
        forward = [o for part in parts.values() for o in part if o.phase == "F"]
        work += [*_under_selective(forward, "F"), *_under_selective(again, "I")]
    return [*work, *again]


def _early_stopped(again: list[Op], parts: dict[str, list[Op]], deferred: bool = False) -> list[Op]:
    """A dense layer's forward recomputed whole, less what comes after the last tensor its backward saved: torch's
    non-reentrant checkpoint (models/checkpointing.py) stops recomputing there, so the MLP's output projection, the
    collective leaving its tp region and the last residual add are not run again (the matmuls checked against
    torch's count of a real backward: tests/test_plan_ops_flops.py). A ``deferred`` projection saves its tensors
    after its GEMM (an autograd.Function's, parallel/wgrad.py): that GEMM is run again."""
    down = next(o for o in reversed(parts["mlp"]) if o.phase == "F").in_phase("I")
    residual = parts["residual"][0].in_phase("I")
    out = list(again)
    if not deferred:
        out.remove(down)
    for i, o in enumerate(out):
        leaving = o.kind == "collective" and o.shape[:2] in (("all_reduce", "tp"), ("reduce_scatter", "tp"))
        if leaving:  # one message of the count fewer; each is nbytes
            out[i] = dataclasses.replace(o, count=o.count - 1)
        elif o == residual:  # one kernel fewer, its share of the bytes
            out[i] = dataclasses.replace(o, count=o.count - 1, nbytes=o.nbytes * (o.count - 1) / o.count)
    return [o for o in out if o.count > 0]


def _under_selective(ops: list[Op], phase: str) -> list[Op]:
    """What selective checkpointing's dispatch mode adds to ``ops`` (models/checkpointing.py: a Python policy on
    every op, its output cached or replayed): a ``("selective",)`` framework op per kernel (cost.py: the profile's
    seconds per op), and for cp's bookkeeping (its framework ops, whose many small ops go through the mode too) one
    ``("selective:cp", <its key>)`` per count, priced as a measured fraction of that bookkeeping's time."""
    kernels = sum(o.count for o in ops if o.kind in ("matmul", "attention", "elementwise"))
    out = [Op("framework", phase, ("selective",), 0.0, kernels)] if kernels else []
    cp = [o for o in ops if o.kind == "framework" and o.shape[0].startswith("cp:")]
    return out + [Op("framework", phase, ("selective:cp", *o.shape), 0.0, o.count) for o in cp]


def _alone(op: Op) -> Op:
    """``op``, a ring step's message marked to overlap nothing (its pass ``alone``), if it is one."""
    if op.kind == "collective" and op.shape[0] == "ring":
        return dataclasses.replace(op, shape=(*op.shape[:3], "alone"))
    return op


def embedding_ops(m: ModelConfig, s: Shape) -> list[Op]:
    """The first chunk's token lookup (and learned positions): vocab-parallel at tp > 1 (a mask, the lookup, and the
    sum over tp); its backward scatters into the table's gradient, which it zeroes first."""
    d, e, t = m.d_model, s.e, s.tokens
    rows = padded_vocab_size(m.vocab_size, m.vocab_multiple, s.tp) // s.tp
    ops = [
        Op("elementwise", "F", (), t * d * e + (3 * t * 8 if s.tp > 1 else 0), 1 + (3 if s.tp > 1 else 0)),
        Op("elementwise", "W", (), rows * d * e + 2 * t * d * e, 2),
    ]
    if m.position == "learned":
        ops += _elementwise(4 * t * d * e, 2)
    if s.tp > 1:
        op = "reduce_scatter" if s.sequence_parallel else "all_reduce"
        ops.append(Op("collective", "F", (op, "tp"), t * d * e))
        if s.sequence_parallel:
            ops.append(Op("collective", "I", ("all_gather", "tp"), t * d * e))
    return ops


def head_ops(m: ModelConfig, s: Shape) -> list[Op]:
    """The last chunk's final norm, LM head on this rank's vocab block and the vocab-parallel cross entropy: the
    fp32 logits read and written about six times forward (cast, max, exp, sum, log, pick) and four backward; at
    tp > 1 three all-reduces of [T] floats (max, sum, target logit)."""
    d, e, t = m.d_model, s.e, s.tokens
    t_sp = t // (s.tp if s.sequence_parallel else 1)
    # At tp = 1 the head drops the padding rows (parallel/tensor.py ``logits``); a tp rank's block keeps them.
    vocab = m.vocab_size if s.tp == 1 else padded_vocab_size(m.vocab_size, m.vocab_multiple, s.tp) // s.tp
    logits = t * vocab * 4
    ops = _elementwise(2 * t_sp * d * e, 1) + _linear(s, vocab, d, fp8=False)  # the head stays 16-bit
    ops += [Op("elementwise", "F", (), 4 * logits, 4), Op("elementwise", "I", (), 3 * logits, 3)]
    ops += [
        Op("elementwise", "F", ("transcendental",), 2 * logits, 2),
        Op("elementwise", "I", ("transcendental",), logits, 1),
    ]
    if s.tp > 1:
        ops.append(Op("collective", "F", ("all_reduce", "tp"), t * 4, 3))
        if s.sequence_parallel:
            ops += [
                Op("collective", "F", ("all_gather", "tp"), t * d * e),
                Op("collective", "I", ("reduce_scatter", "tp"), t * d * e),
            ]
        else:
            ops.append(Op("collective", "I", ("all_reduce", "tp"), t * d * e))
    return ops


def chunk_ops(
    m: ModelConfig,
    s: Shape,
    layers: int,
    first: bool,
    last: bool,
    policy: str,
    recomputed: int | None = None,
    sparse: tuple[int, int] = (0, 0),
    deferred: bool = False,
) -> list[Op]:
    """One micro-batch through a chunk of ``layers`` layers (with the embedding on the first chunk, the head and
    loss on the last), ``recomputed`` of them (default: all) under recomputation ``policy``; ``sparse``: how many
    of the layers, and of the recomputed ones, are mixture-of-experts layers; ``deferred``: ``recompute_ops``'."""
    recomputed = layers if recomputed is None else recomputed
    ops = [o.times(layers - sparse[0]) for o in layer_ops(m, s)]
    ops += [o.times(sparse[0]) for o in layer_ops(m, s, sparse=True)] if sparse[0] else []
    if recomputed - sparse[1]:
        ops += [o.times(recomputed - sparse[1]) for o in recompute_ops(m, s, policy, deferred=deferred)]
    if sparse[1]:
        ops += [o.times(sparse[1]) for o in recompute_ops(m, s, policy, sparse=True)]
    if first:
        ops += embedding_ops(m, s)
    if last:
        ops += head_ops(m, s)
    return ops
