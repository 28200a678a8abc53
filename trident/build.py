"""The parts of a run, built from the config and the process groups: what train.py composes, and what tests,
tools and benches build through, so none of them copies the wiring.

    model_chunks     this rank's GPT chunks: its virtual stages, initialised, on the device, compiled, recomputed
                     (``chunk_model``: one of them as constructed)
    build_optimizer  the gradient reducer, the ZeRO optimizer (every stage, 0 included) and the step around it
                     (``flat_layout``: the flat layout of the chunks' parameters at the ZeRO stage)
    build_runner     how a step's micro-batches go through the chunks: the local runner or a pipeline schedule
    build_parts      the three above, as one ``RunParts``
    build_checkpointer  the checkpointer of those parts

Which reducer and parameter store each ZeRO stage uses:

    zero=0   GradReducer (all-reduce)                    FlatParams, unsharded (fp32: the parameters are the masters)
    zero=1   ScatterReducer (full buffer, reduce-scatter) FlatParams, the dp shard all-gathered after the step
    zero=2   ShardedGradReducer (per bucket, shard only)  FlatParams, likewise
    zero=3   ShardedGradReducer over one bucket per block ShardedParams, gathered around each block's use
             (one launch order per model chunk)     (parallel.zero3_gather, parallel.zero3_prefetch)

The ZeRO optimizer casts the parameters to the precision policy's dtype (after copying the fp32 values into its
masters), so building the optimizer is also what makes a bf16 or fp16 model 16-bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed import ProcessGroup

from trident.checkpoint.manager import Checkpointer
from trident.config import Config, ModelConfig, OptimConfig, TrainConfig, validate
from trident.layout import Layout
from trident.models.checkpointing import apply_activation_checkpointing
from trident.models.compile import compile_blocks, compiles
from trident.models.gpt import GPT, init_weights
from trident.optim import GradStep, muon_plan
from trident.parallel.comm import GroupShape
from trident.parallel.fp8 import enable_fp8
from trident.parallel.groups import ProcessGroups
from trident.parallel.layout import FlatLayout
from trident.parallel.pipeline.executor import PipelineRunner
from trident.parallel.pipeline.schedules import SPLIT_BACKWARD, stage_of, stage_placement
from trident.parallel.pipeline.stages import stage_layers
from trident.parallel.placement import is_expert, placement_of
from trident.parallel.precision import LossScaler, PrecisionPolicy, precision_policy
from trident.parallel.random import RNGTracker, model_parallel_rng
from trident.parallel.reducer import GradReducer, bucket_numel
from trident.parallel.wgrad import WeightGradStore, defer_weight_grads
from trident.parallel.zero.grads import ScatterReducer, ShardedGradReducer
from trident.parallel.zero.optimizer import Masters, ZeroOptimizer
from trident.parallel.zero.params import FlatParams, ShardedParams
from trident.parallel.zero.stage3 import ChunkUnits, ParameterSharding, unit_layout
from trident.runner import LocalRunner, Runner


def model_chunks(
    m: ModelConfig, layout: Layout, train: TrainConfig, groups: ProcessGroups, device: torch.device
) -> list[GPT]:
    """This rank's model chunks: chunk c is virtual stage ``stage_of(c, pp_rank, pp, placement)`` under the schedule's
    placement (parallel/pipeline/schedules.py; the layers of each stage: parallel/pipeline/stages.py), each
    initialised from the seed (``train.seed``) as the one-process model is, then moved, its linear layers converted
    to FP8 GEMMs (``train.fp8``), compiled (``train.compile``) and wrapped for recomputation."""
    rng = model_parallel_rng(train.seed)
    chunks = []
    placement = stage_placement(layout.schedule)
    for c in range(layout.vpp):
        stage = stage_of(c, groups.pp_rank, layout.pp, placement)
        chunk = chunk_model(m, layout, stage, groups.tp_group, rng, groups.cp_group, groups.ep_group)
        init_weights(chunk, m, train.seed)
        chunk.to(device)
        enable_fp8(chunk, train.fp8)
        compiled = compiles(train.compile, device)
        if compiled:  # before activation checkpointing, which then wraps the compiled blocks
            compile_blocks(chunk, device, retains_graph=layout.schedule in SPLIT_BACKWARD)
        apply_activation_checkpointing(
            chunk, layout.activation_checkpointing, compiled, layout.recompute_modules, layout.recompute_every
        )
        chunks.append(chunk)
    return chunks


def chunk_model(
    m: ModelConfig,
    layout: Layout,
    stage: int,
    tp_group: ProcessGroup | GroupShape | None,
    rng: RNGTracker | None = None,
    cp_group: ProcessGroup | None = None,
    ep_group: ProcessGroup | GroupShape | None = None,
) -> GPT:
    """The GPT of virtual stage ``stage``, as constructed (parameters zero): its layers (parallel/pipeline/stages.py),
    the embedding on stage 0, the final norm and LM head on the last. The memory estimator (trident/memory/params.py)
    builds it on the meta device, a ``GroupShape`` standing for the tp group. ``ep_group``: the experts' all-to-all
    group (each rank holds experts / ep of them; None: all), a ``GroupShape`` for the estimator."""
    layers = stage_layers(m.n_layers, layout.pp, layout.vpp, stage)
    last = stage == layout.chunks - 1
    return GPT(m, tp_group, layout.sequence_parallel, rng, layers, stage == 0, last, cp_group, layout.cp_comm, ep_group)


@dataclass
class Optimizer:
    """The reducer backward accumulates into, and the step that finishes and applies its gradients."""

    reducer: GradReducer | ShardedGradReducer
    zero: ZeroOptimizer  # what checkpoints save: fp32 masters and AdamW state, as boxes of logical tensors
    step: GradStep
    sharding: ParameterSharding | None  # stage 3's gather/free hooks

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        if self.sharding is not None:
            self.sharding.remove_hooks()


def build_optimizer(chunks: list[nn.Module], layout: Layout, opt: OptimConfig, groups: ProcessGroups) -> Optimizer:
    """The reducer, the ZeRO optimizer of the layout's stage (with offload) and the ``GradStep`` around it.

    Parameters whose gradients are summed across pipeline stages after the dp reduction (the tied embedding's
    two copies) get a bucket of their own, so their shards line up on the ranks that sum them. No bucket spans two
    model chunks, so the pipeline reduces each chunk's buckets after its last backward."""
    zero = layout.zero
    policy = precision_policy(layout.precision)
    per_chunk, isolate, _ = _trainable(chunks)  # the reducer finds the expert weights itself
    params = [p for ps in per_chunk for p in ps]
    # Gradients reduce, and ZeRO shards, over every rank holding these parameters: dp x cp.
    dp_group, dp_size, device = groups.grad_group, groups.grad_size, params[0].device

    # Expert weights (ep > 1) reduce, and are sharded, over the expert-data-parallel group.
    expert_group = groups.expert_dp_group if layout.ep > 1 else None
    adamw = {"lr": opt.lr, "betas": (opt.beta1, opt.beta2), "eps": opt.eps, "weight_decay": opt.weight_decay}
    muon = muon_plan(chunks, chunks[0].cfg, opt, groups)  # None: AdamW alone
    sharding: ParameterSharding | None = None
    if zero <= 1:
        kind = ScatterReducer if zero == 1 else GradReducer
        args = (params, dp_group, layout.bucket_mb, policy.reduce_dtype, isolate, per_chunk)
        reducer = kind(*args, expert_group=expert_group)
        masters = Masters(reducer.layout, policy.param_dtype, dp_group, zero, layout.offloaded_fraction, expert_group)
        store = FlatParams(reducer.layout, policy.param_dtype, dp_group, dp_size if zero else 1, expert_group)
        return _optimizer(ZeroOptimizer(masters, store, reducer, adamw, muon), groups, opt, policy, None)
    # The masters read the fp32 values before the store casts the parameters.
    flat, units = flat_layout(chunks, layout, dp_size)
    masters = Masters(flat, policy.param_dtype, dp_group, zero, layout.offloaded_fraction, expert_group)
    if zero == 2:
        store = FlatParams(flat, policy.param_dtype, dp_group, dp_size, expert_group)
        reducer = ShardedGradReducer(flat, dp_group, policy.reduce_dtype, device, expert_group=expert_group)
    else:
        store = ShardedParams(flat, policy.param_dtype, dp_group, expert_group)
        units_of = [(chunk, list(chunk.layers.values())) for chunk in chunks]
        sharding = ParameterSharding(units_of, units, store, layout.zero3_gather, layout.zero3_prefetch)
        # One launch order per chunk: a pipeline rank runs its chunks' backward passes interleaved. A bucket's
        # reduce-scatter ends its backward's hold on the gathered weights; the step's end frees them all.
        chains = [[s.index for s in [*reversed(u.blocks), *u.root]] for u in units]
        reducer = ShardedGradReducer(
            flat,
            dp_group,
            policy.reduce_dtype,
            device,
            on_reduced=sharding.reduced,
            on_finish=sharding.end_step,
            chains=chains,
            expert_group=expert_group,
        )
    return _optimizer(ZeroOptimizer(masters, store, reducer, adamw, muon), groups, opt, policy, sharding)


