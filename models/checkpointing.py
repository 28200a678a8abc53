"""Activation checkpointing as an applier: it changes how blocks run, never their parameter names.

``train.activation_checkpointing``:

- ``full``: each transformer block keeps only its input; everything inside is recomputed in backward.
- ``selective``: op-level selective recomputation (torch's selective checkpoint contexts, as torchtitan's op-level
  SAC): the block keeps its input and the outputs of the ops that cost matmuls, and recomputes the rest in backward.
  What is recomputed is the module list ``train.recompute_modules`` (``MODULES``), Megatron-style:

      norm       both pre-norms
      mlp_act    the MLP's activation: GELU, or SwiGLU's silu and product
      attn_core  attention proper: SDPA's kernel (output and log-sum-exp), or with dropout the explicit
                 scores, probabilities and their product with v
      mlp        the whole MLP, its matmuls too (implies mlp_act)

  Its default, ``norm, mlp_act``, keeps every matrix product (the q/k/v, output and MLP projections, a sparse
  MLP's router and experts' grouped products) and the attention core's output and log-sum-exp. Whatever the list,
  the cheap work between them is recomputed: rotary embeddings, dropout (the masks redrawn), residual adds, copies,
  the routing and the collectives of tensor, sequence and expert parallelism; an unlisted module keeps its ops'
  outputs (matmuls and attention kernels only, in the core).
- ``attention``: only the attention core is recomputed, as a checkpointed function whose inputs q, k, v the
  projections keep anyway (Megatron's original selective recomputation; it saves the core's s x s tensors, which
  only the explicit core of dropout has: with SDPA, its log-sum-exp).

``train.recompute_every=N``: only every N-th block (global layers 0, N, 2N, ...) is recomputed under the policy; the
others keep everything, so memory dials between ``none`` and the policy.

Dropout redraws the same masks when recomputed: they are derived from the micro-batch the forward ran on, which
the model's RNG tracker, if it has one, puts back around the recomputation (``RNGTracker.checkpoint_contexts``),
inside the selective contexts' own pair.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from trident.parallel.fp8 import is_fp8_gemm

if TYPE_CHECKING:
    from trident.models.gpt import GPT
    from trident.parallel.random import RNGTracker

POLICIES = ("none", "selective", "attention", "full")
MODULES = ("norm", "mlp_act", "attn_core", "mlp")
SELECTIVE_MODULES = ("norm", "mlp_act")

_aten = torch.ops.aten
# Matrix products and attention kernels: what a selective policy keeps unless their module is listed.
_KERNELS = {
    *([_aten._grouped_mm.default] if hasattr(torch, "_grouped_mm") else []),  # the experts (models/moe.py)
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}
_ACTIVATIONS = {_aten.gelu.default, _aten.silu.default, _aten.mul.Tensor}
# A norm's outputs: LayerNorm's (with its mean and rstd), CUDA's fused RMSNorm's, or the composite RMSNorm's rstd and
# products (its mean is updated in place, so it cannot be kept).
_NORMS = {_aten.native_layer_norm.default, _aten._fused_rms_norm.default, _aten.rsqrt.default, _aten.mul.Tensor}


def recompute_label(policy: str, modules: Sequence[str] = SELECTIVE_MODULES, every: int = 1) -> str:
    """A recomputation in one word, as the estimator and the planner key it: ``none``, ``attention``, ``full``,
    ``selective`` (its default modules) or ``selective[norm,attn_core]``, with ``/N`` when every N-th block."""
    if policy == "none":
        return "none"
    label = policy
    if policy == "selective" and tuple(modules) != SELECTIVE_MODULES:
        label += f"[{','.join(modules)}]"
    return label + (f"/{every}" if every > 1 else "")


def parse_label(label: str) -> tuple[str, tuple[str, ...], int]:
    """(policy, modules, every) of ``recompute_label``'s word."""
    label, _, every = label.partition("/")
    policy, _, modules = label.partition("[")
    listed = tuple(modules.rstrip("]").split(",")) if modules else SELECTIVE_MODULES
    return policy, listed, int(every or 1)


def recomputed_layers(layers: Sequence[int], policy: str, every: int) -> list[int]:
    """Which of ``layers`` (global indices) run under ``policy`` with ``train.recompute_every=every``."""
    return [] if policy == "none" else [i for i in layers if i % every == 0]


class _Regions:
    """Which module of a block is running (None: none of norm, attention core, MLP), for the policy to read. The
    same wrappers run in the recomputation, so the forward and its replay see the same regions."""

    def __init__(self) -> None:
        self.current: str | None = None

    def wrap(self, fn: Callable, region: str) -> Callable:
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            outer, self.current = self.current, region
            try:
                return fn(*args, **kwargs)
            finally:
                self.current = outer

        return run


