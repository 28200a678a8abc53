"""The step-time model: a layout's step, priced from a machine's profile (trident/plan/profile.py).

    compute      every op of a micro-batch's pass through a chunk (trident/plan/ops.py) at the profile's rates:
                 matmuls by shape and dtype, attention, element-wise ops by bytes and kernel count
    tp           the collectives inside each pass, by bytes and group size (not overlapped: the next op needs them),
                 at what the calibration measured each to cost amid compute where it did (``amid_time``: on cores
                 shared by more ranks than they have, a rank at a collective waits for peers not yet run)
    cp           a rank's ``seq / cp`` tokens through every op, its share of the causal attention pairs, and the
                 exchange of keys and values of each layer over the cp group (trident/plan/ops.py ``_cp_exchange``):
                 allgather's and ulysses' collectives exposed, the ring's steps only where a step's message
                 outlasts the attention of the block it overlaps
    comm CPU     on a CPU, what each of those collectives and messages costs the cores the ranks share (measured:
                 ``Profile.collective_cpu``) is compute of the pass that meets it, stretched by sharing as the rest;
                 only what is left of its time beyond that is waited for (``comm_cpu``)
    framework    work no op is, per cp pass (the ring's per quarter), layer recomputed and action of zb's split
                 backward (``Profile.overheads``, measured on the model's tiny twin: trident_dev/plan/residual.py)
    pipeline     the schedule's own action lists run with these costs (trident/plan/simulate.py), the p2p message of
                 each stage boundary on the link between the two ranks (its CPU on the actions that send and receive
                 it); the bubble is what the simulation leaves idle
    sharing      ranks that share a node's cores share their compute: k busy ranks of ``threads`` threads on C cores
                 each run at min(1, C / (k threads)) of a lone rank's speed
    dp / ZeRO    the gradient reduction as the reducer runs it: buckets (``parallel.bucket_mb``) start as backward
                 fills them during the last micro-batch's backward and queue on the dp x cp group (the ranks
                 holding the same parameters: ``Layout.grad_ranks``, over which ZeRO also shards); under pipelines each
                 chunk's buckets fill during its own last backward (zb-h1: its last W) in the simulated schedule
                 and queue behind the earlier chunks'. ZeRO 1-3 add the all-gather of the updated parameters,
                 ZeRO 2 reduces every micro-batch, ZeRO 3 gathers each block around its forward and backward
                 (``parallel.zero3_gather=micro_batch``) or once a step (``step``), ``zero3_prefetch`` blocks ahead
    optimizer    AdamW over the rank's shard at the device's rate, its offloaded part at the host's, with the
                 gradient and parameter copies between them; under Muon (``optim.name=muon``) also Newton-Schulz
                 on every hidden matrix, spread over the stage's ranks, at the bf16 peak, and each matrix
                 parameter's update summed onto its owner and its result broadcast back (``muon_work``)

No term is fitted to a layout the planner ranks: every rate is a measurement of the machine (``--calibrate``) or a
datasheet figure, the framework's overheads are fitted to held-out runs of the model's tiny twin, and the step is
scaled by one held-out run's measured over modelled step (trident_dev/plan/residual.py; 1 for a datasheet).
The file is one idea read top to bottom (one step of one layout, term by term, as the list above orders them),
so it stays whole past ~400 lines.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from trident.config import ModelConfig
from trident.layout import Layout
from trident.memory.activations import stage_actions
from trident.memory.params import _key, chunk_params, stage_params
from trident.memory.states import muon_params
from trident.models.checkpointing import recomputed_layers
from trident.parallel.pipeline.schedules import (
    SPLIT_BACKWARD,
    Action,
    holder_of,
    makes_weight_grads,
    stage_of,
    stage_placement,
)
from trident.parallel.placement import is_expert, placement_of
from trident.plan import simulate
from trident.plan.ops import BYTES, Op, Shape, chunk_ops, embedding_ops, head_ops, layer_ops, recompute_ops
from trident.plan.profile import (
    AMID_LONG_SEGMENT_S,
    AMID_SEGMENT_S,
    Needs,
    Profile,
    attention_key,
    collective_key,
    matmul_key,
)

# The op class (``Pricer.ops``' ``into``) of what the passes' collectives cost the shared cores: in a profiled step
# that is time in them, so the split counts it as communication in the passes.
COMM_CPU = "comm cpu"
SPLIT = ("I", "W")  # the actions of zb's split backward


@dataclass(frozen=True)
class RankPlacement:
    """Where a launch's ranks sit: how many per node, and the threads and cores they share there."""

    world: int
    ranks_per_node: int
    threads: int = 1
    cores: int = 1  # compute units per node (a GPU node: its GPUs; a CPU: its cores)
    capacity: float = 0.0  # what all the node's ranks computing at once get together, in lone ranks' worth (0: cores)
    # Measured (a calibration's ``Profile.sharing``): what k of the node's ranks computing at once get together, in
    # lone ranks' worth, k = 1, 2, ... ranks_per_node. Empty: ``capacity`` and the cores.
    sharing: tuple[float, ...] = ()

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.ranks_per_node)

    def spans_nodes(self, stride: int, size: int) -> bool:
        """Whether a group of ``size`` ranks ``stride`` apart (tp: 1; dp: tp; pp: dp x tp) crosses a node."""
        if size <= 1:
            return False
        return stride * (size - 1) >= self.ranks_per_node or (
            self.ranks_per_node % stride != 0 and stride * size > self.ranks_per_node
        )

    def share(self, busy: int) -> float:
        """Each of ``busy`` ranks' speed (a lone rank's is 1) when they compute at once on one node: what the
        calibration measured ``busy`` ranks to get together (``sharing``), split between them. Without that
        measurement: 1 while they fit the cores; past that they split what the node gives, which falls from the
        cores' worth to the measured ``capacity`` as the ranks grow to all of the node's."""
        if 1 <= busy <= len(self.sharing):
            return min(1.0, self.sharing[busy - 1] / busy)
        slots = self.cores / self.threads
        if busy <= slots:
            return 1.0
        full = self.capacity or slots
        if self.ranks_per_node <= slots:
            return slots / busy
        together = slots + (min(busy, self.ranks_per_node) - slots) / (self.ranks_per_node - slots) * (full - slots)
        return together / busy


