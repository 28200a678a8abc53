"""The flat layout of a rank's parameters: where each one's elements sit in one flat buffer, the buckets that
buffer is cut into, and the contiguous shard of each bucket that each data-parallel rank owns.

    flat buffer   | bucket 0 ........................ | bucket 1 ......... | ...
    bucket b      offset o_b, numel n_b: its parameters back to back, then zero padding up to a multiple of dp
    dp rank r     owns [o_b + r * n_b / dp, o_b + (r + 1) * n_b / dp) of every bucket

The gradient buffer (parallel/reducer.py), ZeRO's parameter buffer and its optimizer shards (parallel/zero/) all
use one layout, so a rank's shard of the gradients, of the master weights and of the parameters line up element
for element, and a reduce-scatter or an all-gather of a bucket is one collective over equal contiguous pieces.
Ranks whose parameters have the same local shapes (the tp ranks of one dp rank) get the same layout, so a shard
of one lines up with the same shard of the other.

A range of the flat buffer cuts parameters into ``Piece``s: a contiguous run of one parameter's flattened local
tensor. This module is arithmetic only: no process group, no tensor data.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from torch import nn


def padded_numel(numel: int, dp_size: int) -> int:
    """``numel`` rounded up to a multiple of dp, so it splits into dp equal contiguous shards."""
    return -(-numel // dp_size) * dp_size


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of a parameter's flattened local tensor, at ``flat`` in the flat buffer."""

    param: nn.Parameter
    start: int
    stop: int
    flat: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(eq=False)
class BucketSpan:
    """One bucket of the layout: its parameters back to back from ``offset``, ``numel`` padded to dp."""

    index: int
    offset: int
    numel: int
    params: list[nn.Parameter]

    def shard(self, rank: int, shards: int) -> tuple[int, int]:
        """The flat range [start, stop) of the bucket that shard ``rank`` of ``shards`` owns."""
        if self.numel % shards:
            raise ValueError(f"bucket of {self.numel} elements does not split into {shards} shards")
        size = self.numel // shards
        return self.offset + rank * size, self.offset + (rank + 1) * size


class FlatLayout:
    """Buckets of parameters, each a list in flat order; every bucket padded to a multiple of ``dp_size``."""

    def __init__(self, buckets: list[list[nn.Parameter]], dp_size: int) -> None:
        self.dp_size = dp_size
        self.spans: list[BucketSpan] = []
        self.offset: dict[nn.Parameter, int] = {}
        self.span_of: dict[nn.Parameter, BucketSpan] = {}
        offset = 0
        for params in buckets:
            span = BucketSpan(
                len(self.spans), offset, padded_numel(sum(p.numel() for p in params), dp_size), list(params)
            )
            start = offset
            for p in params:
                if p in self.offset:
                    raise ValueError("a parameter appears twice in the flat layout")
                self.offset[p], self.span_of[p] = start, span
                start += p.numel()
            self.spans.append(span)
            offset += span.numel
        self.numel = offset

    @classmethod
    def by_size(
        cls,
        params: list[nn.Parameter],
        bucket_numel: int,
        dp_size: int,
        isolate: Collection[nn.Parameter] = (),
        chunks: Sequence[Collection[nn.Parameter]] = (),
        apart: Collection[nn.Parameter] = (),
    ) -> FlatLayout:
        """Reverse registration order (roughly the order backward produces gradients), greedy buckets.

        Each parameter in ``isolate`` gets a bucket of its own, so its dp shards cover the same elements of it in
        any layout: two ranks with different parameters (pipeline stages holding an embedding and its tied copy)
        can then sum their shards of it over another group after a reduce-scatter.

        ``chunks``: the parameters of each model chunk (pipeline virtual stages, each a run of ``params``). No bucket
        holds parameters of two chunks, so a chunk's buckets can be reduced as soon as its last backward is done,
        whatever the other chunks still have to do.

        ``apart``: parameters that share no bucket with the others (expert weights, reduced over another group).
        They fill buckets of their own beside the others' run, cutting it nowhere: a model whose sparse layers sit
        between dense ones keeps its dense parameters in as few buckets as without them, so ep adds no reduction of
        the dense gradients. Buckets are listed as they fill up (their last parameter's place in the order).
        """
        isolated, parted = {id(p) for p in isolate}, {id(p) for p in apart}
        chunk_of = {id(p): c for c, ps in enumerate(chunks) for p in ps}
        buckets: list[list[nn.Parameter]] = []
        # The bucket being filled of each kind (False: the others, True: ``apart``); none spans two chunks or an
        # isolated parameter. Insertion order is the order their last parameters came in.
        filling: dict[bool, list[nn.Parameter]] = {}

        def cut() -> None:
            buckets.extend(filling.values())
            filling.clear()

        last: nn.Parameter | None = None
        for p in reversed(params):
            if last is not None and chunk_of.get(id(p)) != chunk_of.get(id(last)):
                cut()
            last = p
            if id(p) in isolated:
                cut()
                buckets.append([p])
                continue
            kind = id(p) in parted
            run = filling.pop(kind, [])
            if run and sum(q.numel() for q in run) + p.numel() > bucket_numel:
                buckets.append(run)
                run = []
            run.append(p)
            filling[kind] = run  # (re)inserted: the kinds stay in the order of their last parameters
        cut()
        return cls(buckets, dp_size)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for span in self.spans for p in span.params]

    def pieces(self, span: BucketSpan, start: int, stop: int) -> list[Piece]:
        """The parameters of ``span`` that overlap the flat range [start, stop), cut to it (padding has none)."""
        out = []
        for p in span.params:
            lo, hi = max(start, self.offset[p]), min(stop, self.offset[p] + p.numel())
            if lo < hi:
                out.append(Piece(p, lo - self.offset[p], hi - self.offset[p], lo))
        return out
