"""ZeRO stage 3: a transformer block's parameters exist whole only while the block runs.

The flat layout has one bucket per block and one for the rest of the model (embeddings, final LayerNorm: the
"root"), in the order backward finishes them: the last block first, the root last. ``ShardedParams`` keeps each
bucket as this rank's shard; hooks on the modules gather it when needed and free it after:

    forward   root: gathered before the model runs (it holds the embedding and the tied head), prefetch block 0
              block i: wait for its gather, prefetch block i+1; after it: free, and arm a hook on its output
    backward  the hook on block i's output (its gradient arrives before block i's backward runs, and before
              activation checkpointing recomputes the block): gather block i, prefetch block i-1
              a bucket whose gradients are all in is reduce-scattered (ShardedGradReducer), and freed then
    no grad   (evaluation) every bucket is freed right after its forward, the root after the model

A block's parameters are thus gathered twice per micro-batch and all-gathered once more overall than stages
0-2 (3 Psi of traffic per step instead of 2 Psi). The root stays gathered from the model's forward to the end
of its backward, as the root module does under FSDP.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trident.parallel.layout import FlatLayout, Span
from trident.parallel.zero.params import ShardedParams


def unit_layout(model: nn.Module, blocks: list[nn.Module], dp_size: int) -> FlatLayout:
    """One bucket per block, last block first, then one for every other parameter (the root)."""
    in_blocks = {p for block in blocks for p in block.parameters()}
    root = [p for p in model.parameters() if p not in in_blocks and p.requires_grad]
    units = [[p for p in block.parameters() if p.requires_grad] for block in reversed(blocks)]
    # Reverse registration order inside a bucket, as for the other stages.
    return FlatLayout([list(reversed(u)) for u in [*units, root]], dp_size)


class ParameterSharding:
    """Gather and free ``store``'s buckets around ``model``'s forward and backward (see the module docstring)."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], layout: FlatLayout, store: ShardedParams) -> None:
        self.store = store
        self.root: Span = layout.spans[-1]
        self.spans: list[Span] = list(reversed(layout.spans[:-1]))  # block i's bucket
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._before_model),
            model.register_forward_hook(self._after_model),
        ]
        for i, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(lambda m, args, i=i: self._before_block(i)))
            self._handles.append(block.register_forward_hook(lambda m, args, out, i=i: self._after_block(i, out)))

    def _prefetch(self, i: int) -> None:
        if 0 <= i < len(self.spans):
            self.store.gather(self.spans[i], wait=False)

    def _before_model(self, module: nn.Module, args: tuple) -> None:
        self.store.gather(self.root)
        self._prefetch(0)

    def _after_model(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(lambda grad: self._prefetch(len(self.spans) - 1))
        else:
            self.store.free(self.root)

    def _before_block(self, i: int) -> None:
        self.store.gather(self.spans[i])
        self._prefetch(i + 1)

    def _after_block(self, i: int, output: torch.Tensor) -> None:
        self.store.free(self.spans[i])
        if output.requires_grad:
            output.register_hook(lambda grad: self._before_block_backward(i))

    def _before_block_backward(self, i: int) -> None:
        self.store.gather(self.spans[i])
        self._prefetch(i - 1)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
