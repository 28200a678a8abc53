"""Activation checkpointing as an applier: it changes how blocks run, never their parameter names.

- ``full``: each transformer block keeps only its input; everything inside is recomputed in backward.
- ``selective``: only the attention core (softmax(QK^T)V, the part whose activations grow with T^2 and
  cost little to recompute) is recomputed, as in Megatron's selective recomputation.
"""

from __future__ import annotations

from torch.utils.checkpoint import checkpoint

from trident.models.gpt import GPT


def _recomputed(fn):
    return lambda *args: checkpoint(fn, *args, use_reentrant=False)


def apply_activation_checkpointing(model: GPT, policy: str) -> None:
    if policy == "none":
        return
    if policy not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpointing policy {policy!r}")
    for block in model.layers.values():
        # Overriding forward on the instance keeps state_dict keys unchanged (no wrapper module).
        if policy == "full":
            block.forward = _recomputed(block.forward)
        else:
            block.attn.core = _recomputed(block.attn.core)
