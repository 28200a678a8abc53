"""Which gradient reducer, optimizer and step a rank trains with, from the config.

    zero=0, fp32      GradReducer (all-reduce) + one torch AdamW over the parameters (ReplicatedUpdate)
    zero=0, 16-bit    GradReducer (all-reduce) + ZeroOptimizer over the whole layout (fp32 masters)
    zero=1            ScatterReducer (full fp32 buffer, reduce-scatter) + ZeroOptimizer over the dp shard
    zero=2            ShardedGradReducer (reduce-scatter per bucket, fp32 shard only) + ZeroOptimizer
    zero=3            ShardedGradReducer over one bucket per block + ZeroOptimizer over sharded parameters,
                      gathered around each block's forward and backward (ParameterSharding)

The ZeRO optimizer casts the parameters to the precision policy's dtype (after copying the fp32 values into its
masters), so building this is also what makes a bf16 or fp16 model 16-bit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from torch import nn

from trident.config import Config
from trident.optim import GradStep, ReplicatedUpdate, build_optimizer
from trident.parallel.groups import ProcessGroups
from trident.parallel.layout import FlatLayout
from trident.parallel.precision import LossScaler, precision_policy
from trident.parallel.reducer import GradReducer, bucket_numel
from trident.parallel.zero.grads import ScatterReducer, ShardedGradReducer
from trident.parallel.zero.optimizer import ZeroOptimizer
from trident.parallel.zero.params import FlatParams, ShardedParams
from trident.parallel.zero.stage3 import ParameterSharding, unit_layout


@dataclass
class OptimizerSetup:
    reducer: GradReducer | ShardedGradReducer  # what the runner accumulates into and finishes
    grad_step: GradStep
    checkpointed: object  # what the Checkpointer saves: a torch optimizer, or ZeRO's (masters and shards)
    remove_hooks: Callable[[], None]


def build_optimizer_setup(
    chunks: list[nn.Module], cfg: Config, groups: ProcessGroups, isolate: Collection[nn.Parameter] = ()
) -> OptimizerSetup:
    """``isolate``: parameters whose gradients are summed over another group after the dp reduction (a pipeline's
    tied embedding and its copy): each gets a bucket of its own, so its shards line up across those ranks
    (``GradStep.grad_views``)."""
    zero, par, opt = cfg.parallel.zero, cfg.parallel, cfg.optim
    policy = precision_policy(cfg.train.precision)
    scaler = LossScaler() if policy.loss_scaling else None
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    dp_group = groups.dp_group

    if zero == 0 and not policy.needs_masters:
        optimizer = build_optimizer(chunks, opt)
        reducer = GradReducer(params, dp_group, par.bucket_mb, policy.reduce_dtype, isolate)
        step = GradStep(ReplicatedUpdate(optimizer, reducer), groups, opt.grad_clip, scaler)
        return OptimizerSetup(reducer, step, optimizer, reducer.remove_hooks)

    sharding: ParameterSharding | None = None
    if zero <= 1:
        kind = ScatterReducer if zero == 1 else GradReducer
        reducer = kind(params, dp_group, par.bucket_mb, policy.reduce_dtype, isolate)
        layout = reducer.layout
    elif zero == 2:
        numel = bucket_numel(par.bucket_mb, policy.reduce_dtype)
        layout = FlatLayout.by_size(params, numel, groups.dp_size, isolate)
        reducer = ShardedGradReducer(layout, dp_group, policy.reduce_dtype, params[0].device)
    else:
        (model,) = chunks  # validate refuses stage 3 with pipeline parallelism
        blocks = list(model.layers.values())
        layout = unit_layout(model, blocks, groups.dp_size)
        reducer = ShardedGradReducer(layout, dp_group, policy.reduce_dtype, params[0].device)

    def make_store() -> FlatParams | ShardedParams:
        if zero == 3:
            return ShardedParams(layout, policy.param_dtype, dp_group)
        return FlatParams(layout, policy.param_dtype, dp_group, shards=groups.dp_size if zero >= 1 else 1)

    adamw = {"lr": opt.lr, "betas": (opt.beta1, opt.beta2), "eps": opt.eps, "weight_decay": opt.weight_decay}
    ratio = par.offload.ratio if par.offload.optimizer == "cpu" else 0.0
    optimizer = ZeroOptimizer(layout, reducer, make_store, policy.param_dtype, dp_group, zero, adamw, ratio)
    if zero == 3:
        sharding = ParameterSharding(model, blocks, layout, optimizer.store)
        reducer.on_reduced = optimizer.store.free

    def remove_hooks() -> None:
        reducer.remove_hooks()
        if sharding is not None:
            sharding.remove_hooks()

    step = GradStep(optimizer, groups, opt.grad_clip, scaler)
    return OptimizerSetup(reducer, step, optimizer, remove_hooks)
