"""FP8 training (``train.fp8``): the transformer's linear layers multiply in float8 through torchao's float8 training
(torchao.float8: its recipes, casts and ``torch._scaled_mm``; on a CPU, which has no FP8 GEMM kernel, torchao's
emulation of it: the same fp8 operands and scales multiplied in fp32), with one process's math in every layout.

    tensorwise          a scale per operand, e4m3 forward, e5m2 gradients (torchao's default recipe)
    rowwise             a scale per row of each operand along the GEMM's contraction dim, e4m3, power-of-2 scales
    rowwise_with_gw_hp  rowwise, the weight gradient's GEMM left in bf16

Which layers: attention's and the dense MLPs' (shared experts' too) column- and row-parallel layers whose logical in
and out features are multiples of 16 (torchao's rule: the FP8 GEMM's alignment). The LM head (the embedding), the
router (fp32) and the routed experts stay bf16: torchao's FP8 grouped GEMM (torchao.prototype.moe_training) runs
Triton kernels and ``torch._scaled_grouped_mm``, neither of which a CPU has. The weights stay the parameters they
were (bf16, with fp32 masters in the optimizer), cast to fp8 at each use: checkpoints, ZeRO (its all-gathers in
bf16), resume, resharding and export never see fp8. ``train.fp8`` needs ``train.precision=bf16``.

Layout-exact scales: each operand's scale is that of the logical tensor, whatever the layout splits. The operands
are 2-D, input ``[tokens, K]``, weight ``[K, N]``, output gradient ``[tokens, N]``; an amax is all-reduced (MAX)
over the groups splitting the dims it spans: tokens over cp (a micro-batch's sequence shards), K over tp in a
row-parallel layer, N over tp in a column-parallel one. Sequence parallelism gathers the whole sequence into the tp
region, and dp and pp hold whole micro-batches as one process's gradient accumulation does: nothing to reduce. A
max is the same over any split, so every scale and fp8 value is one process's; only sums' order differs.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trident.parallel.placement import placement_of
from trident.parallel.wgrad import WeightGradStore, deferred_linear

FP8_RECIPES = ("off", "tensorwise", "rowwise", "rowwise_with_gw_hp")
FP8_ALIGN = 16  # a layer converts when its in and out features are multiples of this


@functools.cache
def _float8() -> SimpleNamespace:
    """torchao.float8, imported only for an fp8 run and without its messages about CUDA extensions a CPU lacks."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
        import torchao.float8.float8_training_tensor as tensor
        import torchao.float8.float8_utils as utils
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
    return SimpleNamespace(config=float8.config, tensor=tensor, utils=utils, recipe=float8.Float8LinearConfig)


@dataclass(frozen=True, eq=False)
class Fp8Spec:
    """How one layer casts: the recipe's config and the groups splitting its operands' tokens, K and N."""

    config: Any  # torchao's Float8LinearConfig
    mm: Any  # its LinearMMConfig
    tokens: tuple[dist.ProcessGroup, ...]
    inner: tuple[dist.ProcessGroup, ...]
    outer: tuple[dist.ProcessGroup, ...]

    def cast(self, t: torch.Tensor, cast: Any, role: str, dims: tuple[tuple, tuple], axis: int) -> torch.Tensor:
        """``t`` in fp8 (a Float8TrainingTensor) as ``cast`` says, its amax over ``axis`` (rowwise) or all of it
        (tensorwise) reduced over the groups splitting those of its dims (``dims``: each dim's groups)."""
        f8 = _float8()
        if cast.scaling_type is f8.config.ScalingType.DISABLED:
            return t
        axiswise = cast.scaling_granularity is f8.config.ScalingGranularity.AXISWISE
        axis_or_none = axis if axiswise else None
        amax = f8.utils.tensor_to_amax(t, scaling_granularity=cast.scaling_granularity, axiswise_dim=axis_or_none)
        amax = amax.float()  # exact: the scale is computed in float64 from it
        for group in dims[axis] if axiswise else dims[0] + dims[1]:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale = f8.utils.amax_to_scale(amax, cast.target_dtype, self.config.round_scales_to_power_of_2)
        gemm_role = f8.tensor.GemmInputRole(role)
        return f8.tensor.hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, self.mm, gemm_role, axis_or_none)