def flops_matmul(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def flops_attention(b: int, heads: int, seq: int, dh: int, kind: str) -> float:
    """Causal attention: QK^T and PV on half the score matrix forward, two and a half times that backward."""
    fwd = 2 * 2 * b * heads * seq * seq * dh / 2
    return fwd if kind == "fwd" else 2.5 * fwd


def collective_time(p: Profile, op: str, group: int, nbytes: float, across_nodes: bool) -> float:
    """One ``op`` of ``nbytes`` (the whole tensor: all-reduced, gathered or scattered; an all-to-all's: each rank's)
    over ``group`` ranks: the measured rate of that group size, or the ring algorithm over the link (NCCL's: 2 (n-1)
    / n of the bytes for an all-reduce, (n-1) / n for an all-gather, reduce-scatter or all-to-all, (n-1) or 2 (n-1)
    hops of latency)."""
    if group <= 1:
        return 0.0
    measured = p.collectives.get(collective_key(op, group))
    if measured is not None and not across_nodes:
        return measured.time(nbytes)
    link = p.inter if across_nodes else p.intra
    if op == "p2p":
        return link.time(nbytes)
    hops = (2 if op == "all_reduce" else 1) * (group - 1)
    return hops * link.latency + hops / group * nbytes / link.bandwidth


def amid_time(
    p: Profile, op: str, group: int, nbytes: float, across_nodes: bool, segment: float | None = None
) -> float:
    """One ``op`` that the passes meet between two stretches of compute (tensor, context and expert parallelism's
    collectives, ZeRO 3's gathers, a pipeline's messages): the calibration's rate for it amid compute
    (``Profile.amid``: on shared cores a rank there waits for peers the scheduler has not run), else
    ``collective_time``. ``segment``: a lone rank's seconds of compute before it, where known: between the rates
    measured after ``AMID_SEGMENT_S`` and ``AMID_LONG_SEGMENT_S`` of it (``Profile.amid_long``), straight in between,
    the nearer one's outside (the longer a rank computes, the likelier its peer was stopped in mid-stretch), never
    below the shorter one's."""
    key = collective_key(op, group)
    measured = p.amid.get(key) if group > 1 and not across_nodes else None
    if measured is None:
        return collective_time(p, op, group, nbytes, across_nodes)
    short = measured.time(nbytes)
    longer = p.amid_long.get(key)
    if segment is None or longer is None:
        return short
    at = min(1.0, max(0.0, (segment - AMID_SEGMENT_S) / (AMID_LONG_SEGMENT_S - AMID_SEGMENT_S)))
    return short + at * max(0.0, longer.time(nbytes) - short)


def comm_cpu(p: Profile, placement: RankPlacement, op: str, group: int, nbytes: float) -> tuple[float, float]:
    """What one ``op`` of ``nbytes`` over ``group`` ranks takes from the cores a CPU node's ranks share
    (``Profile.collective_cpu``: its process's CPU seconds, measured with every rank of the node at it): (as lone
    compute, which the pipeline's simulation stretches by the ranks computing at once; its wall seconds when all
    the node's ranks run, which a rate measured amid compute already holds). (0, 0) where not measured: a GPU's."""
    rate = p.collective_cpu.get(collective_key(op, group)) if group > 1 else None
    if rate is None:
        return 0.0, 0.0
    ranks = min(placement.world, placement.ranks_per_node)
    slots = max(1.0, placement.cores / placement.threads)
    wall = rate.time(nbytes) * max(1.0, ranks / slots)  # each rank gets slots / ranks of a core
    return wall * placement.share(ranks), wall


@dataclass
class Pricer:
    """Prices ops with one profile and precision; remembers the matmul and attention shapes it was asked for."""

    profile: Profile
    precision: str
    placement: RankPlacement
    tp_across_nodes: bool = False
    cp: int = 1
    cp_across_nodes: bool = False
    needs: Needs = field(default_factory=Needs)
    ep: int = 1
    ep_across_nodes: bool = False

    @property
    def flags(self) -> tuple:
        """What prices a collective besides its op: each group's size and whether it crosses a node."""
        return (self.tp_across_nodes, self.cp, self.cp_across_nodes, self.ep, self.ep_across_nodes)

    def matmul(self, m: int, n: int, k: int, layout: str = "nn", low: str | None = None) -> float:
        if low is not None:  # an FP8 GEMM (train.fp8): at the profile's FP8 peak, never a calibrated 16-bit time
            floor = self.profile.elementwise.time((m * k + k * n) * BYTES[low] + m * n * BYTES[self.precision])
            return max(floor, flops_matmul(m, n, k) / (self.profile.peak(low) * self.profile.matmul_efficiency))
        self.needs.matmuls.add((self.precision, m, n, k, layout))
        measured = self.profile.matmuls.get(matmul_key(self.precision, m, n, k, layout))
        if measured is not None:
            return measured
        e = BYTES[self.precision]
        floor = self.profile.elementwise.time((m * k + k * n + m * n) * e)  # at least its operands' traffic
        return max(floor, flops_matmul(m, n, k) / (self.profile.peak(self.precision) * self.profile.matmul_efficiency))

    def attention(self, b: int, heads: int, kv: int, seq: int, dh: int, kind: str) -> float:
        self.needs.attention.add((self.precision, b, heads, kv, seq, dh))
        measured = self.profile.attention.get(attention_key(self.precision, b, heads, kv, seq, dh, kind))
        if measured is not None:
            return measured
        rate = self.profile.peak(self.precision) * self.profile.attention_efficiency
        return flops_attention(b, heads, seq, dh, kind) / rate

    def op(self, op: Op, tp: int, segment: float | None = None) -> tuple[float, float]:
        """(compute, communication) seconds of ``op``: its kernels at the profile's rates, times the framework's
        measured overhead on them; a collective amid compute, after ``segment`` seconds of it (``amid_time``): the
        CPU it costs the shared cores (``comm_cpu``) as compute, the rest of its time as communication."""
        if op.kind == "collective":
            name, axis, *ring = op.shape
            group, across = {
                "tp": (tp, self.tp_across_nodes),
                "cp": (self.cp, self.cp_across_nodes),
                "ep": (self.ep, self.ep_across_nodes),
            }[axis]
            self.needs.groups.add(group)
            if name == "ring":  # each step's message behind the attention of the block held meanwhile
                self.needs.groups.add(2)
                message = amid_time(self.profile, "p2p", 2, op.nbytes, across, segment)
                cpu, cpu_wall = comm_cpu(self.profile, self.placement, "p2p", 2, op.nbytes)
                block, kind = ring
                # the dK/dV's trip home overlaps nothing, nor a step recomputed without its block's kernels
                hidden = 0.0 if kind in ("home", "alone") else self.attention(*block, kind) * self.profile.framework
                hidden += self.profile.dispatch
                return op.count * cpu, op.count * max(0.0, message - cpu_wall - hidden)
            cpu, cpu_wall = comm_cpu(self.profile, self.placement, name, group, op.nbytes)
            wait = amid_time(self.profile, name, group, op.nbytes, across, segment)
            return op.count * cpu, op.count * max(0.0, wait - cpu_wall)
        return self.kernels(op) * self.profile.framework + op.count * self.profile.dispatch, 0.0

    def kernels(self, op: Op) -> float:
        """Seconds of a compute op's kernels alone (a ``framework`` op's: the profile's measured figure for it)."""
        if op.kind == "framework":
            overheads = self.profile.overheads
            if op.shape[0] == "selective:cp":  # cp's bookkeeping under selective checkpointing: a fraction more
                return op.count * overheads.get("selective:cp", 0.0) * overheads.get(op.shape[1], 0.0)
            return op.count * overheads.get(op.shape[0], 0.0)
        if op.kind == "matmul":
            return op.count * self.matmul(*op.shape)
        if op.kind == "attention":
            return op.count * self.attention(*op.shape, "fwd" if op.phase == "F" else "bwd")
        heavy = op.shape == ("transcendental",) and self.profile.transcendental is not None
        rate = self.profile.transcendental if heavy else self.profile.elementwise
        assert rate is not None
        return op.count * rate.latency + op.nbytes / rate.bandwidth

    def ops(
        self,
        ops: Iterable[Op],
        tp: int,
        phases: str,
        into: dict[str, float] | None = None,
        least: bool = False,
    ) -> tuple[float, float]:
        """(compute, communication) seconds of the ``ops`` of ``phases``; ``into`` sums their kernels' seconds by op
        class (matmul, attention, elementwise: what a profiled step splits, trident_dev/plan/breakdown.py). ``least``:
        each collective at what it costs after the least compute (``amid_time`` without a segment), a lower bound of
        its cost among any other ops, so that ops priced apart add up to at most their price together."""
        compute = comm = 0.0
        collectives = []
        for o in ops:
            if o.phase not in phases:
                continue
            if o.kind == "collective":
                collectives.append(o)
                continue
            if o.kind == "framework":  # the framework's work itself: neither scaled as kernels nor dispatched
                compute += self.kernels(o)
                continue
            k = self.kernels(o)
            compute += k * self.profile.framework + o.count * self.profile.dispatch
            if into is not None:
                into[o.kind] = into.get(o.kind, 0.0) + k
        # Each collective after its share of the pass's compute: the compute between two of them.
        segment = None if least else compute / max(1, sum(o.count for o in collectives))
        for o in collectives:
            cpu, wait = self.op(o, tp, segment)
            compute, comm = compute + cpu, comm + wait
            if into is not None and cpu:
                into[COMM_CPU] = into.get(COMM_CPU, 0.0) + cpu
        return compute, comm


@dataclass
class StepTime:
    """A layout's predicted step, in seconds, with what it is made of."""

    step: float  # the model's, scaled by the profile's held-out residual (its parts below are not)
    pipeline: float  # from the step's start to the last backward of the slowest rank
    compute: float  # compute of one rank over the step (its busy time, without communication)
    bubble: float  # fraction of the pipeline ranks' time idle in the schedule
    tp_comm: float  # tensor- and context-parallel collectives of one rank over the step (the ring's exposed part)
    p2p: float  # pipeline messages on the critical path (their sum on one rank, an upper bound)
    dp_comm: float  # gradient reduction and ZeRO gathers left exposed after the last backward
    optimizer: float  # the optimizer step, its offloaded part, the clip and the step's small all-reduces
    spans: list[simulate.TimedSpan] = field(default_factory=list, repr=False)
    # The step of the mean pipeline rank split as a profiled step is (trident_dev/plan/breakdown.py CATEGORIES).
    split: dict[str, float] = field(default_factory=dict, repr=False)


def _layers_per_chunk(m: ModelConfig, layout: Layout) -> int:
    return m.n_layers // (layout.pp * layout.vpp)


def ew_time(p: Profile, nbytes: float) -> float:
    """One memory-bound element-wise kernel moving ``nbytes``."""
    return p.elementwise.time(nbytes) * p.framework


def _stage_numel(m: ModelConfig, layout: Layout, stage: int, cache: dict | None) -> int:
    """Parameter elements a rank of ``stage`` holds (its gradient buffer's, before bucket padding)."""
    key = ("numel", layout.tp, layout.pp, layout.vpp, layout.ep, stage_placement(layout.schedule), stage)
    if cache is None or key not in cache:
        numel = stage_params(m, layout, stage).numel
        if cache is None:
            return numel
        cache[key] = numel
    return cache[key]


def _stage_expert_numel(m: ModelConfig, layout: Layout, stage: int, cache: dict | None) -> int:
    """Of ``_stage_numel``, the expert weights split over ep (0 at ep = 1): their gradients reduce, and ZeRO shards
    them, over the expert-data-parallel group, grad_ranks / ep ranks."""
    if layout.ep == 1:
        return 0
    key = ("experts", layout.tp, layout.pp, layout.vpp, layout.ep, stage_placement(layout.schedule), stage)
    if cache is None or key not in cache:
        chunks = stage_params(m, layout, stage).chunks
        numel = sum(p.numel() for chunk in chunks for p in chunk.parameters() if is_expert(p))
        if cache is None:
            return numel
        cache[key] = numel
    return cache[key]


def _dense_numel(m: ModelConfig, layout: Layout, chunk: int, cache: dict | None = None) -> int:
    """Parameter elements of model chunk ``chunk`` whose gradients reduce over dp x cp: all but the expert weights
    split over ep (``_stage_expert_numel``)."""
    placement = stage_placement(layout.schedule)
    key = ("dense", layout.tp, layout.pp, layout.vpp, layout.ep, layout.sequence_parallel, placement, chunk)
    if cache is not None and key in cache:
        return cache[key]
    rank, local = holder_of(chunk, layout.pp, placement)
    model = stage_params(m, layout, rank).chunks[local]
    numel = sum(p.numel() for p in model.parameters() if layout.ep == 1 or not is_expert(p))
    if cache is not None:
        cache[key] = numel
    return numel


def _dp_reduce(
    p: Profile, layout: Layout, numel: int, backward: float, across: bool, overlapped: bool, ranks: int | None = None
) -> float:
    """Seconds of the gradient reduction left after the backward that fills the buckets ends. The buckets
    (``bucket_mb`` of fp32 each) queue on the dp group (or ``ranks`` of it: the expert-dp group) in the order
    backward fills them; ``overlapped``: each starts once backward has filled it (spread evenly over ``backward``
    seconds), else all after it. A queue's last job ends at max over i of (arrival of i + service of i and every
    job after it)."""
    ranks = ranks or layout.grad_ranks
    if ranks == 1 or numel == 0:
        return 0.0
    op = "all_reduce" if layout.zero == 0 else "reduce_scatter"
    per_bucket = max(1, int(layout.bucket_mb * 2**20 / 4))
    full, rest = divmod(numel, per_bucket)
    sizes = np.array([per_bucket] * full + ([rest] if rest else []), dtype=np.float64)
    service = np.array([collective_time(p, op, ranks, 4 * n, across) for n in (per_bucket, rest)])
    times = np.full(len(sizes), service[0])
    if rest:
        times[-1] = service[1]
    ready = backward * np.cumsum(sizes) / sizes.sum() if overlapped else np.full(len(sizes), backward)
    after = np.cumsum(times[::-1])[::-1]
    return max(0.0, float(np.max(ready + after)) - backward)


def _chunk_reduce_end(p: Profile, layout: Layout, chunks: list[tuple[int, float, float]], across: bool) -> float:
    """When the gradient reduction of a pipeline rank ends (parallel/pipeline/executor.py): ``chunks`` holds, per model
    chunk, its parameter elements and the simulated span of its last weight-gradient action, during which its
    buckets fill (evenly) and start; the buckets queue on the dp group in that order, one at a time."""
    op = "all_reduce" if layout.zero == 0 else "reduce_scatter"
    per_bucket = max(1, int(layout.bucket_mb * 2**20 / 4))
    service: dict[int, float] = {}
    end = 0.0
    for numel, start, stop in sorted(chunks, key=lambda c: c[2]):
        full, rest = divmod(numel, per_bucket)
        filled = 0
        for n in [per_bucket] * full + ([rest] if rest else []):
            filled += n
            if n not in service:
                service[n] = collective_time(p, op, layout.grad_ranks, 4 * n, across)
            end = max(end, start + (stop - start) * filled / numel) + service[n]
    return end


def _weight_spans(spans: list[simulate.TimedSpan], rank: int, pp: int, where: str) -> dict[int, simulate.TimedSpan]:
    """Each chunk's last action on ``rank`` that produces its weight gradients (``makes_weight_grads``; ``where``:
    the schedule's stage placement)."""
    last = {}
    for s in spans:
        if s.rank == rank and makes_weight_grads(s.action, rank, pp, where):
            if s.action.chunk not in last or s.start > last[s.action.chunk].start:
                last[s.action.chunk] = s
    return last


def step_time(
    m: ModelConfig,
    layout: Layout,
    profile: Profile,
    placement: RankPlacement,
    needs: Needs | None = None,
    cache: dict | None = None,
) -> StepTime:
    """Predict one optimizer step of ``layout`` (trident/layout.py: dp, tp, pp, vpp, schedule, ZeRO, offload,
    recomputation, micro-batch) for model ``m`` on ``profile`` with ranks placed as ``placement``. ``needs``
    collects the shapes and group sizes it priced (what a calibration measures); ``cache`` keeps simulations for
    layouts that differ only in ZeRO stage and offload."""
    pricer = _pricer(layout, profile, placement, needs)
    pp, vpp, micro = layout.pp, layout.vpp, layout.micro_batches
    where = stage_placement(layout.schedule)  # how the chunks sit on the pipeline ranks
    key, walk = _walk(m, layout, profile, placement, pricer, cache)
    costs, spans, hop, ends = walk.costs, walk.spans, walk.hop, walk.ends
    zero3 = _zero3_gathers(m, layout, profile, placement, costs) if layout.zero == 3 else 0.0
    pipeline = max(ends)
    all_busy = placement.share(placement.ranks_per_node if placement.nodes > 1 else placement.world)

    # Gradient reduction: per pipeline rank, each chunk's behind its own last backward (pp > 1) or behind the last
    # micro-batch's backward (pp = 1); ZeRO 2 reduces every micro-batch.
    grads = layout.grad_ranks  # dp x cp: ranks of one pipeline and tp rank, consecutive ``tp`` apart
    dp_across = placement.spans_nodes(layout.tp, grads)
    step_end = 0.0
    expert_ranks = grads // layout.ep  # the expert-data-parallel group
    expert_across = expert_dp_across(layout, placement)
    for r in range(pp):
        # Expert weights (ep > 1) reduce over their own group once the dense buckets are done.
        experts = _stage_expert_numel(m, layout, r, cache)
        numel = _stage_numel(m, layout, r, cache) - experts
        backward = sum(costs[(stage_of(c, r, pp, where), "B")][0] for c in range(vpp)) / all_busy
        if pp == 1:
            tail = _dp_reduce(profile, layout, numel, backward, dp_across, overlapped=True)
        elif grads == 1:
            tail = 0.0
        else:
            # The queue's end is the same for every ZeRO stage reducing alike (all-reduce at 0, else reduce-scatter).
            reduced = ("reduce end", key, r, layout.zero == 0, layout.bucket_mb, dp_across)
            end = cache.get(reduced) if cache is not None else None
            if end is None:
                chunks = [
                    (_dense_numel(m, layout, stage_of(c, r, pp, where), cache), start, stop)
                    for c, start, stop in walk.weights[r]
                ]
                end = _chunk_reduce_end(profile, layout, chunks, dp_across)
                if cache is not None:
                    cache[reduced] = end
            tail = max(0.0, end - ends[r])
        if layout.zero >= 2 and micro > 1 and grads > 1:
            # ZeRO 2-3 reduce-scatter every micro-batch (into fresh staging buffers), pipelines or not. On a GPU
            # each overlaps the next micro-batch's work; a CPU's gloo does the reduction on the cores the ranks
            # compute on, so there it all adds up.
            staging = ew_time(profile, 4 * numel) / all_busy
            if profile.device == "cpu":
                tail += (micro - 1) * (amid_time(profile, "reduce_scatter", grads, 4 * numel, dp_across) + staging)
            else:
                forward = costs[(0, "F")][0] / all_busy
                per_micro = _dp_reduce(profile, layout, numel, backward + forward, dp_across, overlapped=True)
                tail += (micro - 1) * (per_micro + staging)
        if experts and expert_ranks > 1:
            tail += _dp_reduce(profile, layout, experts, 0.0, expert_across, overlapped=False, ranks=expert_ranks)
            pricer.needs.groups.add(expert_ranks)
        step_end = max(step_end, ends[r] + tail)
    if grads > 1:
        pricer.needs.groups.add(grads)
    if placement.world > 1 and placement.nodes == 1:
        pricer.needs.groups.add(placement.world)  # the step's scalar all-reduces
    dp_comm = step_end - pipeline + zero3

    optimizer_compute, optimizer_comm = _optimizer_time(m, layout, profile, placement, dp_across, all_busy, cache)
    optimizer = optimizer_compute + optimizer_comm
    step = step_end + zero3 + optimizer

    # What a held-out run measured beyond the model (trident_dev/plan/residual.py) scales the step and its split.
    split = _split_of(walk.ranks, pp, ends, step_end + optimizer_comm, optimizer_compute, zero3)
    return StepTime(
        step=step * profile.residual,
        pipeline=pipeline,
        compute=walk.loss_rank_spans[0],
        bubble=walk.bubble,
        tp_comm=walk.loss_rank_spans[1],
        p2p=hop * 2 * micro * vpp if pp > 1 else 0.0,
        dp_comm=dp_comm,
        optimizer=optimizer,
        spans=spans,
        split={kind: t * profile.residual for kind, t in split.items()},
    )


def _rank_split(
    spans: list[simulate.TimedSpan], costs: dict, kernels: dict, layout: Layout, sent: dict, overhead: float
) -> list[tuple[float, float, float, dict[str, float]]]:
    """The step split's part that reads the schedule's spans, per pipeline rank (``StepTime.split``, with
    ``_split_of``): (busy, communication, priced seconds, seconds by class), one pass over the spans (layouts that
    share a simulation share it)."""
    pp, where = layout.pp, stage_placement(layout.schedule)
    busy, comm, priced = [0.0] * pp, [0.0] * pp, [0.0] * pp
    classes: list[dict[str, float]] = [{} for _ in range(pp)]
    for s in spans:
        r = s.rank
        busy[r] += s.compute_end - s.start
        comm[r] += s.end - s.compute_end
        stage = stage_of(s.action.chunk, r, pp, where)
        message = sent.get((r, s.action), 0.0)
        priced[r] += costs[(stage, s.action.kind)][0] + message + (overhead if s.action.kind in SPLIT else 0.0)
        mine = classes[r]
        mine["pipeline wait"] = mine.get("pipeline wait", 0.0) + message
        for kind, t in kernels[(stage, s.action.kind)].items():
            mine[kind] = mine.get(kind, 0.0) + t
    return list(zip(busy, comm, priced, classes, strict=True))


def _split_of(
    ranks: list[tuple[float, float, float, dict[str, float]]],
    pp: int,
    ends: list[float],
    synced: float,
    optimizer: float,
    zero3: float,
) -> dict[str, float]:
    kinds = ("matmul", "attention", "elementwise", "framework", "core wait", "comm in passes", "pipeline wait")
    out = dict.fromkeys(kinds, 0.0)
    for r, (busy, comm, priced, classes) in enumerate(ranks):
        for kind, t in classes.items():
            out["comm in passes" if kind == COMM_CPU else kind] += t / pp
        out["framework"] += (priced - sum(classes.values())) / pp
        out["core wait"] += (busy - priced) / pp
        out["comm in passes"] += comm / pp
        out["pipeline wait"] += (ends[r] - busy - comm) / pp
    out["comm in passes"] += zero3
    out["dp + sync"] = synced - sum(ends) / pp
    out["optimizer"] = optimizer
    out["data"] = 0.0
    return out


class _Walk:
    """One simulated schedule and what every layout sharing it reads off its spans (they differ in ZeRO and
    offload only): each rank's end, and (read when a layout is timed) each chunk's last weight-gradient span per
    rank (its buckets fill there), the loss rank's compute and communication, the bubble, and the split's per-rank
    sums."""

    def __init__(
        self,
        costs: dict,
        spans: list[simulate.TimedSpan],
        hop: float,
        kernels: dict,
        sent: dict,
        layout: Layout,
        overhead: float,
    ) -> None:
        self.costs, self.spans, self.hop, self.kernels, self.sent = costs, spans, hop, kernels, sent
        self.layout, self.overhead = layout, overhead
        self.ends = simulate.rank_ends(spans, layout.pp)

    @functools.cached_property
    def weights(self) -> list[list[tuple[int, float, float]]]:
        pp, where = self.layout.pp, stage_placement(self.layout.schedule)
        out = []
        for r in range(pp if pp > 1 else 0):
            last = _weight_spans(self.spans, r, pp, where)
            out.append([(c, s.start, s.compute_end) for c, s in last.items()])
        return out

    @functools.cached_property
    def loss_rank_spans(self) -> tuple[float, float]:
        """The compute and communication of the rank of the last stage (the last pipeline rank, zb-v's first): it
        runs every micro-batch's loss."""
        loss_rank, _ = holder_of(self.layout.chunks - 1, self.layout.pp, stage_placement(self.layout.schedule))
        last = [s for s in self.spans if s.rank == loss_rank]
        return sum(s.compute_end - s.start for s in last), sum(s.end - s.compute_end for s in last)

    @functools.cached_property
    def bubble(self) -> float:
        return simulate.bubble(self.spans, self.layout.pp) if self.layout.pp > 1 else 0.0

    @functools.cached_property
    def ranks(self) -> list[tuple[float, float, float, dict[str, float]]]:
        return _rank_split(self.spans, self.costs, self.kernels, self.layout, self.sent, self.overhead)


def expert_dp_across(layout: Layout, placement: RankPlacement) -> bool:
    """Whether an expert-data-parallel group (every ep-th member of a dp x cp group, parallel/topology.py: ranks
    tp x ep apart) crosses a node."""
    return placement.spans_nodes(layout.tp * layout.ep, layout.grad_ranks // layout.ep)


def _pricer(layout: Layout, profile: Profile, placement: RankPlacement, needs: Needs | None = None) -> Pricer:
    pricer = Pricer(
        profile,
        layout.precision,
        placement,
        placement.spans_nodes(1, layout.tp),
        layout.cp,
        placement.spans_nodes(layout.tp, layout.cp),
        ep=layout.ep,
        # ep: runs of ep consecutive members of a dp x cp group (parallel/topology.py), whose members are tp apart
        ep_across_nodes=placement.spans_nodes(layout.tp, layout.ep),
    )
    if needs is not None:
        pricer.needs = needs
    return pricer


def _walk(
    m: ModelConfig, layout: Layout, profile: Profile, placement: RankPlacement, pricer: Pricer, cache: dict | None
) -> tuple[Layout, _Walk]:
    """The schedule's simulation of ``layout`` and its cache key: it does not depend on the ZeRO stage or offload,
    so layouts differing only in those share it."""
    key = dataclasses.replace(
        layout, zero=0, offload="none", offload_ratio=1.0, bucket_mb=0.0, zero3_gather="", zero3_prefetch=0
    )
    walk = cache.get(key) if cache is not None else None
    if walk is None:
        walk = _Walk(*_pipeline(m, layout, profile, placement, pricer), layout, profile.overheads.get("split", 0.0))
        if cache is not None:
            cache[key] = walk
    return key, walk


def pipeline_floor(
    m: ModelConfig,
    layout: Layout,
    profile: Profile,
    placement: RankPlacement,
    needs: Needs | None = None,
    cache: dict | None = None,
) -> float:
    """A lower bound of ``step_time(...).step`` shared by the layouts that differ in ZeRO and offload alone: the
    simulated schedule's last end (the reduction, ZeRO's gathers and the optimizer come after it), with the
    simulation kept in ``cache`` for ``step_time``."""
    _, walk = _walk(m, layout, profile, placement, _pricer(layout, profile, placement, needs), cache)
    return max(walk.ends) * profile.residual


def step_floor(
    m: ModelConfig, layout: Layout, profile: Profile, placement: RankPlacement, cache: dict | None = None
) -> float:
    """A lower bound of ``step_time(...).step``, at a fraction of its cost (no schedule is simulated, no parameter
    counted): a pipeline rank runs its actions one after another, each at least its compute (at the fastest
    speed sharing can give) and its communication, its first cannot start before the first micro-batch's forward
    has passed every stage below it, and (but under zb's split backward) the gradient of its last passes every
    stage below it after it. A chunk's passes are priced as the sum of their parts (a layer, a
    recomputed layer, the embedding, the head), each collective at its least cost (``Pricer.ops``' ``least``).
    What the bound leaves out costs time or nothing: the accumulation of gradients, zb's second recomputation,
    messages, the reduction, ZeRO's gathers, the optimizer. The planner times exactly only the layouts whose bound
    can still reach the best few. ``cache`` keeps the parts priced per micro-batch shape (every layout with that
    shape shares them)."""
    cache = cache if cache is not None else {}
    shape = _shape(m, layout)
    policy = layout.recompute.partition("/")[0]
    flags = (
        placement.spans_nodes(1, layout.tp),
        layout.cp,
        placement.spans_nodes(layout.tp, layout.cp),
        layout.ep,
        placement.spans_nodes(layout.tp, layout.ep),
    )
    key = ("floor", shape, policy, flags)
    if key not in cache:
        pricer = _pricer(layout, profile, placement)
        fastest = max([1.0, *(placement.share(k) for k in range(1, placement.world + 1))])

        def priced(ops: list[Op]) -> tuple[float, float]:
            """(forward, forward and backward) seconds of ``ops`` at their least."""
            f, i, w = (pricer.ops(ops, layout.tp, ph, least=True) for ph in ("F", "I", "W"))
            return f[0] / fastest + f[1], (f[0] + i[0] + w[0]) / fastest + f[1] + i[1] + w[1]

        cache[key] = {
            "layer": priced(layer_ops(m, shape)),
            "sparse": priced(layer_ops(m, shape, sparse=True)) if m.moe.enabled else (0.0, 0.0),
            "again": priced(recompute_ops(m, shape, policy)),
            "sparse again": priced(recompute_ops(m, shape, policy, True)) if m.moe.enabled else (0.0, 0.0),
            "embedding": priced(embedding_ops(m, shape)),
            "head": priced(head_ops(m, shape)),
        }
    parts = cache[key]
    pp, vpp = layout.pp, layout.vpp
    counted = ("counts", pp, vpp, layout.activation_checkpointing, layout.recompute_every)
    if counted not in cache:
        cache[counted] = _part_counts(m, layout)
    forward, both = [], []  # per stage: a micro-batch's forward, and its forward and backward, in seconds
    for counts in cache[counted]:
        forward.append(sum(k * parts[name][0] for name, k in counts))
        both.append(sum(k * parts[name][1] for name, k in counts))
    where = stage_placement(layout.schedule)
    # Without a split backward a rank's last action is a backward, after which the gradient still passes every
    # stage below it (at least those below the rank's first stage); zb's last actions may be weight passes.
    drains = layout.schedule not in SPLIT_BACKWARD
    worst = lead = 0.0  # lead: the stages below rank r, forward (and backward, where it drains)
    for r in range(pp):
        work = layout.micro_batches * sum(both[stage_of(c, r, pp, where)] for c in range(vpp))
        worst = max(worst, lead + work)
        lead += both[r] if drains else forward[r]
    return worst * profile.residual


def _part_counts(m: ModelConfig, layout: Layout) -> list[list[tuple[str, int]]]:
    """Per stage, how many of each part ``step_floor`` prices its chunk has (as ``_pipeline`` builds it)."""
    layers = _layers_per_chunk(m, layout)
    stages = layout.pp * layout.vpp
    out = []
    for stage in range(stages):
        held = range(stage * layers, (stage + 1) * layers)
        again_in = recomputed_layers(held, layout.activation_checkpointing, layout.recompute_every)
        sparse = (sum(map(m.moe.is_sparse, held)), sum(map(m.moe.is_sparse, again_in)))
        counts = {
            "layer": layers - sparse[0],
            "sparse": sparse[0],
            "again": len(again_in) - sparse[1],
            "sparse again": sparse[1],
            "embedding": int(stage == 0),
            "head": int(stage == stages - 1),
        }
        out.append([(name, k) for name, k in counts.items() if k])
    return out


def _shape(m: ModelConfig, layout: Layout) -> Shape:
    """One micro-batch on one rank of ``layout`` (its part of each sequence under cp)."""
    return Shape(
        layout.micro_batch_size,
        m.seq_len // layout.cp,
        layout.tp,
        layout.sequence_parallel,
        layout.precision,
        layout.cp,
        layout.cp_comm,
        layout.ep,
        layout.fp8,
    )


def _pipeline(
    m: ModelConfig, layout: Layout, profile: Profile, placement: RankPlacement, pricer: Pricer
) -> tuple[dict, list[simulate.TimedSpan], float, dict, dict]:
    """Per-stage action costs, the simulated schedule's spans, the p2p hop's seconds (what is left of it beyond its
    CPU), per-stage action kernels' seconds by op class, and per (rank, action) the CPU of its pipeline messages."""
    shape = _shape(m, layout)  # a rank's part of each sequence
    pp, vpp, micro = layout.pp, layout.vpp, layout.micro_batches
    layers = _layers_per_chunk(m, layout)
    stages = pp * vpp
    costs: dict[tuple[int, str], tuple[float, float]] = {}
    kernels: dict[tuple[int, str], dict[str, float]] = {}  # kernels' seconds by op class, per stage and action
    policy = layout.recompute.partition("/")[0]
    for stage in range(stages):
        held = range(stage * layers, (stage + 1) * layers)  # the chunk's global layers
        again_in = recomputed_layers(held, layout.activation_checkpointing, layout.recompute_every)
        recomputed = len(again_in)
        # The mixture-of-experts layers among them, and among the recomputed ones.
        sparse = (sum(map(m.moe.is_sparse, held)), sum(map(m.moe.is_sparse, again_in)))
        deferred = layout.schedule in SPLIT_BACKWARD and stage > 0  # parallel/wgrad.py
        ops = chunk_ops(m, shape, layers, stage == 0, stage == stages - 1, policy, recomputed, sparse, deferred)
        ops.append(_accumulate(m, layout, stage))
        by_class: dict[str, dict[str, float]] = {"F": {}, "I": {}, "W": {}}
        f, i, w = (pricer.ops(ops, layout.tp, ph, by_class[ph]) for ph in ("F", "I", "W"))
        # Under zb-h1 and zb-v a recomputed block is recomputed in I only: W is its linear layers' weight GEMMs from
        # what I kept (parallel/wgrad.py), no backward through the block.
        costs[(stage, "F")], costs[(stage, "I")], costs[(stage, "W")] = f, i, w
        costs[(stage, "B")] = (i[0] + w[0], i[1] + w[1])
        for kind in ("F", "I", "W"):
            kernels[(stage, kind)] = by_class[kind]
        kernels[(stage, "B")] = {
            c: by_class["I"].get(c, 0.0) + by_class["W"].get(c, 0.0) for c in set(by_class["I"]) | set(by_class["W"])
        }

    where = stage_placement(layout.schedule)

    e = BYTES[layout.precision]
    message = layout.micro_batch_size * shape.seq // (layout.tp if layout.sequence_parallel else 1) * m.d_model * e
    pp_across = placement.spans_nodes(layout.world // pp, 2) if pp > 1 else False
    hop = amid_time(profile, "p2p", 2, message, pp_across) if pp > 1 else 0.0
    # Each message's CPU (an exchange's, half on each side) is its actions' compute on the shared cores; what is left
    # of the hop is the transfer the receiving action waits for.
    exchange_cpu, exchange_wall = comm_cpu(profile, placement, "p2p", 2, message) if pp > 1 else (0.0, 0.0)
    sent: dict[tuple[int, Action], float] = {}
    if exchange_cpu:
        sent = {k: n * exchange_cpu / 2 for k, n in simulate.messages(layout.schedule, pp, vpp, micro).items()}
        hop = max(0.0, hop - exchange_wall)
    if pp > 1:
        pricer.needs.groups.add(2)

    # And each action of zb's split backward, torch's split of the graph around it (Profile.overheads).
    split = profile.overheads.get("split", 0.0)

    memo: dict[tuple[int, Action], tuple[float, float]] = {}  # the simulation asks for an action's cost twice

    def cost(rank: int, a: Action) -> tuple[float, float]:
        if (rank, a) not in memo:
            compute, comm = costs[(stage_of(a.chunk, rank, pp, where), a.kind)]
            memo[rank, a] = compute + sent.get((rank, a), 0.0) + (split if a.kind in SPLIT else 0.0), comm
        return memo[rank, a]

    if placement.cores >= placement.ranks_per_node * placement.threads and not placement.sharing:
        speed = simulate.full_speed  # every rank has its own compute (a GPU's; a CPU's sharing curve says)
    elif placement.nodes == 1:
        busy_per_pp_rank = layout.world // pp  # the ranks of one pipeline rank compute together

        def speed(k: int) -> float:
            return placement.share(k * busy_per_pp_rank)
    else:

        def speed(k: int) -> float:
            return placement.share(placement.ranks_per_node)

    if pp > 1:
        spans = simulate.run_schedule(layout.schedule, pp, vpp, micro, cost, lambda r, a: hop, speed)
    else:
        spans = simulate.run_actions([stage_actions(layout, 0)], 1, cost, speed=speed)
    return costs, spans, hop, kernels, sent


def _accumulate(m: ModelConfig, layout: Layout, stage: int) -> Op:
    """A micro-batch's weight gradients into the reducer's fp32 buffer: each parameter's ``.grad`` written, then
    added to its slice of the buffer by a hook (read both, write one), one kernel per parameter."""
    params = chunk_params(m, layout, stage)
    numel = sum(n for _, n in params)
    return Op("elementwise", "W", (), (BYTES[layout.precision] + 12) * numel, len(params))


def _zero3_gathers(m: ModelConfig, layout: Layout, p: Profile, placement: RankPlacement, costs: dict) -> float:
    """ZeRO 3's parameter all-gathers left exposed, on the pipeline rank that has the most (parallel/zero/stage3.py).
    A chunk's blocks are gathered in order with ``zero3_prefetch`` (d) of them ahead: the first gather of a pass is
    exposed, each later one only where it outlasts the d passes of the blocks before it (d = 0: all exposed).
    ``micro_batch`` gathers every block before each micro-batch's forward and again before its backward (behind
    which its reduce-scatter also runs); ``step`` gathers each bucket once, at the step's first forward, and keeps
    it; under zb-h1 the backward's gather comes before the input pass (I)."""
    pp, vpp, micro = layout.pp, layout.vpp, layout.micro_batches
    blocks = max(1, m.n_layers // (pp * vpp))
    e = BYTES[layout.precision]
    across = placement.spans_nodes(layout.tp, layout.grad_ranks)
    depth = layout.zero3_prefetch
    worst = 0.0
    for r in range(pp):
        exposed = 0.0
        for c in range(vpp):
            stage = stage_of(c, r, pp, stage_placement(layout.schedule))
            numel = sum(n for _, n in chunk_params(m, layout, stage)) / blocks
            gather = amid_time(p, "all_gather", layout.grad_ranks, numel * e, across)
            scatter = amid_time(p, "reduce_scatter", layout.grad_ranks, numel * 4, across)
            f, b = costs[(stage, "F")][0] / blocks, costs[(stage, "B")][0] / blocks
            forward = gather + (blocks - 1) * max(0.0, gather - depth * f)
            if layout.zero3_gather == "step":
                exposed += forward
            else:
                backward = gather + (blocks - 1) * max(0.0, gather + scatter - depth * b)
                exposed += micro * (forward + backward)
        worst = max(worst, exposed)
    return worst


def _optimizer_time(
    m: ModelConfig,
    layout: Layout,
    p: Profile,
    placement: RankPlacement,
    dp_across: bool,
    speed: float,
    cache: dict | None,
) -> tuple[float, float]:
    """AdamW over the rank's shard (the whole flat buffer at ZeRO 0), its offloaded ratio on the host with the
    gradient copied down and the parameters up; the clip's norm; 16-bit parameters cast back from the masters; the
    updated parameters all-gathered under ZeRO 1-2 (3: at the next forward); zeroing the gradient buffer; and the
    step's scalar all-reduces (loss, gradient norm, finite check) over the world. Returns (compute, communication)."""
    numel = max(_stage_numel(m, layout, s, cache) for s in range(layout.pp))
    experts = max(_stage_expert_numel(m, layout, s, cache) for s in range(layout.pp))
    # ZeRO shards the dense weights' states over grad_ranks, the experts' over grad_ranks / ep.
    shard = (
        (numel - experts) / layout.grad_ranks + experts * layout.ep / layout.grad_ranks if layout.zero >= 1 else numel
    )
    e = BYTES[layout.precision]
    ratio = layout.offload_ratio if layout.offload == "cpu" else 0.0
    device_part = (1 - ratio) * shard / p.adam
    host_part = ratio * shard / p.host_adam
    copies = 2 * p.host_copy.time(ratio * shard * 4) if ratio and p.device == "cuda" else 0.0
    ew = p.elementwise
    other = (4 * shard + 4 * numel) / ew.bandwidth + 4 * ew.latency  # the norm's read, zeroing the buffer
    if e != 4:
        other += 6 * shard / ew.bandwidth  # masters cast back to the parameters' dtype
    gather = 0.0
    if layout.zero in (1, 2) and layout.grad_ranks > 1:
        gather = collective_time(p, "all_gather", layout.grad_ranks, numel * e, dp_across)
    world = placement.world
    scalars = 3 * collective_time(p, "all_reduce", world, 8, placement.nodes > 1) if world > 1 else 0.0
    muon = muon_comm = 0.0
    if layout.optimizer == "muon":
        flops, whole = max(muon_work(m, layout, stage) for stage in range(layout.pp))
        stage_ranks = layout.grad_ranks * layout.tp
        muon = flops / stage_ranks / p.peak("bf16")
        # A reduce of the fp32 update and a broadcast of the bf16 result per parameter: as an all-reduce of 3 bytes
        if stage_ranks > 1:
            muon_comm = collective_time(p, "all_reduce", stage_ranks, whole * 3, placement.nodes > 1)
    if p.device == "cpu":  # the "host" is the same cores the ranks share
        host_part /= speed
    return (device_part + other + muon) / speed + host_part + copies, gather + scalars + muon_comm


NS_STEPS = 5  # optim.muon_ns_steps' default: what the planner prices


def muon_work(m: ModelConfig, layout: Layout, stage: int) -> tuple[float, int]:
    """Newton-Schulz's FLOPs over every matrix Muon steps on pipeline stage ``stage`` (each of NS_STEPS iterations
    on an r x c matrix, r <= c: X X^T, 2 r^2 c; the quintic's b G + c G^2, 2 r^3; and its product with X, 2 r^2 c),
    and the logical elements of its matrix parameters (what the owners' sums and broadcasts carry)."""
    return _muon_work(_key(m), layout.tp, layout.pp, layout.vpp, layout.sequence_parallel, stage, layout.schedule)


@functools.lru_cache(maxsize=512)
def _muon_work(model: tuple, tp: int, pp: int, vpp: int, sp: bool, stage: int, schedule: str | None):
    m = ModelConfig(*model)
    layout = Layout(tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp, schedule=schedule)
    flops, whole = 0.0, 0
    for param, matrices in muon_params(stage_params(m, layout, stage).chunks).items():
        shape = placement_of(param).shape
        r, c = sorted(matrices.shape(shape))
        flops += matrices.parts * NS_STEPS * (4 * r * r * c + 2 * r**3)
        whole += math.prod(shape)
    return flops, whole