def _optimizer(
    optimizer: ZeroOptimizer,
    groups: ProcessGroups,
    opt: OptimConfig,
    policy: PrecisionPolicy,
    sharding: ParameterSharding | None,
) -> Optimizer:
    scaler = LossScaler() if policy.loss_scaling else None
    step = GradStep(optimizer, groups, opt.grad_clip, scaler)
    return Optimizer(optimizer.reducer, optimizer, step, sharding)


def _trainable(chunks: list[nn.Module]) -> tuple[list[list[nn.Parameter]], list[nn.Parameter], list[nn.Parameter]]:
    """Each chunk's trainable parameters; those each given a bucket of its own: those whose gradients are summed
    across pipeline stages after the dp reduction (the tied embedding's two copies, placement ``grad_sums``
    "embedding"), so its shards line up on the ranks that sum them; and the expert weights split over ep, which
    reduce over another group (expert-dp): in buckets of their own (``FlatLayout.by_size``'s ``apart``; at stage 3
    each alone, as the tied embedding)."""
    per_chunk = [[p for p in c.parameters() if p.requires_grad] for c in chunks]
    own = [p for ps in per_chunk for p in ps if "embedding" in placement_of(p).grad_sums]
    experts = [p for ps in per_chunk for p in ps if is_expert(p)]
    return per_chunk, own, experts


