"""Model states predicted: parameters, gradients and optimizer states, and the transient buffers above them.

A rank's parameters (trident/memory/params.py) are laid out in the flat buffers as the runtime lays them out, with
the reducer's buckets and their padding to a multiple of dp (trident/build.py ``flat_layout``, parallel/layout.py; a
tied embedding and its copy isolated in buckets of their own under pp > 1), then held as each ZeRO stage holds them
(``model_states``). With Psi parameters and N dp ranks this is the ZeRO paper's accounting (Rajbhandari et al.,
2020: 16 Psi in 16-bit training, 4 Psi + 12 Psi / N at stage 1, 2 Psi + 14 Psi / N at stage 2, 16 Psi / N at stage
3) made exact: padding, the gradient buffer's fp32 even for 16-bit parameters, Adam's per-tensor step counters,
buffers a stage keeps whole. tests/test_memory.py checks it to the byte against real ranks (memory.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trident.layout import Layout
from trident.memory.activations import stage_actions
from trident.memory.measure import KINDS, PLACES, Figures
from trident.memory.params import StageParams
from trident.models.matrices import matrices_of
from trident.parallel.layout import FlatLayout
from trident.parallel.pipeline.schedules import SPLIT_BACKWARD, I, W
from trident.parallel.placement import is_expert, placement_of
from trident.parallel.precision import precision_policy
from trident.parallel.zero.grads import ShardedGradReducer
from trident.parallel.zero.optimizer import shard_segments

FP32 = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32, one element each per parameter element
MUON_MOMENTS = 1  # momentum_buffer, fp32, per element of a matrix Muon steps (no step counter)
STEP_COUNTER = 4  # AdamW's per-tensor step: a float32 scalar


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

    figures: Figures  # kind -> place -> bytes, as ``measure.measure_model_states`` measures them
    staging: int  # stages 2-3: fp32 staging of the bucket filling and those in flight (the largest ones)
    gathered: int  # stage 3: the most full buffers gathered at once, in the parameter dtype (``_gathered``)
    checkpoint: int  # what the rank's checkpoint holds: fp32 masters and moments of its shard, a step per piece
    optimizer_step: int = 0  # Muon: the largest matrix parameter put together whole (fp32 U, its NS result)


def model_states(params: StageParams, layout: Layout, dp_rank: int | None = None) -> ModelStates:
    """Bytes of parameters, gradients and optimizer states that dp rank ``dp_rank`` (None: the largest) holds for
    a stage's ``params`` in the flat layout trident/build.py lays them out in (``StageParams.flat``), held as its
    optimizer holds them. B is the flat layout's numel (parameters plus bucket padding), S the shards (dp x cp at
    stages 1-3, else 1), p the parameter dtype's bytes. Every stage, 0 included, is ZeRO's optimizer over this
    rank's 1/S of every bucket, cut into pieces per parameter:

                          parameters  p B (stages 0-2: one flat buffer), p B / S (stage 3: the shards)
                          gradients   4 B (stages 0-1: the reducer's buffer), 4 B / S (stages 2-3: the shard)
                          masters     4 B / S in fp32 (none where fp32 parameters are their own masters)
                          moments     2 x 4 per parameter element of the shard (padding has none), a step per piece
        offload ratio r   the shard's first round(r x its numel) elements keep masters and moments on the host, and a
                          host copy of their gradients (4 bytes each)

    Transient, above these: stages 2-3 stage each bucket's fp32 gradients while it fills and until its
    reduce-scatter is waited for; ``staging`` bounds it by the largest buckets that can be held at once: those
    filling (at stage 2 two, where one bucket ends and the next begins; at stage 3 a block and the root, which fills
    from backward's first gradient to its last) and MAX_IN_FLIGHT = 2 in flight (under gradient accumulation, maybe
    another micro-batch's copies of those filling). Stage 3 gathers a block's parameters while it runs
    (``gathered``: the roots and 1 + ``zero3_prefetch`` blocks, the running and the prefetched; every bucket with
    ``zero3_gather=step``).
    """
    flat, chunk_units = params.flat(layout)
    ranks = range(layout.grad_ranks if layout.zero >= 1 else 1) if dp_rank is None else [dp_rank]
    # Stage 3: each chunk's (its blocks' bucket numels, its root buckets' numels).
    units = [([s.numel for s in u.blocks], [s.numel for s in u.root]) for u in chunk_units]
    # Compiled blocks (torch's split, rerunning the backward graph) stay gathered from I to W, but for stage 0's (I is
    # all of it); an eager chunk's W reads no weight (parallel/zero/stage3.py, release_after_input).
    held = [layout.compiled and layout.schedule in SPLIT_BACKWARD and not c.is_first for c in params.chunks]
    muon = muon_params(params.chunks) if layout.optimizer == "muon" else {}
    states = (_rank_states(flat, layout, r, units, held, params.stage, muon) for r in ranks)
    return max(states, key=lambda s: sum(s.figures["total"].values()))


def _gathered(
    layout: Layout, flat: FlatLayout, units: list[tuple[list[int], list[int]]], held: list[bool], stage: int
) -> int:
    """Stage 3's most full-buffer elements gathered at once (parallel/zero/stage3.py): in step mode every bucket;
    else every chunk's root (held while any micro-batch is in flight) and the running block of one chunk with the
    ``zero3_prefetch`` next ones; and a ``held`` chunk (off stage 0 under zb-h1 and zb-v) keeps every block from an I
    to its W, found by walking the rank's actions (``stage_actions``): zb-h1 delays its W, so every bucket; zb-v runs
    most W right after their I."""
    if layout.zero3_gather == "step":
        return flat.numel
    roots = sum(sum(root) for _, root in units)
    running = [sum(sorted(blocks, reverse=True)[: 1 + layout.zero3_prefetch]) for blocks, _ in units]
    if not any(held):
        return roots + max(running)
    whole = [sum(blocks) for blocks, _ in units]
    pending = [0] * len(units)  # per chunk, the I passes whose W has not run
    peak = 0
    for a in stage_actions(layout, stage):
        if a.kind == I and held[a.chunk]:
            pending[a.chunk] += 1
        kept = sum(w for w, p in zip(whole, pending, strict=True) if p)
        peak = max(peak, kept + (0 if pending[a.chunk] else running[a.chunk]))
        if a.kind == W and held[a.chunk]:
            pending[a.chunk] -= 1
    return roots + peak


def _rank_states(
    flat: FlatLayout,
    layout: Layout,
    dp_rank: int,
    units: list[tuple[list[int], list[int]]],
    held: list[bool],
    stage: int,
    muon: dict,
) -> ModelStates:
    fig = _figures()
    pb = precision_policy(layout.precision).param_dtype.itemsize
    ratio = layout.offloaded_fraction

    shards = layout.grad_ranks if layout.zero >= 1 else 1  # ZeRO shards over dp x cp
    rank = dp_rank if layout.zero >= 1 else 0
    # Expert weights (ep > 1, buckets of their own) are sharded over their expert-dp group: dp / ep ranks.
    expert = (rank // layout.ep, shards // layout.ep) if layout.ep > 1 and shards > 1 else None
    shard = sum(s.numel // (expert[1] if expert and is_expert(s.params[0]) else shards) for s in flat.spans)
    host_numel = round(ratio * shard)
    fig["params"]["device"] = (shard if layout.zero == 3 else flat.numel) * pb
    fig["grads"]["device"] = (shard if layout.zero >= 2 else flat.numel) * FP32
    fig["grads"]["host"] = host_numel * FP32
    fig["optimizer"]["host"] = host_numel * FP32
    if pb != FP32:
        fig["optimizer"]["device"] = (shard - host_numel) * FP32
    checkpoint = 0
    for span, start, stop, on_host in shard_segments(flat, rank, shards, host_numel, expert):
        pieces = flat.pieces(span, start, stop)
        place = "host" if on_host else "device"
        for p in pieces:  # Muon's matrices: a momentum; AdamW's: two moments and a step counter
            moments, counter = (MUON_MOMENTS, 0) if p.param in muon else (ADAM_MOMENTS, STEP_COUNTER)
            fig["optimizer"][place] += p.numel * moments * FP32 + counter
            checkpoint += p.numel * (1 + moments) * FP32 + counter
    staging = gathered = 0
    if layout.zero >= 2:
        largest = sorted((s.numel for s in flat.spans), reverse=True)
        in_flight = sum(largest[: ShardedGradReducer.MAX_IN_FLIGHT])
        if layout.zero == 2:  # filling: two buckets at most, where one ends and the next begins
            staging = (sum(largest[:2]) + in_flight) * FP32
        else:  # filling: a chunk's block, and its root from backward's first gradient (final norm) to its last
            filling = max(sum(root) + max(blocks, default=0) for blocks, root in units)
            staging = (filling + in_flight) * FP32
            gathered = _gathered(layout, flat, units, held, stage) * pb
    # Muon's step: a parameter's update whole in fp32 and its Newton-Schulz result (bf16), one parameter at a time.
    whole = max((math.prod(placement_of(p).shape) for p in muon), default=0)
    return ModelStates(_place(_total(fig), layout), staging, gathered, checkpoint, whole * (FP32 + 2))


def muon_params(chunks: list) -> dict:
    """The parameters of ``chunks`` Muon steps (trident/optim.py ``muon_plan``'s rule: models/matrices.py)."""
    return {
        p: m
        for chunk in chunks
        for name, p in chunk.named_parameters()
        if (m := matrices_of(name, placement_of(p).shape, chunk.cfg)) is not None and placement_of(p).tied_to is None
    }