def _policy(regions: _Regions, modules: frozenset[str]) -> Callable:
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001, ANN002, ANN003
        region = regions.current
        recompute = CheckpointPolicy.PREFER_RECOMPUTE
        # Work under no_grad (a sparse layer's routing statistics) is no input of the backward and is not repeated in
        # the recomputation: kept, it would shift the cache of its op by one and hand a later call the wrong output.
        # But an FP8 layer's GEMM (train.fp8), in its autograd.Function's grad-less forward, is repeated: kept as a
        # bf16 layer's is (recomputed, selective+FP8 ran every converted layer's forward GEMM twice); its casts rerun.
        if not torch.is_grad_enabled() and not is_fp8_gemm(op, args):
            return recompute
        # Views alias what they view (keeping one would keep a recomputed tensor's storage); a mutating op (a
        # collective writing its output) must run again.
        if op.is_view or op._schema.is_mutable:
            return recompute
        if op in _KERNELS:
            if region == "mlp":
                return recompute if "mlp" in modules else CheckpointPolicy.MUST_SAVE
            return recompute if region == "attn_core" and "attn_core" in modules else CheckpointPolicy.MUST_SAVE
        if region == "norm" and op in _NORMS:
            return recompute if "norm" in modules else CheckpointPolicy.MUST_SAVE
        if region == "mlp" and op in _ACTIVATIONS:
            return recompute if modules & {"mlp_act", "mlp"} else CheckpointPolicy.MUST_SAVE
        return recompute  # rotary, dropout, residual adds, copies, collectives

    return policy


class _Replayable:
    """The recomputation side of the selective contexts, enterable more than once: a zero-bubble schedule's split
    backward recomputes a block in its input pass and again in its weight pass, and torch's cache gives each
    kept output once. The cache as the forward left it is put back before each replay."""

    def __init__(self, mode: contextlib.AbstractContextManager) -> None:
        self.mode, self.kept = mode, None

    def __enter__(self) -> None:
        storage = self.mode.storage
        # Each op's outputs: a dict by call index (torch 2.13), a list the backward pops from (torch 2.11 and before).
        if self.kept is None:
            self.kept = {key: copy.copy(entries) for key, entries in storage.items()}
        else:
            storage.update({key: copy.copy(entries) for key, entries in self.kept.items()})
        self.mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


class _Both:
    """Two context managers entered as one (the first outside), reusable as each of them is."""

    def __init__(self, outer: contextlib.AbstractContextManager, inner: contextlib.AbstractContextManager) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        self.outer.__enter__()
        try:
            self.inner.__enter__()
        except BaseException:
            self.outer.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            self.outer.__exit__(*exc)


def _selective_contexts(policy: Callable, rng: RNGTracker | None) -> Callable:
    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        caching, cached = create_selective_checkpoint_contexts(policy)
        forward, recompute = rng.checkpoint_contexts() if rng is not None else noop_context_fn()
        return _Both(forward, caching), _Both(recompute, _Replayable(cached))

    return contexts


def _recomputed(fn: Callable, contexts: Callable, compiled: bool) -> Callable:
    def recompute(*args: torch.Tensor) -> torch.Tensor:
        # No generator state to save and restore around each call: no mask draws from a generator's running state.
        return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts, preserve_rng_state=False)

    # Opaque to torch.compile: dynamo cannot trace a checkpoint with our context_fn, so a compiled block calls the
    # checkpointed part as an eager island (attention), or the checkpoint wraps the compiled block (full and
    # selective: models/compile.py runs first). Only then: marking it imports dynamo, which an eager run never needs.
    return torch.compiler.disable(recompute) if compiled else recompute


def apply_activation_checkpointing(
    model: GPT,
    policy: str,
    compiled: bool = False,
    modules: Sequence[str] = SELECTIVE_MODULES,
    every: int = 1,
) -> None:
    """``compiled``: the blocks were compiled (models/compile.py, ``train.compile``). ``modules``: what
    ``selective`` recomputes (``train.recompute_modules``); ``every``: ``train.recompute_every``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown activation checkpointing policy {policy!r}")
    if unknown := set(modules) - set(MODULES):
        raise ValueError(f"unknown recompute modules {sorted(unknown)}: valid are {', '.join(MODULES)}")
    rng = model.rng
    plain = rng.checkpoint_contexts if rng is not None else noop_context_fn
    for index in recomputed_layers([int(i) for i in model.layers], policy, every):
        block = model.layers[str(index)]
        # Overriding forward on the instance keeps state_dict keys unchanged (no wrapper module).
        if policy == "full":
            block.forward = _recomputed(block.forward, plain, compiled)
        elif policy == "attention":
            block.attn.core = _recomputed(block.attn.core, plain, compiled)
        else:
            regions = _Regions()
            block.ln_1.forward = regions.wrap(block.ln_1.forward, "norm")
            block.ln_2.forward = regions.wrap(block.ln_2.forward, "norm")
            block.attn.core = regions.wrap(block.attn.core, "attn_core")
            block.mlp.forward = regions.wrap(block.mlp.forward, "mlp")
            contexts = _selective_contexts(_policy(regions, frozenset(modules)), rng)
            block.forward = _recomputed(block.forward, contexts, compiled)