def flat_layout(chunks: list[GPT], layout: Layout, dp_size: int) -> tuple[FlatLayout, list[ChunkUnits]]:
    """The flat layout of the chunks' trainable parameters at the layout's ZeRO stage, and at stage 3 each chunk's
    buckets (else none). Stages 0-2: buckets of about ``bucket_mb`` of the reduce dtype in reverse registration
    order, none spanning two chunks, an isolated parameter in a bucket of its own (``FlatLayout.by_size``; the
    reducer of stages 0-1 builds it from the same arguments); stage 3: one bucket per block (``unit_layout``).
    No process group: the memory estimator (trident/memory/params.py) calls it on chunks built on the meta device."""
    per_chunk, isolate, experts = _trainable(chunks)
    if layout.zero < 3:
        numel = bucket_numel(layout.bucket_mb, precision_policy(layout.precision).reduce_dtype)
        params = [p for ps in per_chunk for p in ps]
        return FlatLayout.by_size(params, numel, dp_size, isolate, per_chunk, experts), []
    return unit_layout([(chunk, list(chunk.layers.values())) for chunk in chunks], dp_size, {*isolate, *experts})


def build_runner(
    chunks: list[GPT],
    layout: Layout,
    groups: ProcessGroups,
    optimizer: Optimizer,
    timings: Path | None = None,
) -> Runner:
    """The local runner at pp=1, else the layout's pipeline schedule over this rank's chunks.
    ``timings``: a file to record each pipeline action's start and end in (``logging.pipeline_timings``)."""
    if layout.schedule is None:
        return LocalRunner(chunks, optimizer.reducer, layout.precision)
    wgrad = None
    if layout.schedule in SPLIT_BACKWARD and not layout.compiled:  # W as the weight GEMMs alone (parallel/wgrad.py)
        wgrad, placement = WeightGradStore(), stage_placement(layout.schedule)
        for c, chunk in enumerate(chunks):
            if layout.defers_weight_grads(stage_of(c, groups.pp_rank, layout.pp, placement)):
                defer_weight_grads(chunk, wgrad)
                if optimizer.sharding is not None:  # ZeRO-3: W reads no weight, so none stays gathered for it
                    optimizer.sharding.release_after_input(c)
    return PipelineRunner(
        chunks,
        layout.schedule,
        groups.pp_rank,
        groups.pp_ranks,
        groups.pp_group,
        optimizer.reducer,
        layout.precision,
        chunks[0].cfg.d_model,
        seq_divisor=layout.seq_divisor,
        timings=timings,
        recomputed=layout.activation_checkpointing != "none",
        wgrad=wgrad,
    )


