"""ZeRO stage 3: a transformer block's parameters exist whole only while the block runs.

One bucket per block (the last block first) and one for each chunk's other parameters (its root), each kept as this
rank's shard; hooks on the modules gather a bucket when needed and free it when its last holder lets go: a block
while its forward runs and from its output's gradient to its reduce-scatter (an eager zb chunk past stage 0: to its
input's gradient, as W reads no weight), the root from the chunk's forward to its reduce-scatter;
``parallel.zero3_gather=step`` keeps every bucket to the step's end. Holds, not a flag, as a pipeline interleaves
several micro-batches' passes. The whole table: docs/parallelism.md, "How stage 3 holds its buckets".
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
    """Gather and free ``store``'s buckets around the chunks' forwards and backwards (see the module docstring):
    ``chunks``: (chunk, its blocks) with their ``ChunkUnits``; ``mode``: one of ``GATHER_MODES``; ``prefetch``:
    how many blocks ahead to gather. ``reduced(span)`` ends a backward's hold (the reducer's ``on_reduced``),
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
        self.units, self._early, self._armed = units, set[int](), set[tuple[int, int]]()  # release_after_input's
        self._handles: list[RemovableHandle] = []
        for (model, blocks), unit in zip(chunks, units, strict=True):
            self._handles.append(model.register_forward_pre_hook(lambda m, a, u=unit: self._before_chunk(u)))
            self._handles.append(model.register_forward_hook(lambda m, a, out, u=unit: self._after_chunk(u, out)))
            for i, block in enumerate(blocks):
                pre = lambda m, a, u=unit, i=i: self._before_block(u, i, a)  # noqa: E731
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

    def reduced(self, span: BucketSpan) -> None:
        """``span``'s gradients are reduce-scattered: its backward hold ends, unless its input gradient ended it."""
        if span.index not in self._early:
            self.released(span)

    def release_after_input(self, chunk: int) -> None:
        """Chunk ``chunk``'s W reads no weight: each block's backward hold ends with the block's input gradient."""
        self._early.update(span.index for span in self.units[chunk].blocks)

    def end_step(self) -> None:
        """The step's backward is reduced: every bucket is freed (step mode's, and any a pass left held)."""
        self._kept.clear()
        self._armed.clear()  # a forward whose backward never ran (a failed step) leaves its key
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

    def _before_block(self, unit: ChunkUnits, i: int, args: tuple) -> None:
        span, x = unit.blocks[i], args[0] if args else None
        self._hold(span)
        self._prefetch(unit, range(i + 1, i + 1 + self.depth))
        key = (span.index, id(x))
        early = span.index in self._early and x is not None and torch.is_grad_enabled() and x.requires_grad
        if early and key not in self._armed:  # once per input: a recomputation runs the block again on it
            self._armed.add(key)
            if i == 0:  # else block i - 1's backward starts with it, before its hold (_before_block_backward)
                x.register_hook(lambda grad: self._input_grad(key))

    def _input_grad(self, key: tuple[int, int]) -> None:
        if key in self._armed:
            self._armed.discard(key)
            self.released(self.store.layout.spans[key[0]])

    def _after_block(self, unit: ChunkUnits, i: int, output: torch.Tensor) -> None:
        self.released(unit.blocks[i])
        if output.requires_grad:  # the next block's input, if it is one
            after = (unit.blocks[i + 1].index, id(output)) if i + 1 < len(unit.blocks) else None
            output.register_hook(lambda grad: self._before_block_backward(unit, i, after))

    def _before_block_backward(self, unit: ChunkUnits, i: int, after: tuple[int, int] | None) -> None:
        if after is not None:
            self._input_grad(after)
        self._hold(unit.blocks[i])
        self._prefetch(unit, range(i - 1, i - 1 - self.depth, -1))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
