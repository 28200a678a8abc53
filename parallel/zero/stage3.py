"""ZeRO stage 3: a transformer block's parameters exist whole only while the block runs.

The flat layout has, per model chunk (a pipeline rank may hold several), one bucket per block, in the order
backward finishes them (the last block first), then the chunk's other parameters (the "root": embeddings, final
norm, LM head; under pipeline parallelism a tied embedding or its copy in a bucket of its own, and none on a
chunk that has neither). ``ShardedParams`` keeps each bucket as this rank's shard; hooks on the modules gather it
when needed and free it after. Each bucket counts its holders, and is freed when the last lets go:

    forward   root: held from the chunk's forward to the reduce-scatter of its gradients, prefetch blocks 0..d-1
              block i: held while it runs (prefetch i+1..i+d); after it, a hook armed on its output
    backward  the hook on block i's output (its gradient arrives before block i's backward runs, and before
              activation checkpointing recomputes the block): hold block i, prefetch i-1..i-d; the hold ends when
              the bucket's gradients are all in and reduce-scattered (ShardedGradReducer's ``on_reduced``)
    no grad   (evaluation) every hold ends with the forward that took it

Holds, not a gathered/freed flag, because a pipeline interleaves the forwards and backwards of several
micro-batches (1F1B, interleaved chunks): block i may run micro-batch 3's forward while micro-batch 1's backward
still needs it later, and under zb-h1 a block is held from its input-gradient pass (I) to its weight pass (W),
across the other actions between them. ``d`` is ``parallel.zero3_prefetch`` (0: no prefetch).

``parallel.zero3_gather`` chooses when a training forward's buckets are freed:

    micro_batch  as above: gathered for each micro-batch's forward and again for its backward; the least memory
                 (the roots and a few blocks), 2 all-gathers of every block per micro-batch
    step         every bucket used in the step stays gathered until the step's last backward is reduced (the
                 reducer's ``on_finish``), as FSDP's reshard_after_forward=False: one all-gather of each bucket per
                 step, and all of this rank's parameters whole during the step

The root stays gathered from a chunk's forward to the end of its backward in both, as the root module does under
FSDP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trident.parallel.layout import BucketSpan, FlatLayout
from trident.parallel.zero.params import ShardedParams

GATHER_MODES = ("micro_batch", "step")


@dataclass
class ChunkUnits:
    """One model chunk's buckets: ``blocks[i]`` its i-th block's (forward order), ``root`` the rest (0-2)."""

    blocks: list[BucketSpan]
    root: list[BucketSpan]


def unit_layout(
    chunks: list[tuple[nn.Module, list[nn.Module]]], dp_size: int, isolate: set[nn.Parameter] | frozenset = frozenset()
) -> tuple[FlatLayout, list[ChunkUnits]]:
    """Per (chunk, its blocks): one bucket per block, last block first, then one for the chunk's other
    parameters, and one for each of those in ``isolate`` (a tied embedding summed across stages must cover the same
    elements in every layout); an empty root has no bucket. A block's parameters in ``isolate`` (expert weights
    under ep, sharded over another group) join the root, each a bucket of its own: gathered for the whole of the
    chunk's forward and backward, as the root is."""
    buckets: list[list[nn.Parameter]] = []
    counts: list[tuple[int, int]] = []  # (blocks, root buckets) per chunk
    for model, blocks in chunks:
        in_blocks = {p for block in blocks for p in block.parameters()}
        root = [p for p in model.parameters() if p not in in_blocks and p.requires_grad]
        units = [[p for p in block.parameters() if p.requires_grad and p not in isolate] for block in reversed(blocks)]
        moved = [p for block in blocks for p in block.parameters() if p.requires_grad and p in isolate]
        roots = [[p for p in root if p not in isolate]] + [[p] for p in [*root, *moved] if p in isolate]
        roots = [r for r in roots if r]
        # Reverse registration order inside a bucket, as for the other stages.
        buckets += [list(reversed(u)) for u in [*units, *roots]]
        counts.append((len(units), len(roots)))
    layout = FlatLayout(buckets, dp_size)
    out, at = [], 0
    for n_blocks, n_roots in counts:
        spans = layout.spans[at : at + n_blocks + n_roots]
        out.append(ChunkUnits(list(reversed(spans[:n_blocks])), spans[n_blocks:]))
        at += n_blocks + n_roots
    return layout, out