def is_fp8_gemm(op: Any, args: tuple) -> bool:
    """Whether ``op`` is one of the GEMMs of ``_Fp8Matmul``'s forward (an ``aten.mm`` of Float8 tensors), which runs
    with grad mode off, as an autograd.Function's forward does: for selective recomputation to keep it as it keeps
    a bf16 layer's (models/checkpointing.py)."""
    return op is torch.ops.aten.mm.default and any(type(a).__name__ == "Float8TrainingTensor" for a in args)


class _Fp8Matmul(torch.autograd.Function):
    """``x @ w_t`` (``x`` [tokens, K], ``w_t`` [K, N]) and its two gradient GEMMs in fp8: torchao's
    ``matmul_with_hp_or_float8_args``, each cast's amax reduced over the layout's split (``Fp8Spec.cast``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_t: torch.Tensor, spec: Fp8Spec) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w_t)
        ctx.spec, c = spec, spec.config
        x8 = spec.cast(x, c.cast_config_input, "input", (spec.tokens, spec.inner), -1)
        return torch.mm(x8, spec.cast(w_t, c.cast_config_weight, "weight", (spec.inner, spec.outer), 0))

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x, w_t = ctx.saved_tensors
        s, c = ctx.spec, ctx.spec.config
        x_dims, w_dims, dy_dims = (s.tokens, s.inner), (s.inner, s.outer), (s.tokens, s.outer)
        dy8 = s.cast(dy, c.cast_config_grad_output, "grad_output", dy_dims, -1)
        dx = torch.mm(dy8, s.cast(w_t, c.cast_config_weight_for_grad_input, "weight", w_dims, -1).t())
        dy8 = s.cast(dy, c.cast_config_grad_output_for_grad_weight, "grad_output", dy_dims, 0)
        dw = torch.mm(dy8.t(), s.cast(x, c.cast_config_input_for_grad_weight, "input", x_dims, 0))
        return dx, dw.t(), None


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: Fp8Spec) -> torch.Tensor:
    on = torch.is_autocast_enabled(x.device.type)
    dtype = torch.get_autocast_dtype(x.device.type) if on else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]).to(dtype), weight.to(dtype).t(), spec)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias.to(y.dtype)


def maybe_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    spec: Fp8Spec | None,
    store: WeightGradStore | None = None,
) -> torch.Tensor:
    """``F.linear``, or with ``spec`` (a layer ``enable_fp8`` converted) its FP8 GEMMs, or with ``store`` (the
    zero-bubble schedules' W, parallel/wgrad.py) its weight gradient deferred."""
    if spec is not None:
        return _eager()(x, weight, bias, spec)
    if store is not None and weight.is_leaf and weight.requires_grad and torch.is_grad_enabled():
        return deferred_linear(x, weight, bias, store)
    return F.linear(x, weight, bias)


@functools.cache
def _eager() -> Any:
    """``_fp8_linear`` run eagerly within a compiled block (collectives, a tensor subclass): wrapped at first use, so
    that importing the package leaves torch._dynamo unimported."""
    return torch.compiler.disable(_fp8_linear)


def enable_fp8(model: nn.Module, recipe: str) -> list[str]:
    """Convert ``model``'s (a GPT's) linear layers that the module docstring names to ``recipe``'s FP8 GEMMs: each
    gets its ``Fp8Spec`` (attribute ``fp8``); the names of those converted. ``off``: none."""
    if recipe == "off":
        return []
    f8 = _float8()
    config = f8.recipe.from_recipe_name(recipe)
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    # A CPU has no FP8 GEMM kernel (torch._scaled_mm's CPU one is a reference loop: 7.6 s for a 1024 x 256 x 1024
    # product, 0.5 ms in bf16): there torchao's emulation multiplies the same fp8 values and scales in fp32.
    emulate = config.emulate or all(p.device.type == "cpu" for p in model.parameters())
    mm = f8.tensor.LinearMMConfig(
        *(f8.tensor.ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms)
    )
    tokens = () if model.cp_group is None else (model.cp_group,)
    tp = (model.tp_group,) if model.tp_size > 1 else ()
    converted = []
    for name, module in model.named_modules():
        # parallel/tensor.py's linear layers declare ``fp8``; a row-parallel one splits its weight's K (dim 1).
        if getattr(type(module), "fp8", False) is not None:
            continue
        placement = placement_of(module.weight)
        if any(dim % FP8_ALIGN for dim in placement.shape):
            continue
        row = placement.split_dim == 1
        module.fp8 = Fp8Spec(config, mm, tokens, tp if row else (), () if row else tp)
        converted.append(name)
    return converted
