"""Activation checkpointing as an applier: it changes how blocks run, never their parameter names.

- ``full``: each transformer block keeps only its input; everything inside is recomputed in backward.
- ``selective``: only the attention core (softmax(QK^T)V, the part whose activations grow with T^2 and
  cost little to recompute) is recomputed, as in Megatron's selective recomputation.

Dropout redraws the same masks when recomputed: they are derived from the micro-batch the forward ran on, which
the model's RNG tracker, if it has one, puts back around the recomputation (``RNGTracker.checkpoint_contexts``).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint, noop_context_fn

from trident.models.gpt import GPT
from trident.parallel.random import RNGTracker


def _recomputed(fn, rng: RNGTracker | None, compiled: bool):
    contexts = rng.checkpoint_contexts if rng is not None else noop_context_fn

    def recompute(*args: torch.Tensor) -> torch.Tensor:
        # No generator state to save and restore around each call: no mask draws from a generator's running state.
        return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts, preserve_rng_state=False)

    # Opaque to torch.compile: dynamo cannot trace a checkpoint with our context_fn, so a compiled block calls the
    # checkpointed part as an eager island (selective), or the checkpoint wraps the compiled block (full:
    # models/compile.py runs first). Only then: marking it imports dynamo, which an eager run never needs.
    return torch.compiler.disable(recompute) if compiled else recompute


def apply_activation_checkpointing(model: GPT, policy: str, compiled: bool = False) -> None:
    """``compiled``: the blocks were compiled (models/compile.py, ``train.compile``)."""
    if policy == "none":
        return
    if policy not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpointing policy {policy!r}")
    for block in model.layers.values():
        # Overriding forward on the instance keeps state_dict keys unchanged (no wrapper module).
        if policy == "full":
            block.forward = _recomputed(block.forward, model.rng, compiled)
        else:
            block.attn.core = _recomputed(block.attn.core, model.rng, compiled)