@dataclass
class RunParts:
    """What one rank trains with: its model chunks, their optimizer, and the runner of a step."""

    layout: Layout
    device: torch.device
    chunks: list[GPT]
    optimizer: Optimizer
    runner: Runner


def build_parts(
    cfg: Config,
    layout: Layout,
    groups: ProcessGroups,
    device: torch.device,
    timings_dir: Path | None = None,
    load: Callable[[list[GPT]], None] | None = None,
) -> RunParts:
    """Model chunks -> optimizer -> runner. ``timings_dir``: where pipeline ranks of the first dp and tp
    coordinate (one pipeline's ranks) record their actions' timings, one file per rank. ``load``: fills the
    initialised chunks with other weights (``checkpoint.init_from``), before the optimizer copies its fp32 masters;
    every rank calls it."""
    chunks = model_chunks(cfg.model, layout, cfg.train, groups, device)
    if load is not None:
        load(chunks)
    optimizer = build_optimizer(chunks, layout, cfg.optim, groups)
    record = timings_dir is not None and groups.dp_rank == 0 and groups.tp_rank == 0
    timings = timings_dir / f"rank{groups.rank}.jsonl" if record else None
    runner = build_runner(chunks, layout, groups, optimizer, timings)
    return RunParts(layout, device, chunks, optimizer, runner)


def layout_of(cfg: Config, groups: ProcessGroups) -> Layout:
    """The layout ``cfg`` resolves to on the world of ``groups``: for the tests, tools and benches that build a run's
    parts themselves (train.py has it from its own validation)."""
    return validate(cfg, groups.topology.world_size)


def build_checkpointer(
    cfg: Config, groups: ProcessGroups, parts: RunParts, root: Path, tokenizer: Path | None
) -> Checkpointer:
    """The checkpointer of ``parts`` under ``root`` (``checkpoint.every``, ``keep_last``, ``resume``, ``async``)."""
    ck = cfg.checkpoint
    return Checkpointer(
        root=root,
        every=ck.every,
        keep_last=ck.keep_last,
        resume=ck.resume,
        groups=groups,
        modules=parts.chunks,
        optimizer=parts.optimizer.zero,
        config=dataclasses.asdict(cfg),
        tokenizer=tokenizer,
        background=ck.async_,
        timeout_s=cfg.parallel.timeout_s,
    )