class ParameterSharding:
    """Gather and free ``store``'s buckets around the chunks' forwards and backwards (see the module docstring).

    ``chunks``: (chunk, its blocks) with their ``ChunkUnits``; ``mode``: one of ``GATHER_MODES``; ``prefetch``:
    how many blocks ahead to gather. ``released(span)`` ends a backward's hold (the reducer's ``on_reduced``),
    ``end_step()`` frees every bucket (its ``on_finish``)."""

    def __init__(
        self,
        chunks: list[tuple[nn.Module, list[nn.Module]]],
        units: list[ChunkUnits],
        store: ShardedParams,
        mode: str = "micro_batch",
        prefetch: int = 1,
    ) -> None:
        if mode not in GATHER_MODES:
            raise ValueError(f"unknown ZeRO-3 gather mode {mode!r}; one of {GATHER_MODES}")
        self.store, self.mode, self.depth = store, mode, prefetch
        self._holds = [0] * len(store.layout.spans)
        self._kept: set[int] = set()  # step mode: buckets held until the step's end
        self._handles: list[RemovableHandle] = []
        for (model, blocks), unit in zip(chunks, units, strict=True):
            self._handles.append(model.register_forward_pre_hook(lambda m, a, u=unit: self._before_chunk(u)))
            self._handles.append(model.register_forward_hook(lambda m, a, out, u=unit: self._after_chunk(u, out)))
            for i, block in enumerate(blocks):
                pre = lambda m, a, u=unit, i=i: self._before_block(u, i)  # noqa: E731
                post = lambda m, a, out, u=unit, i=i: self._after_block(u, i, out)  # noqa: E731
                self._handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]

    def _hold(self, span: BucketSpan) -> None:
        self._holds[span.index] += 1
        if self.mode == "step" and torch.is_grad_enabled() and span.index not in self._kept:
            self._kept.add(span.index)
            self._holds[span.index] += 1
        self.store.gather(span)

    def released(self, span: BucketSpan) -> None:
        """One holder of ``span`` is done with it; the last one frees it."""
        self._holds[span.index] -= 1
        if self._holds[span.index] <= 0:
            self._holds[span.index] = 0
            self.store.free(span)

    def end_step(self) -> None:
        """The step's backward is reduced: every bucket is freed (step mode's, and any a pass left held)."""
        self._kept.clear()
        for span in self.store.layout.spans:
            self._holds[span.index] = 0
            self.store.free(span)

    def _prefetch(self, unit: ChunkUnits, blocks: range) -> None:
        for i in blocks:
            if 0 <= i < len(unit.blocks):
                self.store.gather(unit.blocks[i], wait=False)

    def _before_chunk(self, unit: ChunkUnits) -> None:
        for span in unit.root:
            self._hold(span)
        self._prefetch(unit, range(self.depth))

    def _after_chunk(self, unit: ChunkUnits, output: torch.Tensor) -> None:
        if output.requires_grad:  # the roots' holds end with their reduce-scatters
            last = len(unit.blocks) - 1
            output.register_hook(lambda grad: self._prefetch(unit, range(last, last - self.depth, -1)))
        else:
            for span in unit.root:
                self.released(span)

    def _before_block(self, unit: ChunkUnits, i: int) -> None:
        self._hold(unit.blocks[i])
        self._prefetch(unit, range(i + 1, i + 1 + self.depth))

    def _after_block(self, unit: ChunkUnits, i: int, output: torch.Tensor) -> None:
        self.released(unit.blocks[i])
        if output.requires_grad:
            output.register_hook(lambda grad: self._before_block_backward(unit, i))

    def _before_block_backward(self, unit: ChunkUnits, i: int) -> None:
        self._hold(unit.blocks[i])
        self._prefetch(unit, range(i - 1, i - 1 - self.depth, -1))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
